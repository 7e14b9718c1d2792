// SFT conversations: JSONL lines checked and read into messages, rendered (chat template or the
// plain template) and tokenized piece by piece with their loss flags.
#include "train/sft_data.h"

#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "io/read_file.h"
#include "io/text_corpus.h"

namespace packmoe::train {
namespace {

using tokenize::ChatMessage;

// SFT files are read whole; far above any fine-tuning set that tokenizes on the fly.
constexpr uint64_t kMaxSftFileBytes = uint64_t{4} << 30;

Status check_messages(const std::vector<ChatMessage>& messages) {
  bool assistant = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant")
      return Status::error("message " + std::to_string(i) + ": unknown role '" +
                           printable_text(m.role.substr(0, 64)) +
                           "' (expected system, user or assistant)");
    if (m.role == "assistant") {
      if (m.content.empty())
        return Status::error("message " + std::to_string(i) + ": an empty assistant message");
      assistant = true;
    }
  }
  if (!assistant) return Status::error("a conversation without an assistant message");
  return Status::ok();
}

Result<std::string> string_field(const nlohmann::json& object, const char* key,
                                 const std::string& where) {
  auto it = object.find(key);
  if (it == object.end()) return Status::error(where + ": no \"" + key + "\"");
  if (!it->is_string())
    return Status::error(where + ": \"" + key + "\" is " + json_brief(*it) + ", not a string");
  return it->get<std::string>();
}

// The messages of one JSONL object (errors without the file position; the caller adds it).
Result<std::vector<ChatMessage>> messages_of(const nlohmann::json& j) {
  if (!j.is_object()) return Status::error("a line is a JSON object, this one is " + json_brief(j));
  std::vector<ChatMessage> out;
  if (auto it = j.find("messages"); it != j.end()) {
    if (!it->is_array())
      return Status::error("\"messages\" is " + json_brief(*it) + ", not a list");
    for (size_t i = 0; i < it->size(); ++i) {
      const nlohmann::json& m = (*it)[i];
      const std::string where = "message " + std::to_string(i);
      if (!m.is_object()) return Status::error(where + " is " + json_brief(m) + ", not an object");
      for (const auto& [key, value] : m.items())
        if (key != "role" && key != "content")
          return Status::error(where + ": unknown key \"" + printable_text(key.substr(0, 64)) +
                               "\" (a message has \"role\" and \"content\")");
      Result<std::string> role = string_field(m, "role", where);
      if (!role) return role.status();
      Result<std::string> content = string_field(m, "content", where);
      if (!content) return content.status();
      out.push_back({role.value(), content.value()});
    }
    return out;
  }
  if (j.contains("prompt") || j.contains("response")) {
    Result<std::string> prompt = string_field(j, "prompt", "the pair");
    if (!prompt) return prompt.status();
    Result<std::string> response = string_field(j, "response", "the pair");
    if (!response) return response.status();
    if (response.value().empty()) return Status::error("an empty \"response\"");
    return std::vector<ChatMessage>{{"user", prompt.value()}, {"assistant", response.value()}};
  }
  return Status::error("neither \"messages\" nor \"prompt\" / \"response\"");
}

}  // namespace

Result<SftRenderer> SftRenderer::create(const tokenize::Tokenizer& tokenizer) {
  SftRenderer r(tokenizer);
  if (tokenizer.chat_template()) {
    Result<tokenize::ChatTemplate> t = tokenize::ChatTemplate::parse(*tokenizer.chat_template());
    if (!t) return Status::error("the tokenizer's " + t.status().message());
    r.tmpl_ = std::move(t.value());
  } else if (!tokenizer.eos_id()) {
    return Status::error(
        "the tokenizer has neither a chat template nor an eos token, which the "
        "plain SFT template ends each assistant turn with");
  }
  const auto text_of = [&](std::optional<uint32_t> id) -> std::optional<std::string> {
    if (!id) return std::nullopt;
    const uint32_t ids[] = {*id};
    std::string s = tokenizer.decode(ids);
    if (s.empty()) return std::nullopt;
    return s;
  };
  r.vars_.bos_token = text_of(tokenizer.bos_id());
  r.vars_.eos_token = text_of(tokenizer.eos_id());
  return r;
}

