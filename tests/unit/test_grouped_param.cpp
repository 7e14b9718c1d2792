// GroupedParam / GroupedLinear / AdamW units: the optimizer's master is the FP32 init's bytes
// (never the dequantized primary), checked state machines (death tests), every expert's gradient reaches its
// slice of main_grad, one step against FP64 on the dequantized operands, a batch with no tokens,
// ONE quantize call per pack and ONE optimizer call per param in both layouts, and a backend
// reporting a device (over host memory) bitwise equal to the CPU backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/codecs.h"
#include "formats/nvfp4_math.h"
#include "common/single_rank_optimizer.h"
#include "nn/grouped_linear.h"

namespace packmoe {
namespace {

constexpr int64_t kE = 4, kN = 64, kK = 32;

struct RecipeCase {
  const char* name;
  QuantRecipe recipe;
};
const RecipeCase kRecipes[] = {{"bf16", {Recipe::kBF16, false, 5}},
                               {"mxfp8", {Recipe::kMxfp8, false, 5}},
                               {"mxfp8_2d", {Recipe::kMxfp8, true, 5}},
                               {"nvfp4", {Recipe::kNvfp4, false, 5}}};
constexpr PrimaryWeight kPrimaries[] = {PrimaryWeight::kHighPrecision, PrimaryWeight::kLowPrecision};
constexpr Layout kLayouts[] = {Layout::kSingle, Layout::kDiscrete};

std::string label(const RecipeCase& r, PrimaryWeight p, Layout l) {
  return std::string(r.name) + (p == PrimaryWeight::kHighPrecision ? " high" : " low") +
         (l == Layout::kSingle ? " single" : " discrete");
}

// (E, N, K) F32 on the host: values with full FP32 mantissas (not BF16-representable).
Tensor random_init(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, {kE, kN, kK});
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = dist(rng) * float(1 + i % 5);
  return t;
}

std::vector<uint8_t> host_bytes(const Tensor& t) {
  const uint8_t* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

std::vector<uint8_t> bytes_of(Backend& b, const Tensor& t) {
  std::vector<uint8_t> h(t.nbytes());
  if (!h.empty()) b.copy(h.data(), t.data(), h.size(), Backend::CopyKind::kDeviceToHost);
  return h;
}

std::vector<float> floats_of(Backend& b, const Tensor& t) {
  PACKMOE_CHECK(t.dtype() == DType::kF32, "F32 expected");
  std::vector<float> h(t.numel());
  if (!h.empty()) b.copy(h.data(), t.data(), t.nbytes(), Backend::CopyKind::kDeviceToHost);
  return h;
}

// Host BF16 values of a (rows, cols) activation, rows of group g scaled by 4^g.
std::vector<uint16_t> random_bf16_host(uint32_t seed, const std::vector<int64_t>& m, int64_t cols) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> h;
  for (size_t g = 0; g < m.size(); ++g)
    for (int64_t i = 0; i < m[g] * cols; ++i) h.push_back(f32_to_bf16(dist(rng) * float(1 << (2 * g))));
  return h;
}

Tensor upload_bf16(Backend& b, const std::vector<uint16_t>& h, int64_t cols) {
  Tensor t = Tensor::empty(b, DType::kBF16, {static_cast<int64_t>(h.size()) / cols, cols});
  if (t.nbytes()) b.copy(t.data(), h.data(), t.nbytes(), Backend::CopyKind::kHostToDevice);
  return t;
}

int64_t sum(const std::vector<int64_t>& m) {
  int64_t s = 0;
  for (int64_t v : m) s += v;
  return s;
}

// ---- dequantization of stored operands (CPU backend, host pointers) -----------------------------

// Group g of an operand whose stored matrix is (rows[g], cols), dequantized to F32 in the stored
// layout. `mx_columnwise`: MXFP8 scales run down the columns.
std::vector<std::vector<float>> dequantize_stored(const GemmOperand& o,
                                                  const std::vector<int64_t>& rows, int64_t cols,
                                                  bool mx_columnwise) {
  Backend& b = cpu_backend();
  std::vector<std::vector<float>> out(rows.size());
  std::vector<void*> ptrs;
  for (size_t g = 0; g < rows.size(); ++g) {
    out[g].resize(rows[g] * cols);
    ptrs.push_back(out[g].data());
  }
  switch (o.format) {
    case OperandFormat::kBF16:
      for (size_t g = 0; g < rows.size(); ++g)
        for (int64_t i = 0; i < rows[g] * cols; ++i)
          out[g][i] = bf16_to_f32(static_cast<const uint16_t*>(o.data[g])[i]);
      break;
    case OperandFormat::kMxfp8: {
      Mxfp8Copy q{o.element, mx_columnwise, cols, rows, o.data, o.scale};
      EXPECT_TRUE(ops::dequantize_mxfp8(b, q, DType::kF32, ptrs).is_ok());
      break;
    }
    case OperandFormat::kNvfp4: {
      Nvfp4Copy q{cols, rows, o.data, o.scale, o.decode_scale};
      EXPECT_TRUE(ops::dequantize_nvfp4(b, q, DType::kF32, ptrs).is_ok());
      break;
    }
  }
  return out;
}

std::vector<float> transpose(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

// Logical (rows_g, cols) F32 of each group of an operand: `reduce_rows` selects the copy whose
// blocks run down the rows (NVFP4 stores that one transposed), as in backend/ops/gemm.h.
std::vector<std::vector<float>> dequantize_logical(const GemmOperand& o,
                                                   const std::vector<int64_t>& rows, int64_t cols,
                                                   bool reduce_rows) {
  if (o.format != OperandFormat::kNvfp4 || !reduce_rows)
    return dequantize_stored(o, rows, cols, reduce_rows);
  std::vector<int64_t> stored_rows(rows.size(), cols);
  std::vector<std::vector<float>> out;
  // Stored (cols, rows_g): one stored row length per group, so dequantize group by group.
  for (size_t g = 0; g < rows.size(); ++g) {
    GemmOperand one = o;
    one.data = {o.data[g]};
    one.scale = {o.scale[g]};
    one.decode_scale = static_cast<const float*>(o.decode_scale) + g;
    if (rows[g] == 0) {
      out.emplace_back();
      continue;
    }
    out.push_back(transpose(dequantize_stored(one, {cols}, rows[g], false)[0], cols, rows[g]));
  }
  return out;
}

// The copies of an activation the layer makes, re-made here with the recipe's quantizer: (M, C)
// BF16 host values with group row counts m. Returns the operands (host pointers into `keep`).
struct ActCopies {
  std::vector<std::vector<uint8_t>> keep;
  GemmOperand row, col;
};
ActCopies quantize_here(const QuantRecipe& q, TensorRole role, std::vector<uint16_t>& a,
                        const std::vector<int64_t>& m, int64_t c, uint64_t sr_offset) {
  Backend& b = cpu_backend();
  ActCopies out;
  const OperandFormat f = operand_format(q.recipe);
  out.row.format = out.col.format = f;
  const std::vector<void*> in_ptrs = carve_rows(a.data(), m, c * 2);
  if (f == OperandFormat::kBF16) {
    out.row.data.assign(in_ptrs.begin(), in_ptrs.end());
    out.col = out.row;
    return out;
  }
  const int64_t rows = sum(m);
  const bool mx = f == OperandFormat::kMxfp8;
  const size_t data_row = mx ? c : c / 2, scale_row = mx ? c / 32 : c / 16;
  auto buffer = [&](size_t bytes) { return out.keep.emplace_back(bytes).data(); };
  void* rd = buffer(rows * data_row);
  void* rs = buffer(rows * scale_row);
  void* cd = buffer(rows * data_row);
  void* cs = buffer(rows * scale_row);
  GroupedMatrices in{DType::kBF16, c, {in_ptrs.begin(), in_ptrs.end()}, m};
  const auto to_const = [](const std::vector<void*>& v) { return std::vector<const void*>(v.begin(), v.end()); };
  Mxfp8Outputs mo{carve_rows(rd, m, data_row), carve_rows(rs, m, scale_row),
                  carve_rows(cd, m, data_row), carve_rows(cs, m, scale_row), {}, {}};
  out.row.data = to_const(mo.row_data);
  out.row.scale = to_const(mo.row_scale);
  out.col.data = to_const(mo.col_data);
  out.col.scale = to_const(mo.col_scale);
  if (mx) {
    EXPECT_TRUE(ops::quantize_mxfp8(b, in, mxfp8_config(q, role), mo).is_ok());
    return out;
  }
  float* amax = reinterpret_cast<float*>(buffer(2 * m.size() * sizeof(float)));
  float* decode = reinterpret_cast<float*>(buffer(2 * m.size() * sizeof(float)));
  Nvfp4Outputs no{mo.row_data, mo.row_scale, amax, mo.col_data, mo.col_scale, amax + m.size(), {}};
  EXPECT_TRUE(ops::quantize_nvfp4(b, in, nvfp4_config(q, role, sr_offset), no).is_ok());
  for (size_t i = 0; i < 2 * m.size(); ++i) decode[i] = nvfp4_decode_scale(amax[i]);
  out.row.decode_scale = decode;
  out.col.decode_scale = decode + m.size();
  return out;
}

double rel_frobenius(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

// ---- the master ----------------------------------------------------------------------------------

TEST(GroupedParam, MasterIsTheFp32InitNotTheDequantizedPrimary) {
  Backend& b = cpu_backend();
  const Tensor init = random_init(11);
  const std::vector<uint8_t> init_bytes = host_bytes(init);
  const std::vector<int64_t> rows(kE, kN);
  for (const RecipeCase& r : kRecipes)
    for (PrimaryWeight p : kPrimaries)
      for (Layout l : kLayouts) {
        SCOPED_TRACE(label(r, p, l));
        GroupedParam param(b, r.recipe, p, l, init);
        EXPECT_EQ(param.fp32_state(), Fp32State::kInitHeld);
        EXPECT_TRUE(param.fp32_weight().download() == init_bytes);
        param.prepare_compute();
        // What a master made from the primary weight would hold (Megatron's fallback). It differs
        // from the init, so the equality below fails for a master made that way.
        std::vector<uint8_t> dequantized;
        for (const auto& g : dequantize_stored(param.fprop_weight(), rows, kK, false)) {
          const uint8_t* p8 = reinterpret_cast<const uint8_t*>(g.data());
          dequantized.insert(dequantized.end(), p8, p8 + g.size() * sizeof(float));
        }
        ASSERT_EQ(dequantized.size(), init_bytes.size());
        EXPECT_FALSE(dequantized == init_bytes) << "the init is representable: the test has no teeth";

        std::vector<std::vector<uint8_t>> weights;
        for (const NamedStorage& s : param.weight_components()) weights.push_back(s.storage->download());
        SingleRankOptimizer opt(b, {{&param, true}}, AdamWConfig{});
        EXPECT_EQ(param.fp32_state(), Fp32State::kReleased) << "the optimizer took the init";
        EXPECT_TRUE(opt.master_bytes(0) == init_bytes) << "master is not the FP32 init";
        // Primary from the master (no update yet) == primary from the init: one conversion rule.
        opt->prepare_forward();
        param.prepare_compute();
        const auto after = param.weight_components();
        ASSERT_EQ(after.size(), weights.size());
        for (size_t i = 0; i < after.size(); ++i)
          EXPECT_TRUE(after[i].storage->download() == weights[i]) << after[i].name;
      }
}

// ---- state machines (death tests) ----------------------------------------------------------------

class GroupedStateDeathTest : public testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }

  // An MXFP8 layer as built.
  std::unique_ptr<GroupedLinear> layer(bool delay) {
    GroupedLinearConfig cfg;
    cfg.recipe = {Recipe::kMxfp8, false, 1};
    cfg.delay_wgrad = delay;
    return std::make_unique<GroupedLinear>(cpu_backend(), cfg, random_init(3));
  }
  const std::vector<int64_t> m_ = {32, 0, 32, 64};
  Tensor x() { auto h = random_bf16_host(1, m_, kK); return upload_bf16(cpu_backend(), h, kK); }
  Tensor dy() { auto h = random_bf16_host(2, m_, kN); return upload_bf16(cpu_backend(), h, kN); }
};

// The master is made once, from the init: a second optimizer finds the init gone.
TEST_F(GroupedStateDeathTest, SecondOptimizerOverOneParamDies) {
  GroupedParam p(cpu_backend(), {Recipe::kNvfp4, false, 0}, PrimaryWeight::kLowPrecision,
                 Layout::kSingle, random_init(4));
  SingleRankOptimizer first(cpu_backend(), {{&p, true}}, AdamWConfig{});
  EXPECT_DEATH((SingleRankOptimizer(cpu_backend(), {{&p, true}}, AdamWConfig{})),
               "param 0 is already under an optimizer \\(its init is gone\\)");
  EXPECT_DEATH(p.fp32_weight(), "no FP32 weight here: the param is Released");
}

// The trainer's NVFP4 gradient SR offsets: step (24 bits) | micro-batch index (12) | 2^28 blocks
// of the micro-batch's own, so every (step, index) owns a disjoint window of the stream.
TEST(GradSrOffset, StepAndMicroBatchOwnDisjointWindows) {
  EXPECT_EQ(nvfp4_grad_sr_offset(1, 0), uint64_t{1} << 40);
  EXPECT_EQ(nvfp4_grad_sr_offset(3, 5), (uint64_t{3} << 40) | (uint64_t{5} << 28));
  EXPECT_EQ(nvfp4_grad_sr_offset((1 << 24) - 1, 4095), ~uint64_t{0} << 28);
  std::vector<uint64_t> starts;
  for (int64_t step = 1; step <= 4; ++step)
    for (int64_t index = 0; index < 4; ++index) starts.push_back(nvfp4_grad_sr_offset(step, index));
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i)
    EXPECT_GE(starts[i] - starts[i - 1], uint64_t{1} << kSrBlockBits) << i;
}

