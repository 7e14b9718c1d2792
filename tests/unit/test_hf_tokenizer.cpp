// The byte-level BPE tokenizer.json implementation against ids derived by hand from the fixture
// in tests/common/test_tokenizer_json.h (merges by rank, bytes through the byte-level alphabet,
// the Qwen and GPT-2 regexes' Unicode classes, contractions, added / special tokens, NFC), the
// decode(encode(x)) == x round trip on random Unicode strings, and one error line per
// unsupported feature, naming the field.
#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "common/test_files.h"
#include "common/test_tokenizer_json.h"
#include "tokenize/tokenizer.h"

namespace packmoe {
namespace {

using nlohmann::json;
using Ids = std::vector<uint32_t>;

class HfTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::make_test_dir("hf_tokenizer_"); }
  void TearDown() override { test::remove_test_dir(dir_); }

  std::unique_ptr<tokenize::Tokenizer> load(const json& j, const std::string& config = "") {
    write(j.dump(), config);
    Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(dir_.string());
    EXPECT_TRUE(t.is_ok()) << t.status().message();
    return t ? std::move(t.value()) : nullptr;
  }
  std::string load_error(const json& j) {
    write(j.dump(), "");
    Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(dir_.string());
    EXPECT_FALSE(t.is_ok());
    return t ? "" : t.status().message();
  }
  void write(const std::string& tokenizer_json, const std::string& config) {
    std::ofstream(dir_ / "tokenizer.json") << tokenizer_json;
    std::filesystem::remove(dir_ / "tokenizer_config.json");
    if (!config.empty()) std::ofstream(dir_ / "tokenizer_config.json") << config;
  }
  static Ids encode(const tokenize::Tokenizer& t, const std::string& text) {
    Result<Ids> ids = t.encode(text);
    EXPECT_TRUE(ids.is_ok()) << ids.status().message();
    return ids ? ids.value() : Ids{};
  }

  std::filesystem::path dir_;
};

TEST_F(HfTokenizerTest, MergesApplyByRankNotPosition) {
  auto t = load(test::test_tokenizer_json());
  ASSERT_TRUE(t);
  EXPECT_EQ(t->vocab_size(), 276u);
  // h e (rank 0) -> he; l l (1) -> ll; he ll (2); hell o (3). " world": Ġ w (4), o r (5),
  // Ġw or (6), l d (7), Ġwor ld (8).
  EXPECT_EQ(encode(*t, "hello world"), (Ids{259, 264}));
  // "ell": e l is rank 13, l l rank 1, so l l merges first and e stays alone.
  EXPECT_EQ(encode(*t, "ell"), (Ids{'e', 257}));
  EXPECT_EQ(encode(*t, "el"), (Ids{269}));
  // "hello  world": \s+(?!\S) takes one space and leaves " world" whole.
  EXPECT_EQ(encode(*t, "hello  world"), (Ids{259, ' ', 264}));
}

TEST_F(HfTokenizerTest, BytesOutsideTheVocabularyGoThroughTheByteAlphabet) {
  auto t = load(test::test_tokenizer_json());
  ASSERT_TRUE(t);
  // 😀 = F0 9F 98 80: not a letter or digit, so " 😀!" is one piece of four byte symbols + "!".
  EXPECT_EQ(encode(*t, "hi \xF0\x9F\x98\x80!"), (Ids{'h', 'i', ' ', 0xF0, 0x9F, 0x98, 0x80, '!'}));
  // Control bytes and DEL map to U+0100.. symbols, still id = byte here.
  EXPECT_EQ(encode(*t, std::string("\x01\x7F", 2)), (Ids{1, 0x7F}));
  EXPECT_EQ(t->decode(Ids{0xF0, 0x9F, 0x98, 0x80}), "\xF0\x9F\x98\x80");
}

