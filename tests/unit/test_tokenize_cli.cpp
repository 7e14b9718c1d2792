// `packmoe tokenize` end to end as a user runs it: text files, a folder and a JSONL into a
// Megatron .bin/.idx read back by io::read_megatron, with ids derived by hand from the test
// tokenizer (tests/common/test_tokenizer_json.h) and, on a random corpus, equal to the library's
// encode document by document; the output bytes the same for 1 and 4 threads; each bad input one
// `packmoe: error:` line with nothing left in the output folder.
#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "common/run_cli.h"
#include "common/test_files.h"
#include "common/test_tokenizer_json.h"
#include "io/token_data.h"
#include "tokenize/tokenizer.h"

namespace packmoe {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<uint32_t>;

class TokenizeCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_test_dir("tokenize_cli_");
    fs::create_directories(dir_ / "tok");
    std::ofstream(dir_ / "tok" / "tokenizer.json") << test::test_tokenizer_json().dump();
    fs::create_directories(dir_ / "out");
  }
  void TearDown() override { test::remove_test_dir(dir_); }

  test::RunResult tokenize(const std::string& inputs, const std::string& extra = "") {
    return test::run_cli("tokenize --quiet --tokenizer " + (dir_ / "tok").string() + " --input " +
                         inputs + " --output " + (dir_ / "out" / "corpus").string() + " " + extra);
  }
  std::vector<Ids> documents() {
    Result<io::TokenDataset> d = io::read_megatron((dir_ / "out" / "corpus").string());
    EXPECT_TRUE(d.is_ok()) << d.status().message();
    std::vector<Ids> docs;
    if (!d) return docs;
    for (size_t i = 0; i < d.value().num_documents(); ++i) {
      const auto doc = d.value().document(i);
      docs.emplace_back(doc.begin(), doc.end());
    }
    return docs;
  }
  void expect_one_error_and_no_output(const test::RunResult& r, const std::string& needle) {
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_EQ(r.output.rfind("packmoe: error: ", 0), 0u) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
    EXPECT_TRUE(fs::is_empty(dir_ / "out")) << "a failed run left files behind";
  }

  fs::path dir_;
};

