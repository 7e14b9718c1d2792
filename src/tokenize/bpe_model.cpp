// BPE merges by rank with a min-heap over candidate pairs (see bpe_model.h). Stale heap entries
// (a symbol merged away since) are recognised on pop by re-looking up the pair, as tokenizers
// does, so each merge costs O(log n) and long pre-tokens (runs of spaces) stay linear-ish.
#include "tokenize/bpe_model.h"

#include <functional>
#include <queue>

#include "core/json_limits.h"
#include "tokenize/byte_level.h"

namespace packmoe::tokenize {
namespace {

using nlohmann::json;

Status field_error(const std::string& field, const std::string& problem) {
  return Status::error("tokenizer.json: " + field + ": " + problem);
}

bool null_or(const json& m, const char* key, const std::function<bool(const json&)>& ok) {
  return !m.contains(key) || m[key].is_null() || ok(m[key]);
}

}  // namespace

Result<BpeModel> BpeModel::from_json(const json& m) {
  if (!m.is_object()) return field_error("model", "must be an object");
  if (!m.contains("type") || m["type"] != "BPE")
    return field_error("model.type", (m.contains("type") ? json_brief(m["type"]) : "absent") +
                                         " is not supported (only BPE)");
  if (!null_or(m, "dropout", [](const json& v) { return v.is_number() && v.get<double>() == 0; }))
    return field_error("model.dropout", json_brief(m["dropout"]) + " is not supported (null only)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!null_or(m, key, [](const json& v) { return v.is_string() && v.get<std::string>().empty(); }))
      return field_error(std::string("model.") + key, json_brief(m[key]) +
                                                          " is not supported (byte-level BPE uses none)");
  if (!null_or(m, "byte_fallback", [](const json& v) { return v.is_boolean() && !v.get<bool>(); }))
    return field_error("model.byte_fallback",
                       "true is not supported (byte-level BPE needs no byte fallback)");
  // An unk_token is never produced: every byte has a symbol (checked below), so it is ignored.
  if (!null_or(m, "unk_token", [](const json& v) { return v.is_string(); }))
    return field_error("model.unk_token", "must be null or a string");
  BpeModel bpe;
  if (m.contains("ignore_merges")) {
    if (!m["ignore_merges"].is_boolean()) return field_error("model.ignore_merges", "must be a boolean");
    bpe.ignore_merges_ = m["ignore_merges"].get<bool>();
  }
  if (!m.contains("vocab") || !m["vocab"].is_object())
    return field_error("model.vocab", "must be an object of token -> id");
  for (const auto& [token, id] : m["vocab"].items()) {
    if (!id.is_number_unsigned() || id.get<uint64_t>() >= (uint64_t{1} << 31))
      return field_error("model.vocab[" + json_brief(token) + "]", "id " + json_brief(id) +
                                                                      " must be an integer in [0, 2^31)");
    bpe.vocab_.emplace(token, static_cast<uint32_t>(id.get<uint64_t>()));
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = bpe.vocab_.find(byte_symbol(static_cast<uint8_t>(b)));
    if (it == bpe.vocab_.end())
      return field_error("model.vocab", "lacks the byte-level symbol " +
                                            json_brief(byte_symbol(static_cast<uint8_t>(b))) +
                                            " of byte " + std::to_string(b) +
                                            " (every byte needs one: the ByteLevel alphabet)");
    bpe.byte_ids_[b] = it->second;
  }
  if (!m.contains("merges") || !m["merges"].is_array())
    return field_error("model.merges", "must be an array");
  const json& merges = m["merges"];
  for (size_t r = 0; r < merges.size(); ++r) {
    const json& e = merges[r];
    const std::string where = "model.merges[" + std::to_string(r) + "]";
    std::string left, right;
    if (e.is_string()) {  // "a b" (the older form)
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        return field_error(where, json_brief(e) + " must be two tokens separated by one space");
      left = s.substr(0, sp);
      right = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      left = e[0].get<std::string>();
      right = e[1].get<std::string>();
    } else {
      return field_error(where, json_brief(e) + " must be \"a b\" or [\"a\", \"b\"]");
    }
    const auto a = bpe.vocab_.find(left), b = bpe.vocab_.find(right),
               c = bpe.vocab_.find(left + right);
    if (a == bpe.vocab_.end() || b == bpe.vocab_.end() || c == bpe.vocab_.end())
      return field_error(where, json_brief(e) + ": " +
                                    (a == bpe.vocab_.end()   ? json_brief(left)
                                     : b == bpe.vocab_.end() ? json_brief(right)
                                                             : json_brief(left + right)) +
                                    " is not in model.vocab");
    // A pair listed twice keeps its last rank, as tokenizers' collect into a HashMap does.
    bpe.merges_.insert_or_assign(pair_key(a->second, b->second),
                                 Merge{static_cast<uint32_t>(r), c->second});
  }
  return bpe;
}

void BpeModel::encode(std::string_view bytes, std::vector<uint32_t>* out) const {
  if (bytes.empty()) return;
  if (ignore_merges_) {
    std::string word;
    for (unsigned char b : bytes) word += byte_symbol(b);
    const auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  const int n = static_cast<int>(bytes.size());
  struct Symbol {
    uint32_t id;
    int prev, next;  // -1: none
    bool alive;
  };
  std::vector<Symbol> sym(n);
  for (int i = 0; i < n; ++i)
    sym[i] = {byte_ids_[static_cast<unsigned char>(bytes[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
  struct Candidate {
    uint32_t rank;
    int pos;  // left symbol
    uint32_t result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push = [&](int pos) {
    if (pos < 0 || sym[pos].next < 0) return;
    const auto it = merges_.find(pair_key(sym[pos].id, sym[sym[pos].next].id));
    if (it != merges_.end()) heap.push({it->second.rank, pos, it->second.result});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& left = sym[c.pos];
    if (!left.alive || left.next < 0) continue;
    const auto it = merges_.find(pair_key(left.id, sym[left.next].id));
    if (it == merges_.end() || it->second.rank != c.rank) continue;  // stale
    Symbol& right = sym[left.next];
    left.id = c.result;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = c.pos;
    push(left.prev);
    push(c.pos);
  }
  for (int i = 0; i >= 0; i = sym[i].next) out->push_back(sym[i].id);
}

}  // namespace packmoe::tokenize