TEST_F(HfTokenizerTest, RegexUnicodeClassesLettersDigitsCjkContractions) {
  auto qwen = load(test::test_tokenizer_json(test::PreTokenizer::kQwen));
  ASSERT_TRUE(qwen);
  // 日 (E6 97 A5) is \p{L}: "日x" is one piece, so the merge ¥ x (A5 78) applies across it.
  EXPECT_EQ(encode(*qwen, "\xE6\x97\xA5x"), (Ids{0xE6, 0x97, 270}));
  // Qwen splits digits one by one: the merge 1 2 never applies.
  EXPECT_EQ(encode(*qwen, "123"), (Ids{'1', '2', '3'}));
  // ٣ (U+0663, D9 A3) is \p{N}: a piece of its own between letters.
  EXPECT_EQ(encode(*qwen, "a\xD9\xA3" "b"), (Ids{'a', 0xD9, 0xA3, 'b'}));
  // 's is a contraction piece, so "'sa" does not become ' + sa (s a has the lower rank).
  EXPECT_EQ(encode(*qwen, "it'sa"), (Ids{'i', 't', 266, 'a'}));
  EXPECT_EQ(encode(*qwen, "don't"), (Ids{'d', 'o', 'n', 267}));
  // U+3000 (E3 80 80) is \s in Unicode: "!" and it are separate pieces, so ! ã never merges.
  EXPECT_EQ(encode(*qwen, "!\xE3\x80\x80"), (Ids{'!', 0xE3, 0x80, 0x80}));
  // Case-insensitive contractions in Qwen's pattern: "'S" is one piece, "a" another.
  EXPECT_EQ(encode(*qwen, "'Sa"), (Ids{'\'', 'S', 'a'}));
  // Without a space in front, '_' (not \p{L}) joins the letters after it.
  EXPECT_EQ(encode(*qwen, "<|im_end"), (Ids{'<', '|', 'i', 'm', '_', 'e', 'n', 'd'}));

  auto gpt2 = load(test::test_tokenizer_json(test::PreTokenizer::kGpt2));
  ASSERT_TRUE(gpt2);
  // GPT-2's pattern keeps digit runs together: 1 2 merges.
  EXPECT_EQ(encode(*gpt2, "123"), (Ids{268, '3'}));
  EXPECT_EQ(encode(*gpt2, "\xE6\x97\xA5x"), (Ids{0xE6, 0x97, 270}));
  EXPECT_EQ(encode(*gpt2, "it'sa"), (Ids{'i', 't', 266, 'a'}));
  // Case-sensitive in GPT-2: "'S" is no contraction; "'" is punctuation, "Sa" letters.
  EXPECT_EQ(encode(*gpt2, "'Sa"), (Ids{'\'', 'S', 'a'}));
  EXPECT_EQ(encode(*gpt2, "hello world"), (Ids{259, 264}));
}

TEST_F(HfTokenizerTest, SpecialTokensInsideText) {
  auto t = load(test::test_tokenizer_json());
  ASSERT_TRUE(t);
  EXPECT_EQ(encode(*t, "<|im_start|>user\nhello<|im_end|>"),
            (Ids{273, 'u', 's', 'e', 'r', '\n', 259, 274}));
  EXPECT_EQ(encode(*t, "hello<|endoftext|><think>"), (Ids{259, 272, 275}));
  EXPECT_EQ(t->token_id("<|im_end|>"), 274u);
  EXPECT_EQ(t->token_id("hello"), 259u);
  EXPECT_FALSE(t->token_id("<|nope|>"));
  EXPECT_TRUE(t->is_special(274));
  EXPECT_FALSE(t->is_special(275));
  EXPECT_EQ(t->decode(Ids{273, 259, 275, 274}), "<|im_start|>hello<think><|im_end|>");
  EXPECT_EQ(t->decode(Ids{273, 259, 275, 274}, /*skip_special=*/true), "hello<think>");
  EXPECT_EQ(t->decode(Ids{259, 100000}), "hello");  // no token: nothing
  // No tokenizer_config.json: eos is the <|endoftext|> the vocabulary has.
  EXPECT_EQ(t->eos_id(), 272u);
  EXPECT_FALSE(t->chat_template());
}

