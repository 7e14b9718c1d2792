// `packmoe train --dry-run RANKS` (tools/train_command.cpp, train/memory_plan.h): the whole
// Qwen3-30B-A3B planned for 8 ranks on this machine without a corpus, an output directory or the
// memory to train it (the line format, the total as the sum of its parts, nothing written), and
// each bad value as one `packmoe: error:` line, the same one a real run gives. The figures
// themselves are checked against the real optimizers in tests/dist/test_memory_plan.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "common/run_cli.h"
#include "common/test_files.h"

namespace packmoe::test {
namespace {

TEST(DryRunCli, PlansTheWholeQwen3_30bA3bWithoutDataOrOutputs) {
  const std::filesystem::path dir = make_test_dir("dry_run_cli_");
  const std::string missing = (dir / "missing").string();
  const RunResult r = run_cli(
      "train --preset qwen3_30b_a3b --dry-run 8 --expert-parallel 8 "
      "--recipe mxfp8 --data text:" +
      missing + "/corpus.txt --out " + missing + "/out --save-dir " + missing + "/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(std::filesystem::exists(missing)) << "the dry run wrote " << missing;
  remove_test_dir(dir);
  EXPECT_EQ(r.output.rfind("packmoe train --dry-run: 8 ranks, expert parallel 8 (16 of 128 "
                           "experts per rank); experts: recipe mxfp8, primary low; gather mode "
                           "bf16\n",
                           0),
            0u)
      << r.output;
  EXPECT_NE(r.output.find("  model: 30532122624 parameters ("), std::string::npos) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("\n  largest rank: \\d+ of 8 \\(smallest: "
                                                     "rank \\d+, \\d+\\.\\d\\d GB\\)\n")))
      << r.output;
  // Every figure as "    NAME  X.XX GB  (N bytes)"; the total is the sum of the others.
  const std::regex figure("^    ([A-Za-z0-9 ]+?) +(\\d+\\.\\d\\d) GB  \\((\\d+) bytes\\)$");
  std::istringstream lines(r.output);
  std::vector<std::string> names;
  long long sum = 0, total = -1;
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (!std::regex_match(line, m, figure)) continue;
    names.push_back(m[1]);
    const long long bytes = std::stoll(m[3]);
    EXPECT_NEAR(std::stod(m[2]), static_cast<double>(bytes) / 1e9, 0.006) << line;
    if (m[1] == "total")
      total = bytes;
    else
      sum += bytes;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"primary weights", "FP32 replicas", "FP32 gradients",
                                      "FP32 masters", "AdamW moments", "gather buffers", "total"}))
      << r.output;
  EXPECT_EQ(total, sum) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output,
      std::regex("\n  per step: all-gather \\d+\\.\\d\\d GB, reduce-scatter \\d+\\.\\d\\d "
                 "GB over 8 ranks \\(dense\\); all-gather \\d+\\.\\d\\d GB, "
                 "reduce-scatter \\d+\\.\\d\\d GB over 1 rank \\(experts\\)\n")))
      << r.output;
  // Even routing: 48 layers x 4 passes x 512 tokens x top-8 rows x 4096 B, 7/8 of them to peers.
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("\n  expert all-to-all per step and rank \\(48 MoE layers, dispatch "
                           "bf16: 4096 B per row\\): 2\\.82 GB to peers with even routing, at "
                           "most \\d+\\.\\d\\d GB sent; receive buffers up to \\d+\\.\\d\\d GB "
                           "per dispatch\n")))
      << r.output;
  EXPECT_NE(r.output.find("\n  not counted: activations"), std::string::npos) << r.output;
}

// --dispatch-dtype recipe: the forward's rows as MXFP8 codes and scales, 2048 + 64 B each; even
// routing 48 layers x 512 tokens x top-8 x (2112 + 3 x 4096 B), 7/8 of them to peers: 2.48 GB.
TEST(DryRunCli, CountsTheDispatchDtype) {
  const RunResult r = run_cli(
      "train --preset qwen3_30b_a3b --dry-run 8 --expert-parallel 8 --recipe mxfp8 "
      "--dispatch-dtype recipe");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("\n  expert all-to-all per step and rank \\(48 MoE layers, dispatch "
                           "recipe: 2112 B per row\\): 2\\.48 GB to peers with even routing")))
      << r.output;
}

TEST(DryRunCli, BadValuesAreOneErrorLine) {
  const std::filesystem::path dir = make_test_dir("dry_run_cli_bad_");
  const std::string dense_config = (dir / "dense.json").string();
  {
    std::ofstream out(dense_config);
    out << R"({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "num_experts": 0})";
  }
  const std::pair<std::string, std::string> cases[] = {
      {"--preset tiny --dry-run 0",
       "packmoe: error: --dry-run 0: the job's ranks must be in [1, 1024]\n"},
      {"--preset tiny --dry-run 6 --expert-parallel 4",
       "packmoe: error: --expert-parallel 4 does not divide the 6 ranks: EP ranks form each "
       "expert-parallel group\n"},
      {"--preset tiny --dry-run 4 --expert-parallel 3",
       "packmoe: error: --expert-parallel 3 does not divide the 4 ranks: EP ranks form each "
       "expert-parallel group\n"},
      {"--config " + dense_config + " --dry-run 2 --expert-parallel 2",
       "packmoe: error: --expert-parallel 2 on a model without MoE layers: there are no experts "
       "to shard\n"},
      {"--preset tiny --dry-run 2 --expert-parallel 2 --dispatch-dtype recipe",
       "packmoe: error: dispatch_dtype = recipe needs the mxfp8 or nvfp4 recipe (bf16 rows "
       "already travel as the FC1 GEMM reads them)\n"},
      {"--preset tiny --dry-run 2 --recipe nvfp4 --dispatch-dtype recipe",
       "packmoe: error: dispatch_dtype = recipe needs expert parallelism (expert_parallel > 1): "
       "with every expert on its rank no row is dispatched\n"},
      {"--preset tiny --dry-run 2 --expert-parallel 2 --dispatch-dtype fp8",
       "packmoe: error: --dispatch-dtype: dispatch_dtype must be bf16 or recipe (got 'fp8')\n"},
      {"--preset tiny --dry-run 2 --resume auto",
       "packmoe: error: --dry-run plans a model from --preset or --config: give the config.json "
       "of the --resume checkpoint or the --init-from-hf directory as --config\n"},
  };
  for (const auto& [flags, want] : cases) {
    const RunResult r = run_cli("train " + flags);
    EXPECT_EQ(r.exit_code, 1) << flags << ": " << r.output;
    EXPECT_EQ(count_of(r.output, "\n"), 1u) << flags << ": " << r.output;
    EXPECT_EQ(r.output, want) << flags;
  }
  // The preset's 4 experts: EP 8 divides 8 ranks but not them.
  const RunResult r = run_cli("train --preset tiny --dry-run 8 --expert-parallel 8");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output,
            "packmoe: error: --expert-parallel 8 does not divide the 4 experts per layer: each "
            "rank holds E / EP of them\n");
  remove_test_dir(dir);
}

}  // namespace
}  // namespace packmoe::test