TEST_F(GroupedStateDeathTest, GradSrOffsetOutOfRangeDies) {
  EXPECT_DEATH(nvfp4_grad_sr_offset(0, 0), "step 0 outside");
  EXPECT_DEATH(nvfp4_grad_sr_offset(1 << 24, 0), "outside \\[1, 2\\^24\\)");
  EXPECT_DEATH(nvfp4_grad_sr_offset(1, 4096), "4097 micro-batches in one step");
}

TEST_F(GroupedStateDeathTest, ForwardWithPendingWgradDies) {
  auto l = layer(true);
  l->forward(x(), m_);
  l->backward(dy(), GradAccum::kAccumulate);
  EXPECT_EQ(l->state(), LinearState::kWgradPending);
  EXPECT_DEATH(l->forward(x(), m_), "forward with a delayed wgrad pending");
}

TEST_F(GroupedStateDeathTest, ZeroGradWithPendingWgradDies) {
  auto l = layer(true);
  l->forward(x(), m_);
  l->backward(dy(), GradAccum::kAccumulate);
  EXPECT_DEATH(l->param().zero_grad(), "zero_grad with a delayed wgrad pending");
}

TEST_F(GroupedStateDeathTest, OptimizerStepWithPendingWgradDies) {
  auto l = layer(true);
  SingleRankOptimizer opt(cpu_backend(), {{&l->param(), true}}, AdamWConfig{});
  opt->prepare_forward();
  l->forward(x(), m_);
  opt->prepare_backward();
  l->backward(dy(), GradAccum::kAccumulate);
  EXPECT_DEATH(opt->step(), "optimizer step with a delayed wgrad pending");
}

