// SentencePiece through libsentencepiece: a tiny BPE model trained here with the library's
// trainer on generated text, loaded through tokenize::load_tokenizer. Checks the ids the model
// defines by construction (unk 0, bos 1, eos 2, the user-defined symbol 3), a hand-checked
// encoding, agreement with the library's own processor, and decode(encode(x)) == x.
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <fstream>
#include <random>

#include "common/test_files.h"
#include "tokenize/tokenizer.h"

namespace packmoe {
namespace {

using Ids = std::vector<uint32_t>;

class SentencePieceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // One directory for the suite (make_test_dir names it by the test, and no test runs yet).
    const char* env = std::getenv("PACKMOE_TEST_TMP");
    dir_ = new std::filesystem::path(
        std::filesystem::path(env && *env ? env : std::filesystem::temp_directory_path().c_str()) /
        ("sentencepiece_" + std::to_string(::getpid())));
    std::filesystem::remove_all(*dir_);
    std::filesystem::create_directories(*dir_);
    // Words from a 12-letter alphabet, seeded: the same corpus every run.
    std::mt19937_64 rng(7);
    std::ofstream text(*dir_ / "corpus.txt");
    const char* words[] = {"hello", "world", "token", "piece", "model", "train", "data", "moe"};
    for (int line = 0; line < 2000; ++line) {
      for (int w = 0; w < 8; ++w) text << (w ? " " : "") << words[rng() % 8];
      text << "\n";
    }
    text.close();
    const std::string prefix = (*dir_ / "m").string();
    const auto s = sentencepiece::SentencePieceTrainer::Train(
        "--input=" + (*dir_ / "corpus.txt").string() + " --model_prefix=" + prefix +
        " --vocab_size=89 --model_type=bpe --character_coverage=1.0 --user_defined_symbols=<sep>"
        " --minloglevel=2");
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  static void TearDownTestSuite() {
    test::remove_test_dir(*dir_);
    delete dir_;
  }
  static std::string model() { return (*dir_ / "m.model").string(); }
  static std::filesystem::path* dir_;
};
std::filesystem::path* SentencePieceTest::dir_ = nullptr;

TEST_F(SentencePieceTest, IdsByConstructionAndAHandCheckedCase) {
  Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(model());
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  const tokenize::Tokenizer& tok = *t.value();
  EXPECT_STREQ(tok.kind(), "sentencepiece");
  EXPECT_EQ(tok.vocab_size(), 89u);
  EXPECT_EQ(tok.bos_id(), 1u);
  EXPECT_EQ(tok.eos_id(), 2u);
  EXPECT_EQ(tok.token_id("<sep>"), 3u);
  EXPECT_FALSE(tok.token_id("<not-a-piece>"));
  EXPECT_TRUE(tok.is_special(2));
  EXPECT_FALSE(tok.is_special(3));
  // 89 pieces is the most this corpus allows: every "▁word" of it is one piece. The
  // user-defined symbol is cut out whole; the words around it are "▁hello" and "▁world".
  Result<Ids> ids = tok.encode("hello<sep> world");
  ASSERT_TRUE(ids.is_ok());
  ASSERT_EQ(ids.value().size(), 3u) << ::testing::PrintToString(ids.value());
  EXPECT_EQ(ids.value()[0], tok.token_id("\xE2\x96\x81hello").value_or(999));
  EXPECT_EQ(ids.value()[1], 3u);
  EXPECT_EQ(ids.value()[2], tok.token_id("\xE2\x96\x81world").value_or(999));
  EXPECT_EQ(tok.decode(ids.value()), "hello<sep> world");
  EXPECT_EQ(tok.decode(Ids{1, ids.value()[0], 2}), "hello");  // control tokens decode to nothing
}

TEST_F(SentencePieceTest, MatchesTheLibraryAndRoundTrips) {
  Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(model());
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(model()).ok());
  std::mt19937_64 rng(test::recorded_random_seed());
  const std::string alphabet = "helowrdtknpicma  ";  // the corpus's characters
  for (int trial = 0; trial < 200; ++trial) {
    std::string s;
    const int n = 1 + static_cast<int>(rng() % 30);
    for (int k = 0; k < n; ++k) s += alphabet[rng() % alphabet.size()];
    // SentencePiece's normalizer folds runs of spaces and trims them: compare on such text.
    std::string folded;
    for (char c : s)
      if (!(c == ' ' && (folded.empty() || folded.back() == ' '))) folded += c;
    while (!folded.empty() && folded.back() == ' ') folded.pop_back();
    Result<Ids> ids = t.value()->encode(folded);
    ASSERT_TRUE(ids.is_ok());
    std::vector<int> expect;
    ASSERT_TRUE(sp.Encode(folded, &expect).ok());
    ASSERT_EQ(ids.value(), Ids(expect.begin(), expect.end())) << folded;
    ASSERT_EQ(t.value()->decode(ids.value()), folded) << folded;
  }
}

TEST_F(SentencePieceTest, ConfigBesideRenamesEosAndANonModelFileIsAnError) {
  const auto sub = *dir_ / "with_config";
  std::filesystem::create_directories(sub);
  std::filesystem::copy_file(model(), sub / "tokenizer.model",
                             std::filesystem::copy_options::overwrite_existing);
  std::ofstream(sub / "tokenizer_config.json") << R"({"eos_token": "<sep>", "chat_template": "t"})";
  Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(sub.string());
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  EXPECT_EQ(t.value()->eos_id(), 3u);
  EXPECT_EQ(t.value()->chat_template().value_or(""), "t");
  EXPECT_EQ(t.value()->files().size(), 2u);
  std::ofstream(*dir_ / "junk.model") << "not a model";
  Result<std::unique_ptr<tokenize::Tokenizer>> bad =
      tokenize::load_tokenizer((*dir_ / "junk.model").string());
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("not a SentencePiece model"), std::string::npos)
      << bad.status().message();
}

}  // namespace
}  // namespace packmoe