TEST_F(HfTokenizerTest, LstripRstripTakeTheSpacesAround) {
  json j = test::test_tokenizer_json();
  EXPECT_EQ(encode(*load(j), "a <think> b"), (Ids{'a', ' ', 275, ' ', 'b'}));
  j["added_tokens"][3]["lstrip"] = true;
  j["added_tokens"][3]["rstrip"] = true;
  EXPECT_EQ(encode(*load(j), "a <think> b"), (Ids{'a', 275, 'b'}));
  j["added_tokens"][3]["single_word"] = true;
  EXPECT_EQ(encode(*load(j), "a<think>"), (Ids{'a', '<', 't', 'h', 'i', 'n', 'k', '>'}));
}

TEST_F(HfTokenizerTest, NfcNormalizerComposes) {
  json j = test::test_tokenizer_json();
  // e + U+0301 (combining acute, CC 81): a mark is not \p{L}, so it is a piece of its own.
  EXPECT_EQ(encode(*load(j), "e\xCC\x81"), (Ids{'e', 0xCC, 0x81}));
  j["normalizer"] = {{"type", "NFC"}};
  // NFC makes it é (C3 A9).
  EXPECT_EQ(encode(*load(j), "e\xCC\x81"), (Ids{0xC3, 0xA9}));
  EXPECT_EQ(encode(*load(j), "e\xCC\x81<|im_end|>"), (Ids{0xC3, 0xA9, 274}));
}

TEST_F(HfTokenizerTest, ConfigGivesEosBosAndChatTemplate) {
  auto t = load(test::test_tokenizer_json(),
                R"({"eos_token": "<|im_end|>", "bos_token": null,
                    "pad_token": {"content": "<|endoftext|>"}, "chat_template": "{{ m }}"})");
  ASSERT_TRUE(t);
  EXPECT_EQ(t->eos_id(), 274u);
  EXPECT_EQ(t->pad_id(), 272u);
  EXPECT_FALSE(t->bos_id());
  EXPECT_EQ(t->chat_template().value_or(""), "{{ m }}");
  EXPECT_EQ(t->files().size(), 2u);
  write(test::test_tokenizer_json().dump(), R"({"eos_token": "<|nope|>"})");
  Result<std::unique_ptr<tokenize::Tokenizer>> bad = tokenize::load_tokenizer(dir_.string());
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("eos_token"), std::string::npos) << bad.status().message();
}

// Random strings over ASCII, Latin-1, combining marks, CJK, emoji, whitespace and the added
// tokens; the tokenizer has no normalizer, so decode must give back every byte.
TEST_F(HfTokenizerTest, DecodeEncodeRoundTripsRandomUnicode) {
  for (auto pre : {test::PreTokenizer::kQwen, test::PreTokenizer::kGpt2}) {
    auto t = load(test::test_tokenizer_json(pre));
    ASSERT_TRUE(t);
    std::mt19937_64 rng(test::recorded_random_seed());
    const std::pair<uint32_t, uint32_t> ranges[] = {{0x20, 0x7E},       {0x09, 0x0D},
                                                    {0xA0, 0xFF},       {0x300, 0x36F},
                                                    {0x4E00, 0x9FFF},   {0x1F600, 0x1F64F},
                                                    {0x660, 0x669},     {0x3000, 0x3000}};
    const char* added[] = {"<|im_start|>", "<|im_end|>", "<think>", "<|endoftext|>", "'s", "'T"};
    for (int trial = 0; trial < 300; ++trial) {
      std::string s;
      const int n = static_cast<int>(rng() % 40);
      for (int k = 0; k < n; ++k) {
        if (rng() % 10 == 0) {
          s += added[rng() % 6];
          continue;
        }
        const auto& [lo, hi] = ranges[rng() % 8];
        const uint32_t cp = lo + static_cast<uint32_t>(rng() % (hi - lo + 1));
        if (cp < 0x80) {
          s += static_cast<char>(cp);
        } else if (cp < 0x800) {
          s += static_cast<char>(0xC0 | (cp >> 6));
          s += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
          s += static_cast<char>(0xE0 | (cp >> 12));
          s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          s += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
          s += static_cast<char>(0xF0 | (cp >> 18));
          s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
          s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          s += static_cast<char>(0x80 | (cp & 0x3F));
        }
      }
      const Ids ids = encode(*t, s);
      for (uint32_t id : ids) ASSERT_LT(id, t->vocab_size());
      ASSERT_EQ(t->decode(ids), s) << "trial " << trial;
    }
  }
}