TEST_F(GroupedStateDeathTest, DoubledWgradDies) {
  auto l = layer(true);
  l->forward(x(), m_);
  l->backward(dy(), GradAccum::kAccumulate);
  l->backward_dw();
  EXPECT_EQ(l->state(), LinearState::kIdle);
  EXPECT_DEATH(l->backward_dw(), "backward_dw without a queued wgrad");
}

TEST_F(GroupedStateDeathTest, WgradDrainWithoutDelayDies) {
  auto l = layer(false);
  l->forward(x(), m_);
  l->backward(dy(), GradAccum::kAccumulate);  // the wgrad already ran
  EXPECT_DEATH(l->backward_dw(), "backward_dw without a queued wgrad");
}

TEST_F(GroupedStateDeathTest, SecondBackwardDies) {
  auto l = layer(false);
  l->forward(x(), m_);
  l->backward(dy(), GradAccum::kAccumulate);
  EXPECT_DEATH(l->backward(dy(), GradAccum::kAccumulate), "backward needs a forward first");
}

TEST(GroupedState, ForwardAfterForwardDropsTheFirst) {  // an eval forward before the train one
  GroupedLinearConfig cfg;
  cfg.recipe = {Recipe::kNvfp4, false, 1};
  GroupedLinear l(cpu_backend(), cfg, random_init(3));
  const std::vector<int64_t> m = {32, 32, 0, 32};
  auto xh = random_bf16_host(1, m, kK), dyh = random_bf16_host(2, m, kN);
  l.forward(upload_bf16(cpu_backend(), xh, kK), m);
  l.forward(upload_bf16(cpu_backend(), xh, kK), m);
  EXPECT_EQ(l.state(), LinearState::kForwardDone);
  l.backward(upload_bf16(cpu_backend(), dyh, kN), GradAccum::kAccumulate);
  EXPECT_EQ(l.state(), LinearState::kIdle);
}

