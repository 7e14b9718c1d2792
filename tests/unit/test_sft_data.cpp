// SFT data against hand-derived token positions: the test tokenizer (tests/common/
// test_tokenizer_json.h: ids = byte values for text without merges, <|im_start|> 273,
// <|im_end|> 274, <|endoftext|> 272) renders conversations with a Qwen-style chat template and
// with the plain template; the loss flags sit on the assistant's content and its end-of-turn token
// only; the sampler packs conversations whole into rows, with their targets, document starts and
// padding; and bad JSONL lines are refused naming FILE:LINE.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/qwen_chat_templates.h"
#include "common/test_files.h"
#include "common/test_tokenizer_json.h"
#include "tokenize/tokenizer.h"
#include "train/batch_sampler.h"
#include "train/sft_data.h"

namespace packmoe::train {
namespace {

namespace fs = std::filesystem;

const char* const kTemplate =
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + "
    "'\\n' }}{%- endfor %}";

std::unique_ptr<tokenize::Tokenizer> tokenizer(const fs::path& dir, bool with_template,
                                               const char* chat_template = kTemplate) {
  std::ofstream(dir / "tokenizer.json") << test::test_tokenizer_json().dump();
  if (with_template)
    std::ofstream(dir / "tokenizer_config.json")
        << nlohmann::json{{"chat_template", chat_template}, {"eos_token", "<|im_end|>"}}.dump();
  Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(dir.string());
  EXPECT_TRUE(t) << t.status().message();
  return std::move(t.value());
}

std::vector<uint32_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::vector<uint32_t> cat(std::initializer_list<std::vector<uint32_t>> parts) {
  std::vector<uint32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// Indices whose flag is set.
std::vector<size_t> trained_at(const SftConversation& c) {
  std::vector<size_t> out;
  for (size_t i = 0; i < c.trained.size(); ++i)
    if (c.trained[i]) out.push_back(i);
  return out;
}

TEST(SftData, ChatTemplateMasksAllButTheAssistant) {
  const fs::path dir = test::make_test_dir("sft_");
  auto t = tokenizer(dir, true);
  Result<SftRenderer> r = SftRenderer::create(*t);
  ASSERT_TRUE(r) << r.status().message();
  Result<SftConversation> c = r.value().encode(
      {{"system", "xy"}, {"user", "ab"}, {"assistant", "cd"}, {"user", "ij"}, {"assistant", "k"}});
  ASSERT_TRUE(c) << c.status().message();
  // <|im_start|>system\nxy<|im_end|>\n<|im_start|>user\nab<|im_end|>\n
  // <|im_start|>assistant\ncd<|im_end|>\n<|im_start|>user\nij<|im_end|>\n
  // <|im_start|>assistant\nk<|im_end|>\n
  const std::vector<uint32_t> expected = cat({{273}, bytes("system\nxy"),    {274}, bytes("\n"),
                                              {273}, bytes("user\nab"),      {274}, bytes("\n"),
                                              {273}, bytes("assistant\ncd"), {274}, bytes("\n"),
                                              {273}, bytes("user\nij"),      {274}, bytes("\n"),
                                              {273}, bytes("assistant\nk"),  {274}, bytes("\n")});
  EXPECT_EQ(c.value().tokens, expected);
  // system turn 0-11, user turn 12-21, the first assistant turn: 22 <|im_start|>, 23-31
  // "assistant", 32 "\n", 33-34 "cd", 35 <|im_end|>; then 36 "\n", user 37-46, 47 <|im_start|>,
  // 48-56 "assistant", 57 "\n", 58 "k", 59 <|im_end|>, 60 "\n".
  EXPECT_EQ(trained_at(c.value()), (std::vector<size_t>{33, 34, 35, 58, 59}));
  test::remove_test_dir(dir);
}

TEST(SftData, Qwen3TemplateTrainsTheReasoningAndTheAnswer) {
  const fs::path dir = test::make_test_dir("sft_");
  auto t = tokenizer(dir, true, test::kQwen3);
  Result<SftRenderer> r = SftRenderer::create(*t);
  ASSERT_TRUE(r) << r.status().message();
  Result<SftConversation> c =
      r.value().encode({{"user", "ab"}, {"assistant", "<think>\nxy\n</think>\n\ncd"}});
  ASSERT_TRUE(c) << c.status().message();
  // <|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n<think>\n | xy\n</think>\n\ncd |
  // <|im_end|> | \n; "<think>" is the test tokenizer's added token 275, "</think>" plain bytes.
  const std::vector<uint32_t> expected = cat({{273},
                                              bytes("user\nab"),
                                              {274},
                                              bytes("\n"),
                                              {273},
                                              bytes("assistant\n"),
                                              {275},
                                              bytes("\nxy\n</think>\n\ncd"),
                                              {274},
                                              bytes("\n")});
  EXPECT_EQ(c.value().tokens, expected);
  // 0-21 the prompt and the header, 22 "\n" after <think>; the reasoning "xy" starts the span at
  // 23, the template's "\n</think>\n\n" inside it, "cd" ends it at 37; 38 <|im_end|>.
  std::vector<size_t> span;
  for (size_t i = 23; i <= 38; ++i) span.push_back(i);
  EXPECT_EQ(trained_at(c.value()), span);
  test::remove_test_dir(dir);
}

TEST(SftData, PlainTemplateEndsTheAnswerWithEos) {
  const fs::path dir = test::make_test_dir("sft_");
  auto t = tokenizer(dir, false);  // no template; eos <|endoftext|> 272
  Result<SftRenderer> r = SftRenderer::create(*t);
  ASSERT_TRUE(r) << r.status().message();
  EXPECT_FALSE(r.value().has_template());
  Result<SftConversation> c = r.value().encode({{"user", "ab"}, {"assistant", "cd"}});
  ASSERT_TRUE(c) << c.status().message();
  EXPECT_EQ(c.value().tokens, cat({bytes("User: ab\n\nAssistant: cd"), {272}}));
  EXPECT_EQ(trained_at(c.value()), (std::vector<size_t>{21, 22, 23}));
  test::remove_test_dir(dir);
}

TEST(SftData, JsonlLinesAndTheirErrors) {
  const fs::path dir = test::make_test_dir("sft_");
  auto t = tokenizer(dir, true);
  Result<SftRenderer> r = SftRenderer::create(*t);
  ASSERT_TRUE(r);
  const fs::path good = dir / "good.jsonl";
  std::ofstream(good) << R"({"prompt": "ab", "response": "cd", "id": 7})"
                      << "\n\n"
                      << R"({"messages": [{"role": "user", "content": "x"}, )"
                      << R"({"role": "assistant", "content": "y"}]})"
                      << "\n";
  Result<std::vector<SftConversation>> read = read_sft_file(good.string(), r.value());
  ASSERT_TRUE(read) << read.status().message();
  ASSERT_EQ(read.value().size(), 2u);
  EXPECT_EQ(read.value()[0].line, 1);
  EXPECT_EQ(read.value()[1].line, 3);  // the blank line is skipped, still counted
  const auto refused = [&](const std::string& line2, const std::string& needle) {
    const fs::path p = dir / "bad.jsonl";
    std::ofstream(p) << R"({"prompt": "a", "response": "b"})"
                     << "\n"
                     << line2 << "\n";
    Result<std::vector<SftConversation>> bad = read_sft_file(p.string(), r.value());
    ASSERT_FALSE(bad) << line2;
    EXPECT_EQ(bad.status().message().rfind(p.string() + ":2: ", 0), 0u) << bad.status().message();
    EXPECT_NE(bad.status().message().find(needle), std::string::npos) << bad.status().message();
  };
  refused(R"({"prompt": "a", "response": )", "not valid JSON");
  refused(R"({"messages": [{"role": "robot", "content": "a"}]})", "unknown role 'robot'");
  refused(
      R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]})",
      "an empty assistant message");
  refused(R"({"prompt": "a", "response": ""})", "an empty \"response\"");
  refused(R"({"messages": [{"role": "user", "content": "a"}]})", "without an assistant");
  refused(R"({"messages": [{"role": "user", "content": 3}]})", "not a string");
  refused(R"({"messages": [{"role": "user", "content": "a", "name": "x"}]})", "unknown key");
  refused(R"({"text": "a"})", "neither \"messages\"");
  refused(R"([1, 2])", "a JSON object");
  test::remove_test_dir(dir);
}