TEST_F(HfTokenizerTest, InvalidUtf8IsAnError) {
  auto t = load(test::test_tokenizer_json());
  ASSERT_TRUE(t);
  for (const std::string& bad : {std::string("a\xFF"), std::string("a\xC0\x80"),
                                std::string("a\xED\xA0\x80"), std::string("a\xE6\x97")}) {
    Result<Ids> r = t->encode(bad);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().message(), "invalid UTF-8 at byte 1");
  }
}

TEST_F(HfTokenizerTest, UnsupportedFeaturesNameTheField) {
  const auto with = [](const char* key, json v) {
    json j = test::test_tokenizer_json();
    j[key] = std::move(v);
    return j;
  };
  const std::pair<json, const char*> cases[] = {
      {with("normalizer", {{"type", "NFKC"}}), "normalizer.type"},
      {with("pre_tokenizer", {{"type", "Metaspace"}}), "pre_tokenizer.type"},
      {with("decoder", {{"type", "WordPiece"}}), "decoder.type"},
      {with("truncation", {{"max_length", 8}}), "truncation"},
      {with("post_processor", {{"type", "BertProcessing"}}), "post_processor.type"},
  };
  for (const auto& [j, field] : cases) {
    const std::string e = load_error(j);
    EXPECT_NE(e.find(std::string("tokenizer.json: ") + field), std::string::npos) << e;
  }
  json m = test::test_tokenizer_json();
  m["model"]["type"] = "WordPiece";
  EXPECT_NE(load_error(m).find("model.type"), std::string::npos);
  m = test::test_tokenizer_json();
  m["model"]["byte_fallback"] = true;
  EXPECT_NE(load_error(m).find("model.byte_fallback"), std::string::npos);
  m = test::test_tokenizer_json();
  m["model"]["merges"].push_back("x z");  // "xz" is not in the vocabulary
  EXPECT_NE(load_error(m).find("model.merges[16]"), std::string::npos) << load_error(m);
  m = test::test_tokenizer_json();
  m["added_tokens"][0]["id"] = 2000000000;  // sparse ids: refused before the id table is made
  EXPECT_NE(load_error(m).find("ids must be dense"), std::string::npos) << load_error(m);
  m = test::test_tokenizer_json();
  m["model"]["vocab"].erase(test::gpt2_byte_symbol(0));
  EXPECT_NE(load_error(m).find("byte 0"), std::string::npos) << load_error(m);
}

TEST_F(HfTokenizerTest, PathsAndFiles) {
  write(test::test_tokenizer_json().dump(), "{}");
  Result<std::vector<std::string>> files = tokenize::tokenizer_files(dir_.string());
  ASSERT_TRUE(files.is_ok()) << files.status().message();
  ASSERT_EQ(files.value().size(), 2u);
  EXPECT_EQ(std::filesystem::path(files.value()[0]).filename(), "tokenizer.json");
  EXPECT_EQ(std::filesystem::path(files.value()[1]).filename(), "tokenizer_config.json");
  EXPECT_TRUE(tokenize::load_tokenizer((dir_ / "tokenizer.json").string()).is_ok());
  EXPECT_FALSE(tokenize::load_tokenizer((dir_ / "missing").string()).is_ok());
  std::filesystem::create_directories(dir_ / "empty");
  EXPECT_FALSE(tokenize::load_tokenizer((dir_ / "empty").string()).is_ok());
}

}  // namespace
}  // namespace packmoe