// ---- every expert's gradient reaches its slice of main_grad -------------------------------------

// Per expert: does its (N, K) slice of main_grad hold any non-zero value?
std::vector<bool> nonzero_slices(const GroupedParam& p) {
  const std::vector<uint8_t> g = p.main_grad().download();
  const size_t slice = kN * kK * sizeof(float);
  std::vector<bool> out;
  for (int64_t e = 0; e < kE; ++e) {
    bool any = false;
    for (size_t i = 0; i < slice; i += sizeof(float)) {
      float v;
      std::memcpy(&v, g.data() + e * slice + i, sizeof v);
      any = any || v != 0.0f;
    }
    out.push_back(any);
  }
  return out;
}

TEST(GroupedLinear, EveryExpertsGradientReachesItsSliceOfMainGrad) {
  Backend& b = cpu_backend();
  const std::vector<int64_t> all = {32, 64, 32, 32};
  const std::vector<int64_t> some = {0, 64, 0, 32};  // experts 0 and 2 get no tokens
  for (const RecipeCase& r : kRecipes)
    for (Layout l : kLayouts)
      for (bool fusion : {false, true})
        for (bool delay : {false, true}) {
          SCOPED_TRACE(label(r, PrimaryWeight::kLowPrecision, l) + (fusion ? " fused" : " unfused") +
                       (delay ? " delayed" : ""));
          GroupedLinearConfig cfg;
          cfg.recipe = r.recipe;
          cfg.primary = PrimaryWeight::kLowPrecision;
          cfg.layout = l;
          cfg.grad_accum_fusion = fusion;
          cfg.delay_wgrad = delay;
          GroupedLinear layer(b, cfg, random_init(21));
          auto step = [&](const std::vector<int64_t>& m, GradAccum accum, uint32_t seed) {
            auto xh = random_bf16_host(seed, m, kK), dyh = random_bf16_host(seed + 1, m, kN);
            layer.forward(upload_bf16(b, xh, kK), m);
            layer.backward(upload_bf16(b, dyh, kN), accum);
            if (delay) layer.backward_dw();
          };
          const std::vector<bool> some_expected = {false, true, false, true};
          // Accumulating after zero_grad: empty experts keep zero slices.
          layer.param().zero_grad();
          step(some, GradAccum::kAccumulate, 7);
          EXPECT_EQ(nonzero_slices(layer.param()), some_expected);
          // Every expert gets tokens: every slice is reached.
          step(all, GradAccum::kAccumulate, 9);
          EXPECT_EQ(nonzero_slices(layer.param()), std::vector<bool>(kE, true));
          // Overwrite (first micro-batch of a step) over a dirty main_grad: empty experts get zeros.
          step(some, GradAccum::kOverwrite, 11);
          EXPECT_EQ(nonzero_slices(layer.param()), some_expected);
        }
}

