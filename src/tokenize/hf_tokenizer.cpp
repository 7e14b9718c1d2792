// tokenizer.json parsing and the encode pipeline (see hf_tokenizer.h): added tokens without
// normalization are split out of the raw text, the rest is NFC-normalized (when the file says so),
// added tokens with normalization are split out of that, and each remaining stretch goes through
// the pre-tokenizer steps and the BPE model.
#include "tokenize/hf_tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <algorithm>

#include "core/json_limits.h"
#include "tokenize/byte_level.h"
#include "tokenize/tokenizer_backends.h"

namespace packmoe::tokenize {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer pattern (ByteLevel with use_regex: tokenizers' pre_tokenizers/byte_level.rs).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

Status field_error(const std::string& field, const std::string& problem) {
  return Status::error("tokenizer.json: " + field + ": " + problem);
}

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") ? json_brief(j["type"]) : json_brief(j);
}

Status read_bool(const json& j, const char* key, const std::string& field, bool* out) {
  if (!j.contains(key) || j[key].is_null()) return Status::ok();
  if (!j[key].is_boolean()) return field_error(field + "." + key, "must be a boolean");
  *out = j[key].get<bool>();
  return Status::ok();
}

// Rust's char::is_whitespace (Unicode White_Space), for lstrip / rstrip.
bool is_whitespace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// Start of the character that ends before byte `at`.
size_t prev_char(std::string_view s, size_t at) {
  size_t i = at - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

std::string nfc(std::string_view text) {
  if (std::all_of(text.begin(), text.end(), [](char c) { return (c & 0x80) == 0; }))
    return std::string(text);  // ASCII is NFC
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* norm = icu::Normalizer2::getNFCInstance(err);
  PACKMOE_CHECK(U_SUCCESS(err), "ICU NFC normalizer unavailable: " << u_errorName(err));
  const icu::UnicodeString u =
      icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), static_cast<int32_t>(text.size())));
  const icu::UnicodeString n = norm->normalize(u, err);
  PACKMOE_CHECK(U_SUCCESS(err), "ICU NFC normalization failed: " << u_errorName(err));
  std::string out;
  n.toUTF8String(out);
  return out;
}

}  // namespace

Status HfTokenizer::parse_added_tokens(const json& added) {
  if (added.is_null()) return Status::ok();
  if (!added.is_array()) return field_error("added_tokens", "must be an array");
  for (size_t i = 0; i < added.size(); ++i) {
    const json& t = added[i];
    const std::string field = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object() || !t.contains("id") || !t.contains("content") || !t["content"].is_string())
      return field_error(field, "must be an object with id and content");
    if (!t["id"].is_number_unsigned() || t["id"].get<uint64_t>() >= (uint64_t{1} << 31))
      return field_error(field + ".id", json_brief(t["id"]) + " must be an integer in [0, 2^31)");
    AddedToken a;
    a.id = static_cast<uint32_t>(t["id"].get<uint64_t>());
    a.content = t["content"].get<std::string>();
    if (a.content.empty()) return field_error(field + ".content", "must not be empty");
    if (Status s = check_utf8(a.content); !s) return field_error(field + ".content", s.message());
    for (auto [key, flag] : {std::pair{"special", &a.special}, {"single_word", &a.single_word},
                             {"lstrip", &a.lstrip}, {"rstrip", &a.rstrip},
                             {"normalized", &a.normalized}})
      PACKMOE_RETURN_IF_ERROR(read_bool(t, key, field, flag));
    added_.push_back(std::move(a));
  }
  return Status::ok();
}

Status HfTokenizer::parse_pre_tokenizer(const json& pre, const std::string& field) {
  if (!pre.is_object() || !pre.contains("type"))
    return field_error(field, type_of(pre) + " is not supported (byte-level BPE needs ByteLevel)");
  const json& type = pre["type"];
  if (type == "Sequence") {
    if (!pre.contains("pretokenizers") || !pre["pretokenizers"].is_array())
      return field_error(field + ".pretokenizers", "must be an array");
    for (size_t i = 0; i < pre["pretokenizers"].size(); ++i)
      PACKMOE_RETURN_IF_ERROR(parse_pre_tokenizer(
          pre["pretokenizers"][i], field + ".pretokenizers[" + std::to_string(i) + "]"));
    return Status::ok();
  }
  if (type == "Split") {
    if (pre.contains("invert") && pre["invert"] != false)
      return field_error(field + ".invert", json_brief(pre["invert"]) + " is not supported (false only)");
    if (!pre.contains("behavior") || pre["behavior"] != "Isolated")
      return field_error(field + ".behavior",
                         (pre.contains("behavior") ? json_brief(pre["behavior"]) : "absent") +
                             " is not supported (Isolated only)");
    const json& p = pre.contains("pattern") ? pre["pattern"] : json();
    const bool literal = p.is_object() && p.contains("String") && p["String"].is_string();
    if (!literal && !(p.is_object() && p.contains("Regex") && p["Regex"].is_string()))
      return field_error(field + ".pattern", "must be {\"Regex\": ...} or {\"String\": ...}");
    Result<Regex> r = Regex::compile(p[literal ? "String" : "Regex"].get<std::string>(),
                                     "tokenizer.json: " + field + ".pattern", literal);
    if (!r) return r.status();
    steps_.push_back({std::move(r.value()), false});
    return Status::ok();
  }
  if (type == "ByteLevel") {
    bool add_prefix_space = false, use_regex = true;
    PACKMOE_RETURN_IF_ERROR(read_bool(pre, "add_prefix_space", field, &add_prefix_space));
    PACKMOE_RETURN_IF_ERROR(read_bool(pre, "use_regex", field, &use_regex));
    steps_.push_back({std::nullopt, add_prefix_space});
    if (use_regex) {
      Result<Regex> r = Regex::compile(kGpt2Pattern, "ByteLevel's GPT-2 pattern");
      if (!r) return r.status();
      steps_.push_back({std::move(r.value()), false});
    }
    return Status::ok();
  }
  return field_error(field + ".type", json_brief(type) +
                                          " is not supported (Sequence, Split, ByteLevel only)");
}

