// Chat templates: the Jinja subset the Qwen2.5 / Qwen3 `chat_template`s use, rendered with
// Hugging Face's settings (trim_blocks, lstrip_blocks). Every rendered byte remembers where it
// came from (the index of the message whose field it copies, or the template's own text), so SFT
// knows which bytes are an assistant's without guessing from the text. Invariant: a construct
// outside the subset is an error naming it (at parse time for statements, when evaluated for
// filters, tests and methods), never a silently different rendering.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace packmoe::tokenize {

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant"
  std::string content;
};

// The text of a rendered conversation and, per byte, the message it came from (-1: the
// template's own text).
struct RenderedChat {
  std::string text;
  std::vector<int32_t> source;  // (text.size())
};

// The variables a template sees besides `messages` and `add_generation_prompt`; absent ones are
// undefined (as `tools` and `enable_thinking` always are).
struct ChatVariables {
  std::optional<std::string> bos_token, eos_token;
};

class ChatTemplate {
 public:
  // Parses `source` (a tokenizer_config.json chat_template). Errors name the line and the
  // construct: `chat template line 3: '{% macro' is not supported`.
  static Result<ChatTemplate> parse(std::string_view source);
  Result<RenderedChat> render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                              const ChatVariables& vars = {}) const;

  struct Node;  // the parsed template (tokenize/chat_template_ast.h)

 private:
  std::shared_ptr<const Node> root_;
};

}  // namespace packmoe::tokenize