TEST(GroupedLinear, BatchWithoutTokens) {
  Backend& b = cpu_backend();
  const std::vector<int64_t> none = {0, 0, 0, 0}, all = {32, 32, 32, 32};
  for (const RecipeCase& r : kRecipes) {
    SCOPED_TRACE(r.name);
    GroupedLinearConfig cfg;
    cfg.recipe = r.recipe;
    GroupedLinear layer(b, cfg, random_init(5));
    auto xh = random_bf16_host(1, all, kK), dyh = random_bf16_host(2, all, kN);
    layer.forward(upload_bf16(b, xh, kK), all);
    layer.backward(upload_bf16(b, dyh, kN), GradAccum::kOverwrite);
    const std::vector<uint8_t> before = layer.param().main_grad().download();
    std::vector<uint16_t> empty;
    const Tensor y = layer.forward(upload_bf16(b, empty, kK), none);
    EXPECT_EQ(y.shape(), (Shape{0, kN}));
    const Tensor dx = layer.backward(upload_bf16(b, empty, kN), GradAccum::kAccumulate);
    EXPECT_EQ(dx.shape(), (Shape{0, kK}));
    EXPECT_TRUE(layer.param().main_grad().download() == before) << "accumulating nothing changed it";
    layer.forward(upload_bf16(b, empty, kK), none);
    layer.backward(upload_bf16(b, empty, kN), GradAccum::kOverwrite);
    EXPECT_EQ(nonzero_slices(layer.param()), std::vector<bool>(kE, false));
  }
}