Status SftRenderer::append(std::string_view text, bool trained, SftConversation& out) const {
  if (text.empty()) return Status::ok();
  Result<std::vector<uint32_t>> ids = tokenizer_->encode(text);
  if (!ids) return ids.status();
  out.tokens.insert(out.tokens.end(), ids.value().begin(), ids.value().end());
  out.trained.insert(out.trained.end(), ids.value().size(), trained ? 1 : 0);
  return Status::ok();
}

Result<SftConversation> SftRenderer::encode_plain(const std::vector<ChatMessage>& messages) const {
  // docs/data.md: "System: ...\n\n", "User: ...\n\n", "Assistant: " + content + <eos>.
  SftConversation out;
  for (const ChatMessage& m : messages) {
    if (m.role == "assistant") {
      PACKMOE_RETURN_IF_ERROR(append("Assistant: ", false, out));
      PACKMOE_RETURN_IF_ERROR(append(m.content, true, out));
      out.tokens.push_back(*tokenizer_->eos_id());
      out.trained.push_back(1);
    } else {
      PACKMOE_RETURN_IF_ERROR(
          append((m.role == "system" ? "System: " : "User: ") + m.content + "\n\n", false, out));
    }
  }
  return out;
}

Result<SftConversation> SftRenderer::encode(const std::vector<ChatMessage>& messages) const {
  PACKMOE_RETURN_IF_ERROR(check_messages(messages));
  if (!tmpl_) return encode_plain(messages);
  Result<tokenize::RenderedChat> rendered = tmpl_->render(messages, false, vars_);
  if (!rendered) return Status::error("the tokenizer's " + rendered.status().message());
  const std::string& text = rendered.value().text;
  const std::vector<int32_t>& source = rendered.value().source;
  // Each assistant message's span: its first to its last printed byte.
  std::vector<std::pair<size_t, size_t>> spans;  // [begin, end) in message order
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role != "assistant") continue;
    size_t begin = text.size(), end = 0;
    for (size_t b = 0; b < text.size(); ++b)
      if (source[b] == static_cast<int32_t>(i)) {
        begin = std::min(begin, b);
        end = b + 1;
      }
    if (end == 0)
      return Status::error("the chat template does not print assistant message " +
                           std::to_string(i) + ", so it cannot be trained on");
    if (!spans.empty() && begin < spans.back().second)
      return Status::error("the chat template prints assistant message " + std::to_string(i) +
                           " before the one ahead of it");
    spans.emplace_back(begin, end);
  }
  // Untrained text, a trained span, the special token that ends it (trained), and so on.
  SftConversation out;
  size_t at = 0;
  bool turn_ended = true;  // the last span's end-of-turn token is found (or there is none)
  for (size_t k = 0; k <= spans.size(); ++k) {
    const size_t until = k < spans.size() ? spans[k].first : text.size();
    const size_t first = out.tokens.size();
    PACKMOE_RETURN_IF_ERROR(append(std::string_view(text).substr(at, until - at), false, out));
    if (!turn_ended && out.tokens.size() > first && tokenizer_->is_special(out.tokens[first]))
      out.trained[first] = 1;
    if (k == spans.size()) break;
    PACKMOE_RETURN_IF_ERROR(
        append(std::string_view(text).substr(spans[k].first, spans[k].second - spans[k].first),
               true, out));
    at = spans[k].second;
    turn_ended = false;
  }
  return out;
}

Result<std::vector<SftConversation>> read_sft_file(const std::string& path,
                                                   const SftRenderer& renderer) {
  Result<std::string> text = io::read_regular_file(path, kMaxSftFileBytes);
  if (!text) return text.status();
  std::vector<SftConversation> out;
  const std::string& s = text.value();
  int64_t line = 0;
  for (size_t at = 0; at < s.size();) {
    size_t end = s.find('\n', at);
    if (end == std::string::npos) end = s.size();
    const std::string_view row = std::string_view(s).substr(at, end - at);
    at = end + 1;
    ++line;
    if (row.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = path + ":" + std::to_string(line);
    Result<nlohmann::json> j = parse_json_text(row, where);
    if (!j) return j.status();
    Result<std::vector<ChatMessage>> messages = messages_of(j.value());
    if (!messages) return Status::error(where + ": " + messages.status().message());
    Result<SftConversation> c = renderer.encode(messages.value());
    if (!c) return Status::error(where + ": " + c.status().message());
    c.value().line = line;
    c.value().key = io::document_hash(row);
    out.push_back(std::move(c.value()));
  }
  if (out.empty()) return Status::error(path + ": no conversations (an empty SFT file)");
  return out;
}

}  // namespace packmoe::train
