// Hostile input through the real binary (issue 27's reproducers): deeply nested JSON in every file
// the program reads, sizes beyond the machine or int64, out-of-range integer flags, FIFOs and
// devices as inputs, unwritable outputs, a save root of another run, names with control bytes,
// safetensors headers the reference reader rejects, a quantized file quantized again, non-finite
// checkpoint values. Each is ONE "packmoe: error:" line, exit 1, within seconds, nothing written.
// Also: --resume auto passes over a checkpoint whose complete.json is hostile to an older one.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "common/run_cli.h"
#include "io/checkpoint_dir.h"
#include "io/safetensors.h"
#include "io/text_corpus.h"

namespace fs = std::filesystem;
using namespace packmoe;
using packmoe::test::RunResult;
using packmoe::test::run_cli;

namespace {

fs::path temp_dir() {
  const char* env = std::getenv("PACKMOE_TEST_TMP");
  const fs::path base = env ? fs::path(env) : fs::temp_directory_path();
  const fs::path dir = base / ("cli_limits_" + std::to_string(::getpid()) + "_" +
                               ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// A safetensors file: the 8-byte length, `header` as given, then `data`.
std::string safetensors_bytes(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

// The CLI run takes at most `seconds`, prints exactly one line "packmoe: error: ...needle...",
// exits 1.
void expect_one_error_line(const std::string& args, const std::string& needle,
                           double seconds = 30) {
  const auto t0 = std::chrono::steady_clock::now();
  const RunResult r = run_cli(args);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, seconds) << "too slow to fail: " << args;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  ASSERT_FALSE(r.output.empty());
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << "more than one line: " << r.output;
  EXPECT_EQ(r.output.rfind("packmoe: error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "missing '" << needle << "' in "
                                                      << r.output;
  for (char c : r.output.substr(0, r.output.size() - 1))
    EXPECT_TRUE(static_cast<unsigned char>(c) >= 0x20 && c != 0x7F) << "a control byte in "
                                                                     << r.output;
}

// A fortune-format corpus (the tests must not need the fortunes package).
std::string corpus_flag(const fs::path& dir) {
  std::ofstream f(dir / "corpus.txt");
  for (int d = 0; d < 200; ++d) f << "Document " << d << ": the quick brown fox.\n%\n";
  return " --data text:" + (dir / "corpus.txt").string();
}

const std::string kSmall =
    " --device cpu --micro-batch 2 --seq-len 16 --eval-interval 0 --log-interval 1";

TEST(CliLimits, HostileFlagsAndConfigsAreOneErrorLine) {
  const fs::path dir = temp_dir();
  const std::string out = " --out " + (dir / "out").string();
  write_bytes(dir / "deep.json", nested(100000));
  write_bytes(dir / "deep_train.json", "{\"train\": " + nested(100000) + "}");
  write_bytes(dir / "deep_value.json", "{\"train\": {\"steps\": " + nested(50) + "}}");
  write_bytes(dir / "nul.json", std::string("{\"train\": {}}\0garbage", 22));
  // The tiny preset's sizes with a vocabulary too large for the machine / for 64 bits.
  const std::string sizes = R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
      "moe_intermediate_size": 32, "num_experts_per_tok": 2, )";
  write_bytes(dir / "vocab.json", "{" + sizes + R"("vocab_size": 1099511627776})");
  write_bytes(dir / "overflow.json", "{" + sizes + R"("vocab_size": 9223372036854775807})");
  write_bytes(dir / "u64.json", R"({"train": {"steps": 18446744073709551615}})");
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"train --config " + (dir / "deep.json").string(), "nested deeper than 64 levels"},
      {"train --config " + (dir / "deep_train.json").string(), "nested deeper than 64 levels"},
      {"train --config " + (dir / "deep_value.json").string(),
       "train.steps must be an integer (got an array of 1 values)"},
      {"train --config " + (dir / "nul.json").string(), "a NUL byte at byte 13"},
      {"train --config " + (dir / "vocab.json").string(), "bytes of host memory"},
      {"train --config " + (dir / "overflow.json").string(), "overflows a 64-bit byte count"},
      {"train --config " + (dir / "u64.json").string(), "train.steps must be at most 2^63 - 1"},
      {"train --micro-batch 1000000000", "micro_batch_size x seq_len = 1000000000 x 64"},
      {"train --micro-batch 9223372036854775807", "micro_batch_size = 9223372036854775807"},
      {"train --grad-accum 1099511627776", "grad_accum_steps = 1099511627776 must be at most 2^20"},
      {"train --steps 1099511627777", "steps = 1099511627777 must be at most 2^40"},
      {"train --seed -1", "--seed: '-1' is not an integer in 0 to 18446744073709551615"},
      {"train --seed 18446744073709551616", "--seed: '18446744073709551616' is out of range"},
      {"train --steps 99999999999999999999", "--steps: '99999999999999999999' is out of range"},
      {"train --keep-last 4294967296", "--keep-last: '4294967296' is out of range"},
      {"train --comm-timeout -1", "--comm-timeout = -1 must be seconds"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    expect_one_error_line(c.args + out, c.needle);
    EXPECT_FALSE(fs::exists(dir / "out"));
  }
  fs::remove_all(dir);
}

TEST(CliLimits, OnlyRegularFilesAreRead) {
  const fs::path dir = temp_dir();
  const std::string out = " --out " + (dir / "out").string();
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::mkfifo((dir / "pipe.idx").c_str(), 0600), 0);  // megatron: a FIFO .idx
  ASSERT_EQ(::mkfifo((dir / "pipe.bin").c_str(), 0600), 0);
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"train --data llmc:" + fifo + out, "not a regular file (a FIFO)"},
      {"train --data megatron:" + (dir / "pipe").string() + out, "not a regular file (a FIFO)"},
      {"train --data text:" + fifo + out, "not a regular file (a FIFO)"},
      {"train --data text:/dev/zero" + out, "/dev/zero: not a regular file (a character device)"},
      {"train --config " + fifo + out, "not a regular file (a FIFO)"},
      {"train --config /dev/zero" + out, "not a regular file (a character device)"},
      {"quantize --format mxfp8 --in " + fifo + " --out " + (dir / "out").string(),
       "not a regular file (a FIFO)"},
      {"quantize --format mxfp8 --in /dev/zero --out " + (dir / "out").string(),
       "not a regular file"},
      {"dequantize --in " + fifo + " --out " + (dir / "out").string(), "not a regular file"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    expect_one_error_line(c.args, c.needle);
    EXPECT_FALSE(fs::exists(dir / "out"));
  }
  fs::remove_all(dir);
}

TEST(CliLimits, OutputsAreCheckedBeforeStepOne) {
  const fs::path dir = temp_dir();
  write_bytes(dir / "a_file", "x");
  fs::create_directories(dir / "locked");
  fs::permissions(dir / "locked", fs::perms::owner_read | fs::perms::owner_exec);
  const bool root = ::geteuid() == 0;  // root writes anywhere: the permission case says nothing
  struct Case {
    std::string args, needle;
  };
  std::vector<Case> cases = {
      {"train --out " + (dir / "a_file").string(), "--out " + (dir / "a_file").string() +
                                                       ": exists and is not a directory"},
      {"train --out " + (dir / "a_file" / "sub").string(), "is not a directory"},
      {"train --out " + (dir / "o").string() + " --save-dir " + (dir / "a_file").string(),
       "--save-dir " + (dir / "a_file").string() + ": exists and is not a directory"},
  };
  if (!root)
    cases.push_back({"train --out " + (dir / "o").string() + " --save-dir " +
                         (dir / "locked" / "ckpt").string(),
                     "is not writable"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    expect_one_error_line(c.args + " --steps 1" + kSmall, c.needle);
    EXPECT_FALSE(fs::exists(dir / "o"));
  }
  fs::permissions(dir / "locked", fs::perms::owner_all);
  fs::remove_all(dir);
}

// A run's checkpoints, then the checkpoint-side reproducers against them.
TEST(CliLimits, CheckpointsOfAnotherRunAndHostileCheckpointFiles) {
  const fs::path dir = temp_dir();
  const std::string data = corpus_flag(dir);
  const std::string ckpt = (dir / "ckpt").string();
  RunResult r = run_cli("train --steps 2 --save-interval 1 --keep-last 3" + kSmall + data +
                        " --save-dir " + ckpt + " --out " + (dir / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path step1 = dir / "ckpt" / "step-00000001", step2 = dir / "ckpt" / "step-00000002";
  ASSERT_TRUE(fs::exists(step2 / "complete.json"));

  // A new run into a save root holding another run's checkpoints is refused.
  expect_one_error_line("train --steps 1" + kSmall + data + " --save-dir " + ckpt + " --out " +
                            (dir / "other").string(),
                        "holds 2 checkpoint(s)");
  EXPECT_FALSE(fs::exists(dir / "other"));
  EXPECT_TRUE(fs::exists(step2 / "complete.json"));

  // Hostile copies of step 2, one file changed each, the marker's sizes and CRCs rewritten to
  // match (so only parsing and the value checks can catch them).
  auto copy_of = [&](const std::string& name) {
    const fs::path root = dir / name;
    fs::create_directories(root);
    fs::copy(step2, root / "step-00000002", fs::copy_options::recursive);
    return root / "step-00000002";
  };
  auto reseal = [&](const fs::path& c) {
    nlohmann::json m = nlohmann::json::parse(read_bytes(c / "complete.json"));
    for (auto& f : m["files"]) {
      const std::string bytes = read_bytes(c / f["name"].get<std::string>());
      char crc[9];
      std::snprintf(crc, sizeof crc, "%08x",
                    io::crc32c({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}));
      f["crc32c"] = crc;
      f["bytes"] = bytes.size();
    }
    write_bytes(c / "complete.json", m.dump());
  };
  write_bytes(copy_of("deep_marker") / "complete.json", nested(100000));
  {
    const fs::path c = copy_of("deep_config");
    write_bytes(c / "config.json", nested(100000));
    reseal(c);
  }
  {
    const fs::path c = copy_of("huge_vocab");
    nlohmann::json j = nlohmann::json::parse(read_bytes(c / "config.json"));
    j["vocab_size"] = int64_t{1} << 40;
    write_bytes(c / "config.json", j.dump());
    reseal(c);
  }
  {
    const fs::path c = copy_of("huge_steps");
    nlohmann::json j = nlohmann::json::parse(read_bytes(c / "trainer_state.json"));
    j["optimizer_steps"] = std::numeric_limits<int64_t>::max();
    write_bytes(c / "trainer_state.json", j.dump());
    reseal(c);
  }
  {
    const fs::path c = copy_of("deep_state");
    write_bytes(c / "trainer_state.json", nested(100000));
    reseal(c);
  }
  {
    const fs::path c = copy_of("nan_master");  // a NaN in the first tensor's first F32
    std::string bytes = read_bytes(c / "model.safetensors");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(bytes.data() + 8 + n, &nan, sizeof nan);
    write_bytes(c / "model.safetensors", bytes);
    reseal(c);
  }
  struct Case {
    std::string dir, needle;
  };
  const std::vector<Case> cases = {
      {"deep_marker", "nested deeper than 64 levels"},
      {"deep_config", "nested deeper than 64 levels"},
      {"huge_vocab", "bytes of host memory"},
      {"deep_state", "nested deeper than 64 levels"},
      {"huge_steps", "optimizer_steps = 9223372036854775807 must be at most 2^40"},
      {"nan_master", "holds NaN at element"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dir);
    expect_one_error_line("train --steps 4" + kSmall + data + " --resume " +
                              (dir / c.dir / "step-00000002").string() + " --out " +
                              (dir / "out").string(),
                          c.needle);
    EXPECT_FALSE(fs::exists(dir / "out"));
  }

  // --resume auto passes over a newest checkpoint whose complete.json is hostile.
  write_bytes(step2 / "complete.json", nested(100000));
  r = run_cli("train --steps 3" + kSmall + data + " --resume auto --save-dir " + ckpt +
              " --out " + (dir / "run").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + step1.string() + " at step 1"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("nested deeper than 64 levels"), std::string::npos) << r.output;

  // --overwrite starts a new run there, deleting the old checkpoints first.
  r = run_cli("train --steps 1" + kSmall + data + " --overwrite --save-dir " + ckpt + " --out " +
              (dir / "fresh").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "step-00000001" / "complete.json"));
  EXPECT_FALSE(fs::exists(step2));
  EXPECT_FALSE(fs::exists(dir / "ckpt" / "step-00000003"));
  fs::remove_all(dir);
}

TEST(CliLimits, HostileSafetensorsAreOneEscapedErrorLine) {
  const fs::path dir = temp_dir();
  const std::string out = (dir / "out.safetensors").string();
  const std::string ok_header = R"({"w":{"dtype":"F32","shape":[1,32],"data_offsets":[0,128]}})";
  const std::string data(128, '\0');
  write_bytes(dir / "bom.safetensors", safetensors_bytes("\xEF\xBB\xBF" + ok_header, data));
  write_bytes(dir / "nul.safetensors",
              safetensors_bytes(ok_header + std::string("\0{garbage", 9), data));
  write_bytes(dir / "deep.safetensors", safetensors_bytes(nested(100000)));
  write_bytes(dir / "deep_shape.safetensors",
              safetensors_bytes(R"({"w":{"dtype":"F32","shape":[)" + nested(60) +
                                R"(],"data_offsets":[0,0]}})"));
  // Control bytes in a name: a scale without its data tensor.
  write_bytes(dir / "names.safetensors",
              safetensors_bytes(
                  R"({"evil\n\u001b[31m_scale":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                  std::string(1, '\0')));
  // A zero-row NVFP4 tensor whose width overflows int64 once doubled.
  write_bytes(dir / "wide.safetensors",
              safetensors_bytes(R"({"x":{"dtype":"U8","shape":[0,4611686018427387904],)"
                                R"("data_offsets":[0,0]},"x_scale":{"dtype":"F8_E4M3",)"
                                R"("shape":[0,1],"data_offsets":[0,0]}})"));
  write_bytes(dir / "plain.safetensors", safetensors_bytes(ok_header, data));
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"quantize --format mxfp8 --in " + (dir / "bom.safetensors").string(),
       "header starts with a UTF-8 byte-order mark"},
      {"quantize --format mxfp8 --in " + (dir / "nul.safetensors").string(), "a NUL byte"},
      {"quantize --format mxfp8 --in " + (dir / "deep.safetensors").string(),
       "nested deeper than 64 levels"},
      {"quantize --format mxfp8 --in " + (dir / "deep_shape.safetensors").string(),
       "\"shape\" holds a non-integer an array of 1 values"},
      {"dequantize --in " + (dir / "names.safetensors").string(),
       "tensor 'evil\\x0a\\x1b[31m_scale': is a scale without its data tensor "
       "'evil\\x0a\\x1b[31m'"},
      {"dequantize --in " + (dir / "wide.safetensors").string(), "overflows a 64-bit byte count"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    expect_one_error_line(c.args + " --quiet --device cpu --out " + out, c.needle);
    EXPECT_FALSE(fs::exists(out));
  }
  // Progress lines name tensors too: escaped.
  const RunResult names = run_cli("dequantize --device cpu --in " +
                                  (dir / "names.safetensors").string() + " --out " + out);
  EXPECT_EQ(names.exit_code, 1);
  EXPECT_NE(names.output.find("[1/1] evil\\x0a\\x1b[31m_scale\n"), std::string::npos)
      << names.output;
  EXPECT_EQ(names.output.find('\x1b'), std::string::npos) << names.output;

  // A quantized file is not quantized again, in either format.
  const std::string nvfp4 = (dir / "nvfp4.safetensors").string();
  RunResult r = run_cli("quantize --format nvfp4 --device cpu --in " +
                        (dir / "plain.safetensors").string() + " --out " + nvfp4);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* format : {"mxfp8", "nvfp4"}) {
    SCOPED_TRACE(format);
    expect_one_error_line(std::string("quantize --device cpu --format ") + format + " --in " +
                              nvfp4 + " --out " + out,
                          "the file is quantized already (packmoe.format = nvfp4)");
    EXPECT_FALSE(fs::exists(out));
  }
  fs::remove_all(dir);
}

}  // namespace