// ---- one step against FP64 on the dequantized operands -------------------------------------------

TEST(GroupedLinear, OneStepMatchesFp64OnDequantizedOperands) {
  constexpr double kTol = 1e-5;  // relative Frobenius, F32 outputs
  Backend& b = cpu_backend();
  const std::vector<int64_t> m = {64, 0, 32, 96};
  const int64_t rows = sum(m);
  for (const RecipeCase& r : kRecipes)
    for (PrimaryWeight p : kPrimaries)
      for (Layout l : kLayouts) {
        SCOPED_TRACE(label(r, p, l));
        GroupedLinearConfig cfg;
        cfg.recipe = r.recipe;
        cfg.primary = p;
        cfg.layout = l;
        cfg.out_dtype = DType::kF32;
        GroupedLinear layer(b, cfg, random_init(31));
        std::vector<uint16_t> xh = random_bf16_host(41, m, kK), dyh = random_bf16_host(42, m, kN);
        const uint64_t sr_offset = nvfp4_grad_sr_offset(2, 3);  // as a trainer sets it
        layer.set_grad_sr_offset(sr_offset);
        layer.param().zero_grad();
        const std::vector<float> y = floats_of(b, layer.forward(upload_bf16(b, xh, kK), m));
        const std::vector<float> dx =
            floats_of(b, layer.backward(upload_bf16(b, dyh, kN), GradAccum::kAccumulate));
        std::vector<float> dw(kE * kN * kK);
        const std::vector<uint8_t> g = layer.param().main_grad().download();
        std::memcpy(dw.data(), g.data(), g.size());

        const ActCopies xq = quantize_here(r.recipe, TensorRole::kInput, xh, m, kK, 0);
        const ActCopies dyq = quantize_here(r.recipe, TensorRole::kGradOutput, dyh, m, kN, sr_offset);
        const std::vector<int64_t> wrows(kE, kN);
        const auto w_row = dequantize_logical(layer.param().fprop_weight(), wrows, kK, false);
        const auto w_col = dequantize_logical(layer.param().dgrad_weight(), wrows, kK, true);
        const auto x_row = dequantize_logical(xq.row, m, kK, false);
        const auto x_col = dequantize_logical(xq.col, m, kK, true);
        const auto dy_row = dequantize_logical(dyq.row, m, kN, false);
        const auto dy_col = dequantize_logical(dyq.col, m, kN, true);

        std::vector<double> y_ref(rows * kN), dx_ref(rows * kK), dw_ref(kE * kN * kK, 0.0);
        int64_t t0 = 0;
        for (int64_t e = 0; e < kE; ++e) {
          for (int64_t t = 0; t < m[e]; ++t) {
            for (int64_t n = 0; n < kN; ++n) {
              double s = 0;
              for (int64_t k = 0; k < kK; ++k)
                s += double(x_row[e][t * kK + k]) * double(w_row[e][n * kK + k]);
              y_ref[(t0 + t) * kN + n] = s;
            }
            for (int64_t k = 0; k < kK; ++k) {
              double s = 0;
              for (int64_t n = 0; n < kN; ++n)
                s += double(dy_row[e][t * kN + n]) * double(w_col[e][n * kK + k]);
              dx_ref[(t0 + t) * kK + k] = s;
            }
          }
          for (int64_t n = 0; n < kN; ++n)
            for (int64_t k = 0; k < kK; ++k) {
              double s = 0;
              for (int64_t t = 0; t < m[e]; ++t)
                s += double(dy_col[e][t * kN + n]) * double(x_col[e][t * kK + k]);
              dw_ref[(e * kN + n) * kK + k] = s;
            }
          t0 += m[e];
        }
        EXPECT_LE(rel_frobenius(y, y_ref), kTol) << "y";
        EXPECT_LE(rel_frobenius(dx, dx_ref), kTol) << "dx";
        // The backward drew its blocks of 16 from the set offset on: the next call starts past them.
        EXPECT_EQ(layer.grad_sr_offset(), sr_offset + static_cast<uint64_t>(rows * kN / 16));
        EXPECT_LE(rel_frobenius(dw, dw_ref), kTol) << "main_grad";
      }
}

