// Tests of io/state_file: tensors of every DType round-trip bitwise through a state file, the read
// accepts exactly the expected names, dtypes and shapes (each mismatch one error naming the file
// and the tensor), foreign safetensors files are refused, and JSON documents round-trip.
#include "io/state_file.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/status_checks.h"
#include "common/test_files.h"
#include "io/safetensors.h"

namespace packmoe::io {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using Json = nlohmann::json;

class StateFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_test_dir("state_file_");
    seed_ = test::recorded_random_seed();
    rng_.seed(seed_);
  }
  void TearDown() override { test::remove_test_dir(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  Tensor random_tensor(DType dtype, Shape shape) {
    Tensor t = Tensor::empty(cpu_backend(), dtype, std::move(shape));
    std::uniform_int_distribution<int> byte(0, 255);
    auto* p = static_cast<uint8_t*>(t.data());
    for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(byte(rng_));
    return t;
  }

  fs::path dir_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

std::vector<StateTensorSpec> specs_of(const StateTensors& ts) {
  std::vector<StateTensorSpec> out;
  for (const auto& [name, t] : ts) out.push_back({name, t.dtype(), t.shape()});
  return out;
}

TEST_F(StateFileTest, EveryDtypeRoundTripsBitwise) {
  StateTensors ts;
  ts["master/model.embed_tokens.weight"] = random_tensor(DType::kF32, {48, 8});
  ts["adamw/m/model.layers.0.mlp.experts.gate_up_proj"] = random_tensor(DType::kF32, {4, 12, 8});
  ts["primary/bf16"] = random_tensor(DType::kBF16, {3, 5});
  ts["primary/e4m3"] = random_tensor(DType::kE4M3, {7});
  ts["primary/e5m2"] = random_tensor(DType::kE5M2, {2, 2});
  ts["primary/e8m0"] = random_tensor(DType::kE8M0, {3});
  ts["primary/e2m1"] = random_tensor(DType::kE2M1, {2, 6});
  ts["data/u8"] = random_tensor(DType::kU8, {9});
  ts["data/i32"] = random_tensor(DType::kI32, {2});
  ts["rng/philox"] = random_tensor(DType::kI64, {4});
  ts["scalar"] = random_tensor(DType::kF32, {});
  ts["empty"] = random_tensor(DType::kF32, {0, 3});
  const std::string p = path("optimizer.safetensors");
  ASSERT_TRUE(write_state_tensors(p, ts).is_ok());
  const auto specs = specs_of(ts);
  auto back = read_state_tensors(p, specs);
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  ASSERT_EQ(back.value().size(), ts.size());
  for (const auto& [name, t] : ts) {
    const Tensor& b = back.value().at(name);
    EXPECT_EQ(b.dtype(), t.dtype()) << name;
    EXPECT_EQ(b.shape(), t.shape()) << name;
    EXPECT_EQ(b.device(), Device::kCPU);
    EXPECT_EQ(std::memcmp(b.data(), t.data(), t.nbytes()), 0) << name;
  }
  // A plain safetensors file that any reader opens, with our format marker.
  auto file = SafetensorsFile::read(p);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  EXPECT_EQ(file.value().metadata().at("format"), "packmoe-state");
  EXPECT_EQ(file.value().find("primary/e2m1")->dtype, "F4");
}

TEST_F(StateFileTest, ReadChecksEveryNameDtypeAndShape) {
  StateTensors ts;
  ts["a"] = random_tensor(DType::kF32, {2, 3});
  ts["b"] = random_tensor(DType::kI64, {2});
  const std::string p = path("state.safetensors");
  ASSERT_TRUE(write_state_tensors(p, ts).is_ok());

  std::vector<StateTensorSpec> want = specs_of(ts);
  want.push_back({"c", DType::kF32, {1}});
  expect_error(read_state_tensors(p, want).status(), {p, "\"c\"", "missing"});
  want = {{"a", DType::kF32, {2, 3}}};
  expect_error(read_state_tensors(p, want).status(), {p, "\"b\"", "unexpected"});
  want = {{"a", DType::kBF16, {2, 3}}, {"b", DType::kI64, {2}}};
  expect_error(read_state_tensors(p, want).status(), {p, "\"a\"", "F32", "BF16"});
  want = {{"a", DType::kF32, {3, 2}}, {"b", DType::kI64, {2}}};
  expect_error(read_state_tensors(p, want).status(), {p, "\"a\"", "(2, 3)", "(3, 2)"});

  // Not a state file: a safetensors file without (or with another) format marker.
  SafetensorsWriter hf;
  hf.set_metadata("format", "pt");
  hf.add("a", "F32", {2, 3}, std::vector<uint8_t>(24));
  ASSERT_TRUE(hf.write(path("hf.safetensors")).is_ok());
  expect_error(read_state_tensors(path("hf.safetensors"), want).status(),
               {path("hf.safetensors"), "packmoe state"});
  // Truncated.
  fs::resize_file(p, fs::file_size(p) - 3);
  expect_error(read_state_tensors(p, specs_of(ts)).status(), {p});
}

TEST_F(StateFileTest, WriteRefusesDeviceTensorsAndLeavesNoFile) {
  StateTensors ts;
  static float x = 1.f;
  ts["on_gpu"] = Tensor::view(&x, DType::kF32, {1}, Device::kCUDA);
  const std::string p = path("state.safetensors");
  expect_error(write_state_tensors(p, ts), {p, "on_gpu", "host"});
  EXPECT_FALSE(fs::exists(p));
}

TEST_F(StateFileTest, JsonRoundTripAndErrors) {
  const Json doc = {{"step", 123},
                    {"rng", {{"seed", 18446744073709551615ull}, {"offset", 7}}},
                    {"data", {{"epoch", 1}, {"position", 9876543210}}},
                    {"recipe", "mxfp8"},
                    {"lr", 3.0e-4}};
  const std::string p = path("trainer_state.json");
  ASSERT_TRUE(write_json_file(p, doc).is_ok());
  auto back = read_json_file(p);
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back.value(), doc);
  EXPECT_EQ(back.value()["rng"]["seed"].get<uint64_t>(), 18446744073709551615ull);

  std::ofstream(path("bad.json")) << "{\"step\": 1,";
  expect_error(read_json_file(path("bad.json")).status(), {path("bad.json"), "JSON"});
  expect_error(read_json_file(path("absent.json")).status(), {path("absent.json"), "cannot open"});
}

}  // namespace
}  // namespace packmoe::io
