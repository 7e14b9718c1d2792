// `packmoe generate` as a user runs it on the CPU: train the tiny preset (byte tokens) for a few
// steps with checkpoints, export-hf, then generate from the checkpoint, from its save root and
// from the Hugging Face directory: the same tokens (an F32 export holds the masters exactly); the
// streamed text is the prompt and the decoded ids; seeded sampling replays; bad input (a missing
// model, a prompt past max_position_embeddings, top-p outside (0, 1], a negative temperature) is
// one `packmoe: error:` line.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "common/run_cli.h"
#include "common/test_files.h"

namespace fs = std::filesystem;
using namespace packmoe;
using packmoe::test::RunResult;
using packmoe::test::run_cli;

namespace {

class GenerateE2e : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // One directory for the suite (make_test_dir names it by the test, which is none yet here).
    const char* tmp = std::getenv("PACKMOE_TEST_TMP");
    dir_ = new fs::path((tmp && *tmp ? fs::path(tmp) : fs::temp_directory_path()) /
                        ("generate_e2e_" + std::to_string(::getpid())));
    fs::remove_all(*dir_);
    fs::create_directories(*dir_);
    std::ofstream f(*dir_ / "corpus.txt");  // fortune-format documents
    const char* lines[] = {"the cat sat on the mat", "a dog ran in the park", "birds sing at dawn"};
    for (int d = 0; d < 200; ++d) f << lines[d % 3] << " " << d << "\n%\n";
    f.close();
    const RunResult r = run_cli(
        "train --device cpu --steps 12 --warmup 2 --micro-batch 4 --seq-len 32 --log-interval 6 "
        "--eval-interval 0 --data text:" + (*dir_ / "corpus.txt").string() + " --out " +
        (*dir_ / "run").string() + " --save-dir " + (*dir_ / "ckpt").string());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const RunResult e = run_cli("export-hf " + (*dir_ / "ckpt").string() + " " +
                                (*dir_ / "hf").string() + " --dtype f32");
    ASSERT_EQ(e.exit_code, 0) << e.output;
  }
  static void TearDownTestSuite() {
    test::remove_test_dir(*dir_);
    delete dir_;
  }
  static fs::path* dir_;
};
fs::path* GenerateE2e::dir_ = nullptr;

nlohmann::json generate_json(const std::string& model, const std::string& flags) {
  const RunResult r = run_cli("generate " + model + " --device cpu --json " + flags);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return {};
  return nlohmann::json::parse(r.output);
}

TEST_F(GenerateE2e, CheckpointSaveRootAndHfDirectoryGiveTheSameTokens) {
  const std::string flags = "--prompt 'the cat' --max-new-tokens 24";
  const nlohmann::json root = generate_json((*dir_ / "ckpt").string(), flags);
  const nlohmann::json ckpt = generate_json((*dir_ / "ckpt" / "step-00000012").string(), flags);
  const nlohmann::json hf = generate_json((*dir_ / "hf").string(), flags);
  ASSERT_TRUE(root.contains("ids")) << root.dump();
  EXPECT_EQ(root["prompt_ids"], nlohmann::json::parse("[116,104,101,32,99,97,116]"));
  EXPECT_EQ(root["ids"].size(), 24u);
  EXPECT_EQ(root["stop"], "max_new_tokens");
  EXPECT_EQ(root["tokenizer"], "byte tokens");
  EXPECT_EQ(root["ids"], ckpt["ids"]);
  EXPECT_EQ(root["ids"], hf["ids"]);

  // The streamed text: the prompt, then the decoded tokens, then a newline.
  const RunResult text = run_cli("generate " + (*dir_ / "hf").string() + " --device cpu " + flags);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  std::string want = "the cat";
  for (const auto& id : root["ids"]) want.push_back(static_cast<char>(id.get<int>()));
  EXPECT_EQ(text.output.rfind(want + "\n", 0), 0u) << text.output;
  EXPECT_NE(text.output.find("24 new tokens"), std::string::npos) << text.output;
}

TEST_F(GenerateE2e, SeededSamplingReplays) {
  // A --max-new-tokens far past the positions allocates only the positions there are.
  const nlohmann::json far = generate_json((*dir_ / "ckpt").string(),
                                           "--prompt " + std::string(500, 'a') +
                                               " --max-new-tokens 9223372036854775807");
  ASSERT_TRUE(far.contains("ids"));
  EXPECT_EQ(far["ids"].size(), 13u);  // positions 500..511 run, the 13th new token ends it
  EXPECT_EQ(far["stop"], "max_positions");

  const std::string model = (*dir_ / "ckpt").string();
  const std::string flags = "--prompt 'a dog' --max-new-tokens 16 --temperature 1.5 --top-k 20";
  const nlohmann::json a = generate_json(model, flags + " --seed 5");
  const nlohmann::json b = generate_json(model, flags + " --seed 5");
  const nlohmann::json c = generate_json(model, flags + " --seed 6");
  ASSERT_TRUE(a.contains("ids"));
  EXPECT_EQ(a["ids"], b["ids"]);
  EXPECT_NE(a["ids"], c["ids"]);
}

TEST_F(GenerateE2e, BadInputIsOneErrorLine) {
  const std::string model = (*dir_ / "ckpt").string();
  const std::string long_prompt(513, 'a');  // the tiny preset has 512 positions
  for (const std::string& args :
       {"generate " + (*dir_ / "missing").string() + " --prompt hi",
        "generate " + (*dir_ / "run").string() + " --prompt hi",
        "generate " + model + " --prompt " + long_prompt,
        "generate " + model + " --prompt hi --top-p 0",
        "generate " + model + " --prompt hi --top-p 1.5",
        "generate " + model + " --prompt hi --temperature -1",
        "generate " + model + " --prompt hi --max-new-tokens 0",
        "generate " + model + " --prompt ''",
        "generate " + model + " --prompt hi --recipe fp4",
        "generate " + model + " --prompt hi --seed -1",
        "generate " + model + " --prompt hi --top-p nan"}) {
    const RunResult r = run_cli(args + " --device cpu");
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
    EXPECT_EQ(r.output.rfind("packmoe: error: ", 0), 0u) << args << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << args << "\n" << r.output;
  }
}

}  // namespace