Result<std::unique_ptr<HfTokenizer>> HfTokenizer::create(const json& j,
                                                         const TokenizerConfig& config,
                                                         std::vector<std::string> files) {
  if (!j.is_object()) return Status::error("tokenizer.json: must be a JSON object");
  std::unique_ptr<HfTokenizer> t(new HfTokenizer());
  t->files_ = std::move(files);
  for (const char* key : {"truncation", "padding"})
    if (j.contains(key) && !j[key].is_null())
      return field_error(key, "is not supported (null only: packmoe never truncates or pads)");
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const json& n = j["normalizer"];
    if (!(n.is_object() && n.contains("type") && n["type"] == "NFC"))
      return field_error("normalizer.type", type_of(n) + " is not supported (null or NFC only)");
    t->nfc_ = true;
  }
  PACKMOE_RETURN_IF_ERROR(t->parse_pre_tokenizer(
      j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json(), "pre_tokenizer"));
  if (std::none_of(t->steps_.begin(), t->steps_.end(),
                   [](const PreTokenizerStep& s) { return !s.split; }))
    return field_error("pre_tokenizer", "has no ByteLevel step (byte-level BPE only)");
  if (!j.contains("model")) return field_error("model", "is absent");
  Result<BpeModel> bpe = BpeModel::from_json(j["model"]);
  if (!bpe) return bpe.status();
  t->bpe_ = std::move(bpe.value());
  const json& dec = j.contains("decoder") ? j["decoder"] : json();
  if (!(dec.is_object() && dec.contains("type") && dec["type"] == "ByteLevel"))
    return field_error("decoder.type", type_of(dec) + " is not supported (ByteLevel only)");
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    // Templates add tokens only with add_special_tokens=True, which encode never does.
    const json& p = j["post_processor"];
    std::vector<const json*> items = {&p};
    if (p.is_object() && p.contains("type") && p["type"] == "Sequence" && p.contains("processors") &&
        p["processors"].is_array()) {
      items.clear();
      for (const json& q : p["processors"]) items.push_back(&q);
    }
    for (const json* q : items)
      if (!(q->is_object() && q->contains("type") &&
            ((*q)["type"] == "ByteLevel" || (*q)["type"] == "TemplateProcessing")))
        return field_error("post_processor.type", type_of(*q) +
                                                      " is not supported (ByteLevel, "
                                                      "TemplateProcessing or a Sequence of them)");
  }
  PACKMOE_RETURN_IF_ERROR(t->parse_added_tokens(j.contains("added_tokens") ? j["added_tokens"] : json()));

  // Ids: the vocabulary's, then the added tokens' (which may repeat a vocabulary id).
  uint32_t size = 0;
  for (const auto& [token, id] : t->bpe_.vocab()) size = std::max(size, id + 1);
  for (const AddedToken& a : t->added_) size = std::max(size, a.id + 1);
  // Ids are dense in every real file; a sparse one would make the id table a memory bomb.
  const uint64_t entries = t->bpe_.vocab().size() + t->added_.size();
  if (size > 2 * entries + 1024)
    return field_error("model.vocab", "ids reach " + std::to_string(size - 1) + " for only " +
                                          std::to_string(entries) + " tokens (ids must be dense)");
  t->id_to_token_.assign(size, std::string());
  t->special_.assign(size, 0);
  for (const auto& [token, id] : t->bpe_.vocab()) t->id_to_token_[id] = token;
  for (const AddedToken& a : t->added_) {
    t->id_to_token_[a.id] = a.content;
    t->special_[a.id] = a.special;
    t->added_ids_[a.content] = a.id;
  }
  for (const AddedToken& a : t->added_) {
    AddedMatcher& m = a.normalized && t->nfc_ ? t->normalized_added_ : t->raw_added_;
    m.by_first_byte[static_cast<unsigned char>(a.content[0])].push_back(&a);
    m.empty = false;
    if (a.single_word && !t->word_char_) {
      Result<Regex> w = Regex::compile(R"(\w)", "single_word's word characters");
      if (!w) return w.status();
      t->word_char_ = std::move(w.value());
    }
  }
  for (AddedMatcher* m : {&t->raw_added_, &t->normalized_added_})
    for (auto& list : m->by_first_byte)
      std::stable_sort(list.begin(), list.end(), [](const AddedToken* a, const AddedToken* b) {
        return a->content.size() > b->content.size();
      });

  // eos without tokenizer_config.json: the usual end-of-text names, where the vocabulary has one.
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
    if (const auto id = t->token_id(name)) {
      t->eos_id_ = id;
      break;
    }
  }
  PACKMOE_RETURN_IF_ERROR(t->apply_config(config));
  return t;
}

