// End-to-end tests of `packmoe quantize` / `dequantize` / `demo` as a user runs them: file layout
// (checked against hand-derived bytes and against the reference quantizer), exit codes, one-line
// errors, and that a failed run never creates or clobbers the output file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "backend/backend.h"
#include "common/run_cli.h"
#include "core/codecs.h"
#include "formats/mxfp8.h"
#include "formats/nvfp4.h"
#include "formats/nvfp4_math.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using namespace packmoe;

namespace {

using packmoe::test::RunResult;
using packmoe::test::run_cli;

fs::path temp_dir() {
  const char* env = std::getenv("PACKMOE_TEST_TMP");
  fs::path base = env ? fs::path(env) : fs::temp_directory_path();
  fs::path dir = base / ("cli_" + std::to_string(::getpid()) + "_" +
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = f32_to_bf16(v[i]);
    std::memcpy(&b[2 * i], &h, 2);
  }
  return b;
}

std::vector<float> random_values(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(d(rng)));
  return v;
}

void write_file(const fs::path& path, const io::SafetensorsWriter& w) {
  ASSERT_TRUE(w.write(path.string()).is_ok());
}

std::vector<uint8_t> bytes_of(const io::SafetensorsEntry* e) {
  return std::vector<uint8_t>(e->bytes.begin(), e->bytes.end());
}

// Exactly one error line, the last line of the output (progress lines may precede it).
void expect_one_error_line(const RunResult& r, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 1) << r.output;
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = r.output.find('\n', start)) != std::string::npos; start = nl + 1)
    lines.push_back(r.output.substr(start, nl - start));
  ASSERT_FALSE(lines.empty()) << r.output;
  int errors = 0;
  for (const auto& l : lines) errors += l.rfind("packmoe: error: ", 0) == 0;
  EXPECT_EQ(errors, 1) << r.output;
  EXPECT_EQ(lines.back().rfind("packmoe: error: ", 0), 0u) << r.output;
  EXPECT_NE(lines.back().find(needle), std::string::npos) << "missing '" << needle << "' in " << r.output;
}

}  // namespace

