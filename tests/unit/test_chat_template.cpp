// The chat template subset against renderings derived by hand from the real Qwen3 and Qwen2.5
// chat templates (their text below, as the models' tokenizer_config.json carry it): system and
// multi-turn conversations, reasoning split out of the content, the generation prompt, each
// byte's source, whitespace control, and every unsupported construct refused by name.
#include "tokenize/chat_template.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace packmoe::tokenize {
namespace {

// Qwen/Qwen3-8B tokenizer_config.json "chat_template".
const char* const kQwen3 = R"JINJA({%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %})JINJA";

// Qwen/Qwen2.5-7B-Instruct tokenizer_config.json "chat_template".
const char* const kQwen25 = R"JINJA({%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
)JINJA";

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
  EXPECT_EQ(render("{# a comment #}{{ 1 + 2 }}{{ 'a' ~ 3 }}{{ [1, 2]|length }}", {}).text,
            "3a32");
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