// ---- one quantize call per pack; the non-host-memory path ----------------------------------------

// Reports a CUDA device but keeps host memory and runs the CPU reference ops, so every path that
// depends on where memory lives (an init kept on the host, staged into the backend's memory; copy
// kinds) runs as it would on a GPU. Counts the quantize and optimizer calls.
class FakeDeviceBackend final : public Backend {
 public:
  int quantize_calls = 0;
  int adamw_calls = 0;
  Device device() const override { return Device::kCUDA; }
  void* allocate(size_t bytes) override { return cpu().allocate(bytes); }
  void deallocate(void* p) override { cpu().deallocate(p); }
  std::string name() const override { return "fake-device"; }
  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    cpu().copy(dst, src, bytes, kind);
  }
  void fill_zero(void* dst, size_t bytes) override { cpu().fill_zero(dst, bytes); }
  void synchronize() override {}
  double time_ms(const std::function<void()>& body, int warmup, int iters) override {
    return cpu().time_ms(body, warmup, iters);
  }
  // The CPU table, with the quantize and AdamW rows counting their calls.
  const OpKernels& kernels() const override {
    static const QuantizeKernels quantize = [] {
      QuantizeKernels q = *cpu().kernels().quantize;
      q.quantize_mxfp8 = [](Backend& b, const GroupedMatrices& in, const Mxfp8Config& cfg,
                            const Mxfp8Outputs& out) {
        ++static_cast<FakeDeviceBackend&>(b).quantize_calls;
        return cpu().kernels().quantize->quantize_mxfp8(cpu(), in, cfg, out);
      };
      q.quantize_nvfp4 = [](Backend& b, const GroupedMatrices& in, const Nvfp4Config& cfg,
                            const Nvfp4Outputs& out) {
        ++static_cast<FakeDeviceBackend&>(b).quantize_calls;
        return cpu().kernels().quantize->quantize_nvfp4(cpu(), in, cfg, out);
      };
      return q;
    }();
    static const ElementwiseKernels elementwise = [] {
      ElementwiseKernels e = *cpu().kernels().elementwise;
      e.adamw = [](Backend& b, const AdamWArgs& a) {
        ++static_cast<FakeDeviceBackend&>(b).adamw_calls;
        return cpu().kernels().elementwise->adamw(cpu(), a);
      };
      return e;
    }();
    static const OpKernels table = [] {
      OpKernels t = cpu().kernels();
      t.quantize = &quantize;
      t.elementwise = &elementwise;
      return t;
    }();
    return table;
  }

 private:
  static Backend& cpu() { return cpu_backend(); }
};