TEST(Cli, QuantizeMxfp8WritesHandDerivedBytesAndCopiesOtherTensors) {
  fs::path dir = temp_dir();
  std::mt19937 rng(std::random_device{}());
  const int64_t rows = 64, cols = 64;
  std::vector<float> w = random_values(rows * cols, rng, 0.5f);
  // Row 0, block 0 (columns 0..31): amax 448 -> v = 448 * fp32(1/448) = 1 exactly -> E8M0 code
  // 127 (scale 1); elements encode unscaled: 448 -> 0x7E, 1 -> 0x38, -2 -> 0xC0, 0.5 -> 0x30.
  std::fill(w.begin(), w.begin() + 32, 0.f);
  w[0] = 448.f, w[1] = 1.f, w[2] = -2.f, w[3] = 0.5f;
  std::vector<float> norm = random_values(cols, rng, 1.f);
  io::SafetensorsWriter in;
  in.add("layer.w", "BF16", {rows, cols}, bf16_bytes(w));
  std::vector<uint8_t> norm_bytes(norm.size() * 4);
  std::memcpy(norm_bytes.data(), norm.data(), norm_bytes.size());
  in.add("layer.norm", "F32", {cols}, norm_bytes);
  write_file(dir / "in.safetensors", in);

  RunResult r = run_cli("quantize --format mxfp8 --device cpu --in " + (dir / "in.safetensors").string() +
                        " --out " + (dir / "q.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto q = io::SafetensorsFile::read((dir / "q.safetensors").string());
  ASSERT_TRUE(q.is_ok()) << q.status().message();
  const auto* data = q.value().find("layer.w");
  const auto* scale = q.value().find("layer.w_scale");
  ASSERT_TRUE(data && scale);
  EXPECT_EQ(data->dtype, "F8_E4M3");
  EXPECT_EQ(data->shape, (std::vector<int64_t>{rows, cols}));
  EXPECT_EQ(scale->dtype, "F8_E8M0");
  EXPECT_EQ(scale->shape, (std::vector<int64_t>{rows, cols / 32}));
  EXPECT_EQ(scale->bytes[0], 127);
  EXPECT_EQ(data->bytes[0], 0x7E);
  EXPECT_EQ(data->bytes[1], 0x38);
  EXPECT_EQ(data->bytes[2], 0xC0);
  EXPECT_EQ(data->bytes[3], 0x30);
  EXPECT_EQ(data->bytes[4], 0x00);
  EXPECT_EQ(bytes_of(q.value().find("layer.norm")), norm_bytes);
  EXPECT_EQ(q.value().metadata().at("packmoe.format"), "mxfp8");

  // Whole tensor equals the reference quantizer called directly.
  std::vector<uint8_t> src = bf16_bytes(w), ref_data(rows * cols), ref_scale(rows * cols / 32);
  GroupedMatrices g{DType::kBF16, cols, {src.data()}, {rows}};
  Mxfp8Outputs o;
  o.row_data = {ref_data.data()};
  o.row_scale = {ref_scale.data()};
  ASSERT_TRUE(quantize_mxfp8_cpu(g, Mxfp8Config{}, o).is_ok());
  EXPECT_EQ(bytes_of(data), ref_data);
  EXPECT_EQ(bytes_of(scale), ref_scale);

  // Dequantize back: every value within half an E4M3 step of its block (|x| * 2^-4, or the
  // subnormal step 2^-10 * scale) of the original.
  r = run_cli("dequantize --device cpu --in " + (dir / "q.safetensors").string() + " --out " +
              (dir / "dq.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto dq = io::SafetensorsFile::read((dir / "dq.safetensors").string());
  ASSERT_TRUE(dq.is_ok());
  const auto* y = dq.value().find("layer.w");
  ASSERT_TRUE(y && y->dtype == "F32");
  EXPECT_EQ(dq.value().find("layer.w_scale"), nullptr);
  for (int64_t i = 0; i < rows * cols; ++i) {
    float v;
    std::memcpy(&v, y->bytes.data() + 4 * i, 4);
    float block_scale = e8m0_to_f32(scale->bytes[i / 32]);
    EXPECT_LE(std::fabs(v - w[i]), std::max(std::fabs(w[i]) * 0.0625f, block_scale * 0x1p-10f))
        << "element " << i;
  }
  EXPECT_EQ(bytes_of(dq.value().find("layer.norm")), norm_bytes);
}

TEST(Cli, QuantizeNvfp4WritesHandDerivedBytes) {
  fs::path dir = temp_dir();
  std::mt19937 rng(std::random_device{}());
  const int64_t rows = 32, cols = 64;
  std::vector<float> w = random_values(rows * cols, rng, 0.3f);
  for (auto& x : w) x = std::clamp(x, -1.f, 1.f);
  // Tensor amax 2688 (row 1) -> S_enc = 1, S_dec = 1. Row 0 block 0 has amax 6 -> block scale
  // e4m3(6 * fp32(1/6)) = e4m3(1.0) = 0x38, reciprocal 1; elements 6 -> 0x7, 0.5 -> 0x1,
  // -3 -> 0xD, 0 -> 0x0; packed low nibble first: byte0 = 0x17, byte1 = 0x0D.
  std::fill(w.begin(), w.begin() + 16, 0.f);
  w[0] = 6.f, w[1] = 0.5f, w[2] = -3.f;
  w[cols + 5] = 2688.f;
  io::SafetensorsWriter in;
  in.add("w", "BF16", {rows, cols}, bf16_bytes(w));
  write_file(dir / "in.safetensors", in);
  RunResult r = run_cli("quantize --format nvfp4 --device cpu --quiet --in " +
                        (dir / "in.safetensors").string() + " --out " + (dir / "q.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto q = io::SafetensorsFile::read((dir / "q.safetensors").string());
  ASSERT_TRUE(q.is_ok());
  const auto* data = q.value().find("w");
  const auto* scale = q.value().find("w_scale");
  const auto* scale2 = q.value().find("w_scale_2");
  ASSERT_TRUE(data && scale && scale2);
  EXPECT_EQ(data->dtype, "U8");
  EXPECT_EQ(data->shape, (std::vector<int64_t>{rows, cols / 2}));
  EXPECT_EQ(scale->dtype, "F8_E4M3");
  EXPECT_EQ(scale->shape, (std::vector<int64_t>{rows, cols / 16}));
  EXPECT_EQ(scale2->dtype, "F32");
  EXPECT_TRUE(scale2->shape.empty());
  float s2;
  std::memcpy(&s2, scale2->bytes.data(), 4);
  EXPECT_EQ(s2, 1.0f);
  EXPECT_EQ(scale->bytes[0], 0x38);
  EXPECT_EQ(data->bytes[0], 0x17);
  EXPECT_EQ(data->bytes[1], 0x0D);

  // Round trip through the file equals the in-memory reference dequantization bit for bit.
  r = run_cli("dequantize --device cpu --quiet --in " + (dir / "q.safetensors").string() +
              " --out " + (dir / "dq.safetensors").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto dq = io::SafetensorsFile::read((dir / "dq.safetensors").string());
  ASSERT_TRUE(dq.is_ok());
  std::vector<uint8_t> src = bf16_bytes(w), qd(rows * cols / 2), qs(rows * cols / 16);
  float amax = 0;
  GroupedMatrices g{DType::kBF16, cols, {src.data()}, {rows}};
  Nvfp4Outputs o;
  o.row_data = {qd.data()};
  o.row_scale = {qs.data()};
  o.row_amax = &amax;
  ASSERT_TRUE(quantize_nvfp4_cpu(g, Nvfp4Config{}, o).is_ok());
  EXPECT_EQ(amax, 2688.f);
  float dec = nvfp4_decode_scale(amax);
  std::vector<float> ref(rows * cols);
  Nvfp4Copy c{cols, {rows}, {qd.data()}, {qs.data()}, &dec};
  ASSERT_TRUE(dequantize_nvfp4_cpu(c, DType::kF32, {ref.data()}).is_ok());
  std::vector<uint8_t> ref_bytes(ref.size() * 4);
  std::memcpy(ref_bytes.data(), ref.data(), ref_bytes.size());
  EXPECT_EQ(bytes_of(dq.value().find("w")), ref_bytes);
}

TEST(Cli, BadInputGivesOneErrorLineAndLeavesOutputAlone) {
  fs::path dir = temp_dir();
  fs::path out = dir / "out.safetensors";
  std::ofstream(out) << "sentinel";
  auto sentinel_intact = [&] {
    std::ifstream f(out);
    std::string s((std::istreambuf_iterator<char>(f)), {});
    return s == "sentinel";
  };
  const std::string tail = " --device cpu --out " + out.string();

  expect_one_error_line(run_cli("quantize --format mxfp8 --in " + (dir / "missing.safetensors").string() + tail),
                        "missing.safetensors");
  EXPECT_TRUE(sentinel_intact());

  std::ofstream(dir / "junk.safetensors") << "this is not a safetensors file at all";
  expect_one_error_line(run_cli("quantize --format mxfp8 --in " + (dir / "junk.safetensors").string() + tail),
                        "junk.safetensors");

  // Truncated: a valid file cut in half.
  io::SafetensorsWriter w;
  std::mt19937 rng(std::random_device{}());
  w.add("w", "BF16", {32, 64}, bf16_bytes(random_values(32 * 64, rng, 1.f)));
  write_file(dir / "ok.safetensors", w);
  fs::resize_file(dir / "ok.safetensors", fs::file_size(dir / "ok.safetensors") / 2 + 20);
  expect_one_error_line(run_cli("quantize --format nvfp4 --in " + (dir / "ok.safetensors").string() + tail),
                        "ok.safetensors");

  // Unsupported dtype of a 2-D float tensor.
  io::SafetensorsWriter f16;
  f16.add("h", "F16", {32, 32}, std::vector<uint8_t>(32 * 32 * 2, 0x3C));
  write_file(dir / "f16.safetensors", f16);
  expect_one_error_line(run_cli("quantize --format mxfp8 --in " + (dir / "f16.safetensors").string() + tail),
                        "F16");

  // A shape the format cannot take: K = 40 is not a multiple of 32.
  io::SafetensorsWriter bad;
  bad.add("odd", "F32", {4, 40}, std::vector<uint8_t>(4 * 40 * 4, 0x3F));
  write_file(dir / "bad.safetensors", bad);
  expect_one_error_line(run_cli("quantize --format mxfp8 --in " + (dir / "bad.safetensors").string() + tail),
                        "odd");
  EXPECT_TRUE(sentinel_intact());

  // Dequantize of a file with nothing quantized.
  io::SafetensorsWriter plain;
  plain.add("w", "F32", {2, 2}, std::vector<uint8_t>(16, 1));
  write_file(dir / "plain.safetensors", plain);
  expect_one_error_line(run_cli("dequantize --in " + (dir / "plain.safetensors").string() + tail),
                        "no quantized tensor");
  EXPECT_TRUE(sentinel_intact());

  // Flags.
  EXPECT_NE(run_cli("quantize --format int3 --in a --out b").exit_code, 0);
  EXPECT_NE(run_cli("frobnicate").exit_code, 0);
  RunResult help = run_cli("quantize --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("--format"), std::string::npos);
  fs::remove_all(dir);
}

TEST(Cli, DemoRunsOnCpuAndReportsBitwiseEquality) {
  RunResult r = run_cli("demo --device cpu --experts 3 --rows 64 --cols 64");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("NO"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("nvfp4 16x16"), std::string::npos) << r.output;
}

// Where a GPU is usable, the CUDA path of quantize and dequantize writes the same file bytes as
// the CPU path (the quantizers are bitwise equal). Skipped on machines without a GPU.
TEST(Cli, CudaAndCpuWriteTheSameFiles) {
  if (!cuda_available()) GTEST_SKIP() << "no usable GPU";
  fs::path dir = temp_dir();
  std::mt19937 rng(std::random_device{}());
  io::SafetensorsWriter in;
  in.add("a", "BF16", {64, 128}, bf16_bytes(random_values(64 * 128, rng, 0.7f)));
  in.add("b", "BF16", {32, 64}, bf16_bytes(random_values(32 * 64, rng, 3.f)));
  write_file(dir / "in.safetensors", in);
  auto bytes = [](const fs::path& f) {
    std::ifstream s(f, std::ios::binary);
    return std::vector<char>((std::istreambuf_iterator<char>(s)), {});
  };
  for (const char* format : {"mxfp8 --2d", "mxfp8", "nvfp4 --2d", "nvfp4"}) {
    SCOPED_TRACE(format);
    for (const char* device : {"cpu", "cuda"}) {
      const std::string q = (dir / (std::string("q_") + device)).string();
      const std::string dq = (dir / (std::string("dq_") + device)).string();
      RunResult r = run_cli(std::string("quantize --quiet --format ") + format + " --device " +
                            device + " --in " + (dir / "in.safetensors").string() + " --out " + q);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      r = run_cli(std::string("dequantize --quiet --device ") + device + " --in " + q + " --out " + dq);
      ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    EXPECT_EQ(bytes(dir / "q_cpu"), bytes(dir / "q_cuda"));
    EXPECT_EQ(bytes(dir / "dq_cpu"), bytes(dir / "dq_cuda"));
  }
  fs::remove_all(dir);
}