// A packed source of three documents of 5, 4 and 6 tokens (ids 10 + index), flags by hand.
DataSource packed_source() {
  DataSource s;
  s.name = "sft.jsonl";
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 15; ++i) tokens.push_back(10 + i);
  s.tokens = io::TokenArray::owned(tokens);
  s.documents = {{0, 5}, {5, 9}, {9, 15}};
  auto trained = std::make_shared<std::vector<uint8_t>>(15, 0);
  // 5 and 9 start documents: nothing predicts them (the previous document's last position is no
  // target).
  for (size_t i : {3, 4, 5, 8, 9, 10, 14}) (*trained)[i] = 1;
  s.packed = PackedDocuments{trained, {1, 2, 3}, "sft.jsonl", 0};
  return s;
}

TEST(SftData, PackingKeepsConversationsWholeWithTheirTargets) {
  DataSource s = packed_source();
  Result<std::vector<int64_t>> rows = rows_of_packed(s, 10);
  ASSERT_TRUE(rows);
  EXPECT_EQ(rows.value(), (std::vector<int64_t>{0, 2, 3}));  // 5 + 4 fit in 10; 6 starts a row
  DataBlend blend;
  blend.sources.push_back(std::move(s));
  StreamOptions o;
  o.document_mask = DocumentMask::kIndex;
  o.reset_positions = true;
  Result<BatchSampler> sampler = BatchSampler::create(blend, 64, 1, 10, o);
  ASSERT_TRUE(sampler) << sampler.status().message();
  Batch a = sampler.value().next(), b = sampler.value().next();
  const int32_t X = kIgnoredTarget;
  EXPECT_EQ(a.inputs, (std::vector<int32_t>{10, 11, 12, 13, 14, 15, 16, 17, 18, 0}));
  // Target t is token t + 1 of the same document when that token is trained.
  EXPECT_EQ(a.targets, (std::vector<int32_t>{X, X, 13, 14, X, X, X, 18, X, X}));
  EXPECT_EQ(a.doc_start, (std::vector<int32_t>{0, 0, 0, 0, 0, 5, 5, 5, 5, 9}));
  EXPECT_EQ(a.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 0}));
  EXPECT_EQ(b.inputs, (std::vector<int32_t>{19, 20, 21, 22, 23, 24, 0, 0, 0, 0}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{20, X, X, X, 24, X, X, X, X, X}));
  EXPECT_EQ(b.doc_start, (std::vector<int32_t>{0, 0, 0, 0, 0, 0, 6, 6, 6, 6}));
  EXPECT_EQ(sampler.value().shapes()[0], (SourceShape{15, 2, true}));  // 15 tokens, 2 rows
}

TEST(SftData, AConversationLongerThanARowIsAnError) {
  Result<std::vector<int64_t>> rows = rows_of_packed(packed_source(), 5);
  ASSERT_FALSE(rows);
  EXPECT_EQ(rows.status().message(),
            "sft.jsonl:3: the conversation has 6 tokens, more than seq_len = 5 (raise --seq-len or "
            "shorten it)");
}

}  // namespace
}  // namespace packmoe::train