TEST(GroupedLinear, OneQuantizeCallPerPackAndDeviceMemoryPathMatchesCpu) {
  const std::vector<int64_t> m = {32, 0, 64, 32};
  for (const RecipeCase& r : kRecipes)
    for (PrimaryWeight p : kPrimaries)
      for (Layout l : kLayouts) {
        SCOPED_TRACE(label(r, p, l));
        const bool quantized = r.recipe.recipe != Recipe::kBF16;
        const bool high = p == PrimaryWeight::kHighPrecision;
        GroupedLinearConfig cfg;
        cfg.recipe = r.recipe;
        cfg.primary = p;
        cfg.layout = l;
        cfg.delay_wgrad = true;
        FakeDeviceBackend dev;
        Backend& cpu = cpu_backend();
        const Tensor init_host = random_init(51);
        const Tensor init_dev = dev.to_device(init_host);  // the init may live on the device too
        GroupedLinear on_dev(dev, cfg, init_dev);
        GroupedLinear on_cpu(cpu, cfg, init_host);
        EXPECT_EQ(dev.quantize_calls, quantized && !high ? 1 : 0) << "construction";
        const AdamWConfig adamw{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f};
        SingleRankOptimizer opt_dev(dev, {{&on_dev.param(), true}}, adamw);
        SingleRankOptimizer opt_cpu(cpu, {{&on_cpu.param(), true}}, adamw);

        for (int step = 0; step < 2; ++step) {
          SCOPED_TRACE("step " + std::to_string(step));
          auto xh = random_bf16_host(60 + step, m, kK), dyh = random_bf16_host(70 + step, m, kN);
          opt_dev->prepare_forward();
          opt_cpu->prepare_forward();
          dev.quantize_calls = 0;
          const Tensor y_dev = on_dev.forward(upload_bf16(dev, xh, kK), m);
          EXPECT_EQ(dev.quantize_calls, quantized ? (high ? 2 : 1) : 0) << "forward: weight + x";
          const Tensor y_cpu = on_cpu.forward(upload_bf16(cpu, xh, kK), m);
          EXPECT_TRUE(bytes_of(dev, y_dev) == bytes_of(cpu, y_cpu)) << "y";
          dev.quantize_calls = 0;
          opt_dev->prepare_backward();
          opt_cpu->prepare_backward();
          const Tensor dx_dev = on_dev.backward(upload_bf16(dev, dyh, kN), GradAccum::kOverwrite);
          EXPECT_EQ(dev.quantize_calls, quantized ? 1 : 0) << "backward: dy";
          const Tensor dx_cpu = on_cpu.backward(upload_bf16(cpu, dyh, kN), GradAccum::kOverwrite);
          EXPECT_TRUE(bytes_of(dev, dx_dev) == bytes_of(cpu, dx_cpu)) << "dx";
          on_dev.backward_dw();
          on_cpu.backward_dw();
          EXPECT_TRUE(on_dev.param().main_grad().download() == on_cpu.param().main_grad().download());
          dev.quantize_calls = 0;
          dev.adamw_calls = 0;
          opt_dev->step();
          opt_dev->prepare_forward();  // the gather writes the primary
          EXPECT_EQ(dev.quantize_calls, quantized && !high ? 1 : 0) << "requantize";
          EXPECT_EQ(dev.adamw_calls, 1) << "one optimizer call over all experts";
          opt_cpu->step();
          opt_cpu->prepare_forward();
          EXPECT_TRUE(opt_dev.master(0) == opt_cpu.master(0));
          const auto a = on_dev.param().weight_components(), c = on_cpu.param().weight_components();
          ASSERT_EQ(a.size(), c.size());
          for (size_t i = 0; i < a.size(); ++i)
            EXPECT_TRUE(a[i].storage->download() == c[i].storage->download()) << a[i].name;
        }
      }
}

// ---- AdamW ----------------------------------------------------------------------------------------

TEST(AdamW, UpdateFollowsTheDocumentedFormula) {
  // One element by hand, in FP64: with m = v = 0, step 1: m = (1-b1) g, v = (1-b2) g^2, and
  // p1 = p0 (1 - lr wd) - lr/(1-b1) * m / (sqrt(v)/sqrt(1-b2) + eps) = p0(1 - lr wd) - lr g/(|g| + eps').
  const AdamWConfig cfg{0.01f, 0.9f, 0.95f, 1e-8f, 0.1f};
  const AdamWStepScalars s = adamw_step_scalars(cfg, 1);
  float p = 0.5f, m = 0.0f, v = 0.0f;
  const float g = -0.25f;
  adamw_update(p, m, v, g, s);
  const double expected = 0.5 * (1 - 0.01 * 0.1) + 0.01;  // sign(g) = -1, |g| >> eps
  EXPECT_NEAR(p, expected, 1e-6);
  EXPECT_FLOAT_EQ(m, 0.1f * g);
}

}  // namespace
}  // namespace packmoe