std::optional<uint32_t> HfTokenizer::token_id(std::string_view token) const {
  const std::string key(token);
  if (const auto it = added_ids_.find(key); it != added_ids_.end()) return it->second;
  if (const auto it = bpe_.vocab().find(key); it != bpe_.vocab().end()) return it->second;
  return std::nullopt;
}

template <typename OnText>
void HfTokenizer::split_added(std::string_view text, const AddedMatcher& m,
                              std::vector<uint32_t>* out, OnText&& on_text) const {
  if (m.empty) {
    on_text(text);
    return;
  }
  size_t done = 0;  // text before this is emitted
  for (size_t i = 0; i < text.size(); ++i) {
    const auto& candidates = m.by_first_byte[static_cast<unsigned char>(text[i])];
    const AddedToken* hit = nullptr;
    for (const AddedToken* a : candidates) {  // longest first
      if (text.compare(i, a->content.size(), a->content) == 0) {
        hit = a;
        break;
      }
    }
    if (hit == nullptr) continue;
    size_t b = i, e = i + hit->content.size();
    if (hit->single_word &&
        ((b > 0 && word_char_->matches_at(text, prev_char(text, b))) ||
         (e < text.size() && word_char_->matches_at(text, e))))
      continue;
    if (hit->lstrip) {
      while (b > done) {
        const size_t p = prev_char(text, b);
        size_t q = p;
        if (!is_whitespace(next_codepoint(text, &q))) break;
        b = p;
      }
    }
    if (hit->rstrip) {
      while (e < text.size()) {
        size_t q = e;
        if (!is_whitespace(next_codepoint(text, &q))) break;
        e = q;
      }
    }
    if (b > done) on_text(text.substr(done, b - done));
    out->push_back(hit->id);
    done = e;
    i = e - 1;
  }
  if (done < text.size()) on_text(text.substr(done));
}

void HfTokenizer::encode_plain(std::string_view text, std::vector<uint32_t>* out) const {
  std::vector<std::string> pieces = {std::string(text)};
  std::vector<std::string_view> parts;
  for (const PreTokenizerStep& step : steps_) {
    std::vector<std::string> next;
    for (std::string& p : pieces) {
      if (!step.split) {  // ByteLevel: the prefix space; the byte mapping happens in the model
        if (step.add_prefix_space && (p.empty() || p[0] != ' ')) p.insert(0, 1, ' ');
        next.push_back(std::move(p));
        continue;
      }
      parts.clear();
      step.split->split_isolated(p, &parts);
      for (std::string_view s : parts) next.emplace_back(s);
    }
    pieces = std::move(next);
  }
  for (const std::string& p : pieces) bpe_.encode(p, out);
}

Result<std::vector<uint32_t>> HfTokenizer::encode(std::string_view text) const {
  PACKMOE_RETURN_IF_ERROR(check_utf8(text));
  std::vector<uint32_t> out;
  split_added(text, raw_added_, &out, [&](std::string_view raw) {
    if (!nfc_) {
      encode_plain(raw, &out);
      return;
    }
    const std::string normalized = nfc(raw);
    split_added(normalized, normalized_added_, &out,
                [&](std::string_view s) { encode_plain(s, &out); });
  });
  return out;
}

std::string HfTokenizer::decode(std::span<const uint32_t> ids, bool skip_special) const {
  std::string out;
  for (uint32_t id : ids) {
    if (id >= id_to_token_.size() || id_to_token_[id].empty()) continue;
    if (skip_special && special_[id]) continue;
    append_decoded_token(id_to_token_[id], &out);
  }
  return out;
}

Result<std::unique_ptr<Tokenizer>> make_hf_tokenizer(const json& j, const TokenizerConfig& config,
                                                     std::vector<std::string> files) {
  Result<std::unique_ptr<HfTokenizer>> t = HfTokenizer::create(j, config, std::move(files));
  if (!t) return t.status();
  return std::unique_ptr<Tokenizer>(std::move(t.value()));
}

}  // namespace packmoe::tokenize