TEST_F(TokenizeCliTest, FilesFolderAndJsonlIntoMegatronWithEod) {
  fs::create_directories(dir_ / "texts" / "sub");
  std::ofstream(dir_ / "texts" / "a.txt") << "hello world";
  std::ofstream(dir_ / "texts" / "sub" / "b.txt") << "ell";
  std::ofstream(dir_ / "texts" / ".hidden") << "skipped";
  std::ofstream(dir_ / "c.jsonl") << R"({"text": "123"})" "\n\n"
                                  << R"({"text": "<|im_start|>hi", "id": 7})" "\n"
                                  << R"({"text": ""})" "\n";
  const test::RunResult r =
      tokenize((dir_ / "texts").string() + " " + (dir_ / "c.jsonl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // eos: <|endoftext|> (272) after each document; the empty JSONL document is dropped.
  EXPECT_EQ(documents(), (std::vector<Ids>{{259, 264, 272},
                                           {'e', 257, 272},
                                           {'1', '2', '3', 272},
                                           {273, 'h', 'i', 272}}));
  ASSERT_EQ(tokenize((dir_ / "c.jsonl").string(), "--eod-token none").exit_code, 0);
  EXPECT_EQ(documents(), (std::vector<Ids>{{'1', '2', '3'}, {273, 'h', 'i'}}));
  ASSERT_EQ(tokenize((dir_ / "c.jsonl").string(), "--eod-token '<|im_end|>'").exit_code, 0);
  EXPECT_EQ(documents(), (std::vector<Ids>{{'1', '2', '3', 274}, {273, 'h', 'i', 274}}));
  std::ofstream(dir_ / "f.txt") << "hello\n%\nell\n%\n";
  ASSERT_EQ(tokenize((dir_ / "f.txt").string(), "--separator-line % --eod-token 0").exit_code, 0);
  EXPECT_EQ(documents(), (std::vector<Ids>{{259, '\n', 0}, {'e', 257, '\n', 0}}));
}

// A random corpus: the CLI's ids equal the library's encode of each document, and the output
// bytes are the same for 1 and 4 threads.
TEST_F(TokenizeCliTest, ThreadCountDoesNotChangeTheBytes) {
  std::mt19937_64 rng(test::recorded_random_seed());
  const char* words[] = {"hello", " world", "ell", "123", " 日本x", "it's", "\n", "  ", "😀",
                         "<|im_end|>", "e\u0301", "'T"};
  std::vector<std::string> texts;
  {
    std::ofstream f(dir_ / "corpus.jsonl");
    for (int d = 0; d < 300; ++d) {
      std::string text;
      const int n = 1 + static_cast<int>(rng() % 60);
      for (int k = 0; k < n; ++k) text += words[rng() % 12];
      texts.push_back(text);
      f << nlohmann::json{{"text", text}}.dump() << "\n";
    }
  }
  const std::string in = (dir_ / "corpus.jsonl").string();
  ASSERT_EQ(tokenize(in, "--threads 1").exit_code, 0);
  const auto bin1 = test::read_raw(dir_ / "out" / "corpus.bin");
  const auto idx1 = test::read_raw(dir_ / "out" / "corpus.idx");
  ASSERT_EQ(tokenize(in, "--threads 4").exit_code, 0);
  EXPECT_EQ(test::read_raw(dir_ / "out" / "corpus.bin"), bin1);
  EXPECT_EQ(test::read_raw(dir_ / "out" / "corpus.idx"), idx1);
  Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer((dir_ / "tok").string());
  ASSERT_TRUE(t.is_ok());
  const std::vector<Ids> docs = documents();
  ASSERT_EQ(docs.size(), texts.size());
  for (size_t d = 0; d < texts.size(); ++d) {
    Ids expect = t.value()->encode(texts[d]).value();
    expect.push_back(272);
    ASSERT_EQ(docs[d], expect) << "document " << d;
  }
}

TEST_F(TokenizeCliTest, BadInputIsOneLineAndWritesNothing) {
  std::ofstream(dir_ / "nokey.jsonl") << R"({"text": "ok"})" "\n" R"({"body": "x"})" "\n";
  expect_one_error_and_no_output(tokenize((dir_ / "nokey.jsonl").string()),
                                 "nokey.jsonl:2: no \"text\" field");
  std::ofstream(dir_ / "bad.jsonl") << "{\"text\": \"ok\"}\nnot json\n";
  expect_one_error_and_no_output(tokenize((dir_ / "bad.jsonl").string()), "bad.jsonl:2");
  std::ofstream(dir_ / "latin1.txt") << "caf\xE9";
  expect_one_error_and_no_output(tokenize((dir_ / "latin1.txt").string()),
                                 "latin1.txt: invalid UTF-8 at byte 3");
  expect_one_error_and_no_output(tokenize((dir_ / "missing.txt").string()), "not found");
  std::ofstream(dir_ / "ok.txt") << "hello";
  expect_one_error_and_no_output(tokenize((dir_ / "ok.txt").string(), "--eod-token 999"),
                                 "--eod-token 999");
  expect_one_error_and_no_output(tokenize((dir_ / "ok.txt").string(), "--threads -1"), "--threads");
  expect_one_error_and_no_output(tokenize("/dev/null"), "not a regular file");
  nlohmann::json unigram = test::test_tokenizer_json();
  unigram["model"]["type"] = "Unigram";
  std::ofstream(dir_ / "tok" / "tokenizer.json") << unigram.dump();
  expect_one_error_and_no_output(tokenize((dir_ / "ok.txt").string()), "model.type");
}

}  // namespace
}  // namespace packmoe
