// The chat template subset against renderings derived by hand from the real Qwen3 and Qwen2.5
// chat templates (as the models' tokenizer_config.json carry them): system and
// multi-turn conversations, reasoning split out of the content, the generation prompt, each
// byte's source, whitespace control, and every unsupported construct refused by name. The
// template texts: tests/common/qwen_chat_templates.h.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/qwen_chat_templates.h"
#include "tokenize/chat_template.h"

namespace packmoe::tokenize {
namespace {

using test::kQwen25;
using test::kQwen3;

RenderedChat render(const char* source, const std::vector<ChatMessage>& messages,
                    bool generation_prompt = false) {
  Result<ChatTemplate> t = ChatTemplate::parse(source);
  EXPECT_TRUE(t) << t.status().message();
  Result<RenderedChat> r = t.value().render(messages, generation_prompt);
  EXPECT_TRUE(r) << r.status().message();
  EXPECT_EQ(r.value().source.size(), r.value().text.size());
  return r.value();
}

// The bytes of `text` that came from message m, in order.
std::string from_message(const RenderedChat& r, int32_t m) {
  std::string out;
  for (size_t i = 0; i < r.text.size(); ++i)
    if (r.source[i] == m) out += r.text[i];
  return out;
}

TEST(ChatTemplate, Qwen3SystemUserAssistant) {
  const RenderedChat r =
      render(kQwen3, {{"system", "Be brief."}, {"user", "Hi there"}, {"assistant", "Hello!"}});
  EXPECT_EQ(r.text,
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n");
  EXPECT_EQ(from_message(r, 0), "Be brief.");
  EXPECT_EQ(from_message(r, 1), "Hi there");
  EXPECT_EQ(from_message(r, 2), "Hello!");
  // The assistant's bytes are exactly where its content is printed.
  const size_t at = r.text.find("Hello!");
  for (size_t i = 0; i < r.text.size(); ++i)
    EXPECT_EQ(r.source[i] == 2, i >= at && i < at + 6) << i;
}

TEST(ChatTemplate, Qwen3MultiTurnDropsEarlierReasoning) {
  // The last user query is message 2: only the assistant after it keeps its <think> block; the
  // earlier one's reasoning is cut out of its content.
  const RenderedChat r = render(kQwen3, {{"user", "A?"},
                                         {"assistant", "<think>\nr1\n</think>\n\nB."},
                                         {"user", "C?"},
                                         {"assistant", "<think>\nr2\n</think>\n\nD."}});
  EXPECT_EQ(r.text,
            "<|im_start|>user\nA?<|im_end|>\n"
            "<|im_start|>assistant\nB.<|im_end|>\n"
            "<|im_start|>user\nC?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nr2\n</think>\n\nD.<|im_end|>\n");
  EXPECT_EQ(from_message(r, 1), "B.");
  EXPECT_EQ(from_message(r, 3), "r2D.");  // the literal "\n</think>\n\n" between is the template's
}

TEST(ChatTemplate, Qwen3GenerationPrompt) {
  const RenderedChat r = render(kQwen3, {{"user", "Hi"}}, /*generation_prompt=*/true);
  EXPECT_EQ(r.text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  const RenderedChat n = render(kQwen3, {{"user", "Hi"}}, false);
  EXPECT_EQ(n.text, "<|im_start|>user\nHi<|im_end|>\n");
}

TEST(ChatTemplate, Qwen25DefaultSystemPrompt) {
  const RenderedChat r = render(kQwen25, {{"user", "Hi"}, {"assistant", "Yo"}});
  EXPECT_EQ(r.text,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo"
            "<|im_end|>\n");
  const RenderedChat s = render(kQwen25, {{"system", "S"}, {"user", "U"}}, true);
  EXPECT_EQ(s.text,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplate, WhitespaceControlTrimAndLstripBlocks) {
  // trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it;
  // `-` strips every whitespace on its side; output tags keep theirs.
  EXPECT_EQ(render("a\n  {% if true %}\nb\n  {% endif %}\nc", {}).text, "a\nb\nc");
  EXPECT_EQ(render("x  {%- if true -%}  \n y {{ 'z' }} \n{%- endif %}!", {}).text, "xy z!");
  EXPECT_EQ(render("{# a comment #}{{ 1 + 2 }}{{ 'a' ~ 3 }}{{ [1, 2]|length }}", {}).text, "3a32");
  EXPECT_EQ(render("{% for m in messages %}{{ loop.index0 }}{{ loop.index }}{% if loop.first %}F"
                   "{% elif loop.last %}L{% else %}M{% endif %}{% endfor %}",
                   {{"user", "a"}, {"assistant", "b"}, {"user", "c"}})
                .text,
            "01F12M23L");
  EXPECT_EQ(render("{{ '  ab  '.strip() }}|{{ 'xxaxx'.lstrip('x') }}|{{ 'abc'[::-1] }}|{{ 'a,b'"
                   ".split(',')[-1] }}|{{ none is none }}|{{ 'q' not in 'abc' }}",
                   {})
                .text,
            "ab|axx|cba|b|True|True");
  // Variables set in a loop body stay in it.
  EXPECT_EQ(render("{% set x = 'out' %}{% for m in messages %}{% set x = 'in' %}{{ x }}{% endfor "
                   "%}{{ x }}",
                   {{"user", "a"}})
                .text,
            "inout");
}

void expect_refused(const std::string& source, const std::string& names) {
  Result<ChatTemplate> t = ChatTemplate::parse(source);
  Status s = t ? t.value().render({{"user", "a"}}, false).status() : t.status();
  ASSERT_FALSE(s.is_ok()) << source;
  EXPECT_NE(s.message().find(names), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("chat template line"), std::string::npos) << s.message();
}

TEST(ChatTemplate, UnsupportedConstructsAreNamed) {
  expect_refused("{% macro f() %}x{% endmacro %}", "'{% macro'");
  expect_refused("{% generation %}x{% endgeneration %}", "'{% generation'");
  expect_refused("{{ messages | tojson }}", "'|tojson'");
  expect_refused("{{ 'a' if true else 'b' }}", "inline 'if'");
  expect_refused("{{ 'a'.upper() }}", "'.upper()'");
  expect_refused("{{ x is odd }}", "'is odd'");
  expect_refused("{% for a, b in messages %}{% endfor %}", "several variables");
  expect_refused("{% if true %}x", "'{% endif %}'");
  expect_refused("{{ raise_exception('no') }}", "calling a value");
  expect_refused("\n\n{{ messages + 'a' }}", "line 3");
}

}  // namespace
}  // namespace packmoe::tokenize
