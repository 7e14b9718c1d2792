// Finding and loading a tokenizer (see tokenizer.h): PATH -> its files -> tokenizer_config.json's
// names and template -> the implementation for the main file. Every file is read through
// io/read_file.h (regular files only, bounded), so a FIFO or a device is refused, never read.
#include "tokenize/tokenizer.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "io/atomic_file.h"
#include "io/read_file.h"
#include "tokenize/tokenizer_backends.h"

namespace packmoe::tokenize {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// tokenizer.json of the largest models is tens of MB (Qwen's: 7 MB).
constexpr uint64_t kMaxTokenizerFileBytes = uint64_t{512} << 20;
constexpr const char* kConfigFile = "tokenizer_config.json";
constexpr const char* kTemplateFile = "chat_template.jinja";  // newer transformers save it apart

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

bool is_hf_json(const std::string& main) { return fs::path(main).extension() == ".json"; }

// A token name in tokenizer_config.json: a string, or an AddedToken object {"content": ...}.
Status read_token_name(const json& j, const char* key, const std::string& where,
                       std::optional<std::string>* out) {
  if (!j.contains(key) || j[key].is_null()) return Status::ok();
  const json& v = j[key];
  if (v.is_string()) {
    *out = v.get<std::string>();
  } else if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    *out = v["content"].get<std::string>();
  } else {
    return Status::error(where + ": " + key + " must be a string or {\"content\": ...} (got " +
                         json_brief(v) + ")");
  }
  return Status::ok();
}

Result<TokenizerConfig> read_config(const std::vector<std::string>& files) {
  TokenizerConfig c;
  for (const std::string& f : files) {
    const std::string name = fs::path(f).filename().string();
    if (name == kTemplateFile) {
      Result<std::string> text = io::read_regular_file(f, io::kMaxJsonFileBytes);
      if (!text) return text.status();
      c.chat_template = std::move(text.value());
    }
    if (name != kConfigFile) continue;
    Result<std::string> text = io::read_regular_file(f, io::kMaxJsonFileBytes);
    if (!text) return text.status();
    Result<json> j = parse_json_text(text.value(), f);
    if (!j) return j.status();
    if (!j.value().is_object()) return Status::error(f + ": must be a JSON object");
    const json& o = j.value();
    PACKMOE_RETURN_IF_ERROR(read_token_name(o, "eos_token", f, &c.eos_token));
    PACKMOE_RETURN_IF_ERROR(read_token_name(o, "bos_token", f, &c.bos_token));
    PACKMOE_RETURN_IF_ERROR(read_token_name(o, "pad_token", f, &c.pad_token));
    if (o.contains("chat_template") && !o["chat_template"].is_null() && !c.chat_template) {
      const json& t = o["chat_template"];
      if (t.is_string()) {
        c.chat_template = t.get<std::string>();
      } else if (t.is_array()) {  // [{"name": "default", "template": ...}, ...]
        for (const json& e : t)
          if (e.is_object() && e.contains("template") && e["template"].is_string() &&
              (!c.chat_template || (e.contains("name") && e["name"] == "default")))
            c.chat_template = e["template"].get<std::string>();
      } else {
        return Status::error(f + ": chat_template must be a string or a list of templates");
      }
    }
  }
  return c;
}

}  // namespace

Result<std::vector<std::string>> tokenizer_files(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return Status::error("--tokenizer " + path + ": not found");
  fs::path main;
  if (fs::is_directory(st)) {
    for (const char* name : {"tokenizer.json", "tokenizer.model"})
      if (is_file(fs::path(path) / name)) {
        main = fs::path(path) / name;
        break;
      }
    if (main.empty())
      return Status::error("--tokenizer " + path +
                           ": the directory holds neither tokenizer.json nor tokenizer.model");
  } else {
    main = path;
  }
  std::vector<std::string> files = {main.string()};
  for (const char* name : {kConfigFile, "special_tokens_map.json", kTemplateFile}) {
    const fs::path p = main.parent_path() / name;
    if (p != main && is_file(p)) files.push_back(p.string());
  }
  return files;
}

Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path) {
  Result<std::vector<std::string>> files = tokenizer_files(path);
  if (!files) return files.status();
  const std::string main = files.value().front();
  Result<TokenizerConfig> config = read_config(files.value());
  if (!config) return config.status();
  if (is_hf_json(main)) {
    Result<std::string> text = io::read_regular_file(main, kMaxTokenizerFileBytes);
    if (!text) return text.status();
    Result<json> j = parse_json_text(text.value(), main);
    if (!j) return j.status();
    Result<std::unique_ptr<Tokenizer>> t = make_hf_tokenizer(j.value(), config.value(), files.value());
    if (!t) return Status::error(main + ": " + t.status().message());
    return t;
  }
  // The library would block on a FIFO: only a regular file reaches it.
  Result<io::RegularFile> f = io::RegularFile::open(main);
  if (!f) return f.status();
  return make_sentencepiece_tokenizer(main, config.value(), files.value());
}

Result<std::vector<std::string>> copy_tokenizer_files(const std::string& path,
                                                      const std::string& dir) {
  Result<std::vector<std::string>> files = tokenizer_files(path);
  if (!files) return files.status();
  std::vector<std::string> names;
  for (const std::string& f : files.value()) {
    std::string name = fs::path(f).filename().string();
    if (f == files.value().front()) name = is_hf_json(f) ? "tokenizer.json" : "tokenizer.model";
    Result<std::string> bytes = io::read_regular_file(f, kMaxTokenizerFileBytes);
    if (!bytes) return bytes.status();
    const std::span<const uint8_t> parts[] = {std::span<const uint8_t>(
        reinterpret_cast<const uint8_t*>(bytes.value().data()), bytes.value().size())};
    PACKMOE_RETURN_IF_ERROR(io::write_file_atomic((fs::path(dir) / name).string(), parts));
    names.push_back(name);
  }
  return names;
}

Status Tokenizer::apply_config(const TokenizerConfig& c) {
  for (auto [name, key, out] : {std::tuple{&c.eos_token, "eos_token", &eos_id_},
                                {&c.bos_token, "bos_token", &bos_id_},
                                {&c.pad_token, "pad_token", &pad_id_}}) {
    if (!*name) continue;
    const std::optional<uint32_t> id = token_id(**name);
    if (!id)
      return Status::error(std::string("tokenizer_config.json: ") + key + " " +
                           json_brief(**name) + " is not a token of the tokenizer");
    *out = id;
  }
  if (c.chat_template) chat_template_ = c.chat_template;
  return Status::ok();
}

Status check_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int len = 0;
    uint32_t cp = 0, min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    }
    bool ok = len > 0 && i + len <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      ok = (d & 0xC0) == 0x80;
      cp = (cp << 6) | (d & 0x3F);
    }
    if (!ok || cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return Status::error("invalid UTF-8 at byte " + std::to_string(i));
    i += len;
  }
  return Status::ok();
}

}  // namespace packmoe::tokenize
