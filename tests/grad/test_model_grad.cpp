// The full Model (nn/model.h) against the FP64 reference of tests/common/reference_model.h on micro
// configs, CPU backend: forward losses (smooth and with the model's BF16 roundings); every
// parameter's main_grad against FP64 central differences of the reference loss with those
// roundings replayed as constants; loss_scale, gradient accumulation and single vs discrete layout
// (bitwise) in every recipe. Fresh seeds each run (printed on failure); tolerances derived and
// measured next to their constants.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/reference_model.h"
#include "core/codecs.h"
#include "nn/model.h"
#include "train/model_config.h"

namespace packmoe {
namespace {

using Grads = std::map<std::string, std::vector<float>>;  // main_grad by parameter name

constexpr int64_t kB = 2, kS = 8;
// Large enough that the aux loss's gradient is a visible part of the router's (dropping the aux
// backward moves dW_router by >= 0.17 of its max over the seeds measured, 2.7x kGradTol), small
// enough not to swamp the LM loss.
constexpr double kAuxCoef = 0.2;
// Central differences err by h^2/6 |L'''| ~ 1e-9 (O(1) third derivatives for O(1) weights) plus
// eps64 |L| / h ~ 1e-11: far below every tolerance here.
constexpr double kStep = 1e-4;
// The top-k boundary gap every MoE token keeps (cases are redrawn until it holds). The model's
// router logits (RMS ~2) differ from the FP64 ones by the BF16 roundings of every earlier layer:
// measured <= 0.05 (max over all logits, 64 cases). A choice changes only if the two boundary
// logits move apart by the whole gap, and an FD step moves a logit by < 1e-3: model, reference
// and every perturbation select the same experts.
constexpr double kMinGap = 0.2;
// Elements checked per tensor (per expert for packed experts): all when there are at most
// kCheckAll, otherwise kRandom random ones plus the kLargest with the largest |analytic|.
constexpr size_t kCheckAll = 64, kRandom = 24, kLargest = 8;

// A fresh seed per run; PACKMOE_TEST_SEED=<seed> replays a printed one.
uint32_t fresh_seed() {
  const char* fixed = std::getenv("PACKMOE_TEST_SEED");
  return fixed ? static_cast<uint32_t>(std::stoul(fixed)) : std::random_device{}();
}

// The micro configs: V = 32, D = 16, Hq = 4, Hkv = 2, E = 4, k = 2 with renormalised top-k, three
// layers with layer 1 dense (I = 48), so both MLP kinds and a MoE layer fed by another are covered.
ModelConfig micro_config(int64_t hidden, int64_t ffn, bool tied) {
  ModelConfig c;
  c.vocab_size = 32;
  c.hidden_size = hidden;
  c.intermediate_size = 48;
  c.moe_intermediate_size = ffn;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 64;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = tied;
  c.num_experts_per_tok = 2;
  c.num_experts = 4;
  c.norm_topk_prob = true;
  c.router_aux_loss_coef = kAuxCoef;
  c.mlp_only_layers = {1};
  return c;
}

// Weights in a sane range, every value BF16-representable (so the BF16 copies the GEMMs read equal
// the masters and the only differences left are activation roundings): linears N(0, 1 / fan_in)
// (unit-size outputs), the router 2x that (logits ~ N(0, 4): a peaked but not saturated softmax),
// the embedding N(0, 0.25^2) (tied: LM logits ~ N(0, H / 16)), norms 1 + N(0, 0.25^2) so that
// their gradients are not those of the identity.
ModelWeights draw_weights(const ModelConfig& c, std::mt19937& rng) {
  ModelWeights w;
  for (const ParamSpec& spec : model_param_specs(c)) {
    double mean = 0, stddev = 1.0 / std::sqrt(static_cast<double>(spec.shape.back()));
    if (spec.init == ParamInit::kOnes) {
      mean = 1.0;
      stddev = 0.25;
    } else if (spec.name == "model.embed_tokens.weight") {
      stddev = 0.25;
    } else if (spec.name.ends_with("mlp.gate.weight")) {
      stddev *= 2.0;
    }
    std::normal_distribution<double> dist(mean, stddev);
    Tensor t = Tensor::empty(cpu_backend(), DType::kF32, spec.shape);
    for (int64_t i = 0; i < t.numel(); ++i)
      t.data_as<float>()[i] = bf16_to_f32(f32_to_bf16(static_cast<float>(dist(rng))));
    w.emplace(spec.name, std::move(t));
  }
  return w;
}

// B rows of S + 1 random tokens: inputs the first S, targets the next token, the last position of
// each row and 3 more random positions ignored (-100).
Batch draw_batch(const ModelConfig& c, std::mt19937& rng) {
  Batch b{kB, kS, std::vector<int32_t>(kB * kS), std::vector<int32_t>(kB * kS), {}, {}};
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(c.vocab_size - 1));
  for (int64_t r = 0; r < kB; ++r) {
    int32_t next = token(rng);
    for (int64_t s = 0; s < kS; ++s) {
      b.inputs[r * kS + s] = next;
      next = token(rng);
      b.targets[r * kS + s] = s + 1 < kS ? next : -100;
    }
  }
  std::uniform_int_distribution<int64_t> pos(0, kB * kS - 1);
  for (int i = 0; i < 3; ++i) b.targets[pos(rng)] = -100;
  return b;
}

struct Case {
  ModelConfig config;
  ModelWeights weights;
  Batch batch;
  reference::Losses ref;
  int draws = 0;
};

// Weights and a batch whose every MoE token keeps a top-k gap of kMinGap in the FP64 model
// (redrawn from the same stream until it does: each of the 32 MoE tokens misses with p ~ 0.13,
// so about 1 draw in 80 qualifies, a fraction of a second).
Case draw_case(const ModelConfig& c, std::mt19937& rng) {
  Case k{c, {}, {}, {}, 0};
  do {
    k.weights = draw_weights(c, rng);
    k.batch = draw_batch(c, rng);
    k.ref = reference::forward(c, reference::widen(k.weights), k.batch);
    ++k.draws;
  } while (k.ref.min_gap < kMinGap && k.draws < 1000);
  EXPECT_GE(k.ref.min_gap, kMinGap) << "no draw kept the top-k gap";
  return k;
}

ModelPrecision precision(Recipe recipe, Layout layout) {
  ModelPrecision p;
  p.recipe = {recipe, false, 7};
  p.layout = layout;
  return p;
}

ForwardLosses step(Model& m, const Batch& b, float loss_scale) {
  Result<ForwardLosses> l = m.forward(b, loss_scale);
  EXPECT_TRUE(l.is_ok()) << l.status().message();
  m.backward();
  return l.value();
}

Grads main_grads(const Model& m) {
  Grads out;
  for (const NamedParam& p : m.params()) {
    const std::vector<uint8_t> bytes = p.param->main_grad().download();
    std::vector<float> g(bytes.size() / sizeof(float));
    std::memcpy(g.data(), bytes.data(), bytes.size());
    out.emplace(p.name, std::move(g));
  }
  return out;
}

// ---- forward and backward against the FP64 reference --------------------------------------------

// Forward tolerances, relative to the FP64 value. The model rounds to BF16 (2^-9 relative) every
// activation operand of a GEMM and the MoE's FC1 / FC2 outputs (the weights are BF16-exact):
// about a dozen roundings on the way to the logits, averaging over sums of 16-64 terms; a logit
// error moves the mean cross-entropy by about its own size (|p - onehot| <= 1). Measured over 500
// cases: lm_loss <= 1.9e-3, aux <= 1.1e-3 relative; 2^-7 leaves 4x.
constexpr double kLmLossTol = 1.0 / 128, kAuxTol = 1.0 / 128;
// Against the reference with those roundings recorded, only FP32 arithmetic differs (~1e-7), plus
// the rare value whose FP32 and FP64 versions round to neighbouring BF16 numbers (one BF16 ulp,
// whose effect then propagates). Measured: median 5e-8, max 3.9e-4 (lm), 2.0e-4 (aux); 2^-10
// leaves 2.5x and is 8x tighter than the smooth comparison.
constexpr double kReplayedLossTol = 1.0 / 1024;

// Gradient tolerance, max |analytic - fd| <= kGradTol * max |fd| per tensor, fd from the reference
// with the model's forward roundings replayed (Replayed below): what is left are the backward's
// BF16 roundings (dlogits; the gradient operand of every dgrad GEMM; the MoE's dgrads), 2^-9 each,
// about a dozen on the way to layer 0, amplified where a gradient is a sum of cancelling terms
// (norm weights, q/k through the softmax, the router). Measured over 620 cases (21700 tensors):
// median 3.0e-3, p99 9.5e-3, p99.9 1.5e-2, max 2.5e-2 (q/k norm weights, routers, layer-0 k_proj);
// 2^-4 leaves 2.5x, while a missing or wrong term is O(0.1) or more (injected: dropping the aux
// backward errs by 0.08-0.15 on layer 0's tensors, the forward RoPE in q's backward by 1.6, losing
// the router's dx fails most tensors). Without the replay (the smooth reference) the same
// gradients differ by up to 0.12: the forward's roundings move the point at which the model
// differentiates, and the softmaxes amplify that in some draws.
constexpr double kGradTol = 1.0 / 16;

// Indices into g[begin, end) to check: everything when small, else random ones plus the largest.
std::vector<size_t> pick(const std::vector<float>& g, size_t begin, size_t end, std::mt19937& rng) {
  std::vector<size_t> idx(end - begin);
  std::iota(idx.begin(), idx.end(), begin);
  if (idx.size() <= kCheckAll) return idx;
  std::partial_sort(idx.begin(), idx.begin() + kLargest, idx.end(),
                    [&](size_t a, size_t b) { return std::fabs(g[a]) > std::fabs(g[b]); });
  std::shuffle(idx.begin() + kLargest, idx.end(), rng);
  idx.resize(kLargest + kRandom);
  return idx;
}

// The reference at the test's point with the model's BF16 roundings replayed (Bf16Rounding):
// perturbing w gives FP64 central differences of a loss that is smooth in w.
struct Replayed {
  const Case& k;
  reference::Weights64 w;
  reference::Bf16Rounding bf16;
  reference::Losses base;  // the recording forward

  explicit Replayed(const Case& c) : k(c), w(reference::widen(c.weights)) {
    bf16.record();
    base = reference::forward(k.config, w, k.batch, &bf16);
    bf16.replay();
  }

  // d total / d w[name][i].
  double central_difference(const std::string& name, size_t i) {
    std::vector<double>& v = w.at(name);
    const double v0 = v[i];
    v[i] = v0 + kStep;
    const reference::Losses up = reference::forward(k.config, w, k.batch, &bf16);
    v[i] = v0 - kStep;
    const reference::Losses down = reference::forward(k.config, w, k.batch, &bf16);
    v[i] = v0;
    EXPECT_TRUE(up.chosen == base.chosen && down.chosen == base.chosen)
        << name << "[" << i << "]: a perturbation changed a top-k choice";
    return (up.total - down.total) / (2 * kStep);
  }
};

// Checks the main_grad g of parameter p against central differences on picked elements (picked per
// expert for packed experts; an expert that received no tokens must have exactly no gradient).
// Returns max |analytic - fd| / max |fd| over the tensor and prints it.
double check_tensor(Replayed& ref, const NamedParam& p, const std::vector<float>& g,
                    const std::vector<int64_t>* tokens_per_expert, std::mt19937& rng) {
  const int64_t experts = p.param->experts();
  const size_t per = g.size() / experts;
  std::vector<size_t> idx;
  for (int64_t e = 0; e < experts; ++e) {
    const size_t begin = e * per, end = begin + per;
    if (tokens_per_expert && (*tokens_per_expert)[e] == 0) {
      EXPECT_TRUE(std::all_of(g.begin() + begin, g.begin() + end, [](float v) { return v == 0; }))
          << p.name << ": expert " << e << " received no tokens but has a gradient";
      continue;
    }
    const std::vector<size_t> picked = pick(g, begin, end, rng);
    idx.insert(idx.end(), picked.begin(), picked.end());
  }
  double max_err = 0, max_fd = 0, worst_fd = 0;
  size_t worst = 0;
  for (size_t i : idx) {
    const double fd = ref.central_difference(p.name, i);
    const double err = std::fabs(g[i] - fd);
    if (err > max_err) {
      max_err = err;
      worst = i;
      worst_fd = fd;
    }
    max_fd = std::max(max_fd, std::fabs(fd));
  }
  EXPECT_GT(max_fd, 0.0) << p.name << ": the loss does not depend on it";
  const double rel = max_err / max_fd;
  const std::string where =
      experts > 1 ? " of expert " + std::to_string(worst / per) : std::string();
  EXPECT_LE(rel, kGradTol) << p.name << ": max |analytic - fd| = " << max_err << " at element "
                           << worst << where << " (analytic " << g[worst] << ", fd " << worst_fd
                           << "), max |fd| = " << max_fd << " over " << idx.size() << " elements";
  std::printf("  %-46s max|a-fd|/max|fd| = %.2e  (%3zu elements, max|fd| %.2e)\n",
              p.name.c_str(), rel, idx.size(), max_fd);
  return rel;
}

// Tokens routed to each expert of every MoE layer, by layer index, from the reference's choices.
std::map<int64_t, std::vector<int64_t>> expert_counts(const Case& k) {
  std::map<int64_t, std::vector<int64_t>> out;
  size_t moe = 0;
  for (int64_t layer = 0; layer < k.config.num_hidden_layers; ++layer) {
    if (!k.config.is_moe_layer(layer)) continue;
    std::vector<int64_t>& n = out[layer];
    n.assign(k.config.num_experts, 0);
    for (int32_t e : k.ref.chosen.at(moe++)) ++n[e];
  }
  return out;
}

class ModelGrad : public testing::TestWithParam<bool> {};  // tie_word_embeddings

TEST_P(ModelGrad, ForwardAndEveryGradientMatchFp64Reference) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const ModelConfig config = micro_config(32, 16, GetParam());
  ASSERT_TRUE(train::validate(config).is_ok()) << train::validate(config).message();
  const Case k = draw_case(config, rng);
  SCOPED_TRACE("draws " + std::to_string(k.draws) + ", min top-k gap " +
               std::to_string(k.ref.min_gap));

  Model model(cpu_backend(), config, precision(Recipe::kBF16, Layout::kSingle), k.weights);
  model.zero_grad();
  const ForwardLosses l = step(model, k.batch, 1.0f);
  EXPECT_EQ(l.target_tokens, std::count_if(k.batch.targets.begin(), k.batch.targets.end(),
                                            [](int32_t t) { return t != -100; }));
  EXPECT_NEAR(l.lm_loss, k.ref.lm, kLmLossTol * k.ref.lm) << "lm_loss";
  EXPECT_NEAR(l.aux_loss, k.ref.aux, kAuxTol * k.ref.aux) << "aux_loss";
  std::printf("lm_loss %.6f (FP64 %.6f, rel %.2e), aux %.6f (FP64 %.6f, rel %.2e)\n", l.lm_loss,
              k.ref.lm, std::fabs(l.lm_loss - k.ref.lm) / k.ref.lm, l.aux_loss, k.ref.aux,
              std::fabs(l.aux_loss - k.ref.aux) / k.ref.aux);

  // Every param holds the init's FP32 bytes (what the optimizer's master is made from), so the
  // reference and the model differentiate the same point.
  ASSERT_EQ(model.params().size(), k.weights.size());
  for (const NamedParam& p : model.params()) {
    const std::vector<uint8_t> held = p.param->fp32_weight().download();
    const Tensor& t = k.weights.at(p.name);
    ASSERT_EQ(held.size(), t.nbytes()) << p.name;
    ASSERT_EQ(std::memcmp(held.data(), t.data(), t.nbytes()), 0) << p.name;
  }

  const Grads grads = main_grads(model);
  ASSERT_EQ(grads.size(), model_param_specs(config).size());
  const auto counts = expert_counts(k);
  Replayed ref(k);
  ASSERT_EQ(ref.base.chosen, k.ref.chosen) << "the BF16 roundings changed a top-k choice";
  EXPECT_NEAR(l.lm_loss, ref.base.lm, kReplayedLossTol * ref.base.lm) << "lm_loss vs replayed";
  EXPECT_NEAR(l.aux_loss, ref.base.aux, kReplayedLossTol * ref.base.aux) << "aux vs replayed";
  std::printf("with the model's BF16 roundings: lm_loss %.7f (rel %.2e), aux %.7f (rel %.2e)\n",
              ref.base.lm, std::fabs(l.lm_loss - ref.base.lm) / ref.base.lm, ref.base.aux,
              std::fabs(l.aux_loss - ref.base.aux) / ref.base.aux);
  double worst = 0;
  for (const NamedParam& p : model.params()) {
    const std::vector<float>& g = grads.at(p.name);
    ASSERT_EQ(static_cast<int64_t>(g.size()), k.weights.at(p.name).numel()) << p.name;
    const std::vector<int64_t>* tokens = nullptr;
    if (p.param->experts() > 1)
      tokens = &counts.at(std::stoll(p.name.substr(std::string("model.layers.").size())));
    worst = std::max(worst, check_tensor(ref, p, g, tokens, rng));
  }
  std::printf("worst max|a-fd|/max|fd| over every tensor: %.2e (tol %.2e)\n", worst, kGradTol);
}

INSTANTIATE_TEST_SUITE_P(Tied, ModelGrad, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& i) {
                           return std::string(i.param ? "tied" : "untied");
                         });

// ---- loss_scale, accumulation and layouts, in every recipe --------------------------------------

// Bitwise comparison of two gradient sets; `scale` multiplies `want` first (exact for 2^n).
void expect_bitwise(const Grads& got, const Grads& want, float scale, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, w] : want) {
    const std::vector<float>& g = got.at(name);
    ASSERT_EQ(g.size(), w.size()) << what << " " << name;
    for (size_t i = 0; i < w.size(); ++i) {
      const float expected = w[i] * scale;
      if (std::memcmp(&g[i], &expected, sizeof(float)) != 0) {
        ADD_FAILURE() << what << ": " << name << "[" << i << "] = " << g[i] << ", expected "
                      << expected << " (first differing element)";
        break;
      }
    }
  }
}

void expect_same_losses(const ForwardLosses& got, const ForwardLosses& want, const char* what) {
  EXPECT_EQ(std::memcmp(&got.lm_loss, &want.lm_loss, sizeof(float)), 0)
      << what << ": lm_loss " << got.lm_loss << " vs " << want.lm_loss;
  EXPECT_EQ(std::memcmp(&got.aux_loss, &want.aux_loss, sizeof(float)), 0)
      << what << ": aux_loss " << got.aux_loss << " vs " << want.aux_loss;
}

// Accumulated gradients vs the sum of the separate ones. Both runs see the same BF16 (or
// quantized) operands; only FP32 summation differs (the wgrad GEMM may add into main_grad inside
// its sum): <= (K + 1) 2^-24 sum |terms| with K <= 64 terms. Measured over 300 runs: <= 1.2e-7 of
// the tensor's max |g1| + |g2| (two FP32 ulps); 2^-18 leaves 30x for cancellation, while a lost
// or doubled micro-batch errs by O(1) of it.
constexpr double kAccumTol = 1.0 / 262144;

void expect_sum(const Grads& acc, const Grads& g1, const Grads& g2) {
  double worst = 0;
  for (const auto& [name, a] : acc) {
    const std::vector<float>&x = g1.at(name), &y = g2.at(name);
    double max_err = 0, scale = 0;
    size_t at = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double err = std::fabs(double(a[i]) - (double(x[i]) + double(y[i])));
      if (err > max_err) {
        max_err = err;
        at = i;
      }
      scale = std::max(scale, std::fabs(double(x[i])) + std::fabs(double(y[i])));
    }
    EXPECT_LE(max_err, kAccumTol * scale) << name << "[" << at << "]: accumulated " << a[at]
                                          << ", separate " << x[at] << " + " << y[at];
    worst = std::max(worst, max_err / scale);
  }
  std::printf("accumulated vs sum of separate: max error / max(|g1| + |g2|) = %.2e (tol %.2e)\n",
              worst, kAccumTol);
}

// lm_loss tolerance of each recipe vs the smooth FP64 model (relative). Only the experts are
// quantized: MXFP8's E4M3 keeps 3 mantissa bits (up to 2^-4 relative per element), NVFP4's E2M1
// 1 bit under 16-element scales (up to ~1/6); expert outputs are one part of the residual stream
// and the errors average over sums, but they also move layer 2's router logits. Measured over
// 130 runs: MXFP8 median 2.6e-3, max 1.3e-2; NVFP4 median 1.0e-2, max 3.5e-2 (BF16 on this config
// 1.2e-3). 2^-5 and 2^-3 leave 2.5x and 3.5x; a lost expert path or wrong dequantization scale
// moves the loss by far more.
double loss_tol(Recipe r) {
  switch (r) {
    case Recipe::kBF16: return kLmLossTol;
    case Recipe::kMxfp8: return 1.0 / 32;
    case Recipe::kNvfp4: return 1.0 / 8;
  }
  return 0;
}

class ModelRecipe : public testing::TestWithParam<Recipe> {};

// H = 64, F = 32: multiples of the MXFP8 block (32) and NVFP4 tiles (16).
TEST_P(ModelRecipe, LossScaleAccumulationAndLayoutsBitwise) {
  const Recipe recipe = GetParam();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const ModelConfig config = micro_config(64, 32, false);
  ASSERT_TRUE(train::validate(config).is_ok()) << train::validate(config).message();
  const Case k = draw_case(config, rng);
  const Batch b2 = draw_batch(config, rng);
  auto make = [&](Layout layout) {
    auto m = std::make_unique<Model>(cpu_backend(), config, precision(recipe, layout), k.weights);
    m->zero_grad();
    return m;
  };

  // Micro-batch 1, then 2 accumulated, in each layout.
  auto single = make(Layout::kSingle), discrete = make(Layout::kDiscrete);
  const ForwardLosses l1 = step(*single, k.batch, 1.0f);
  expect_same_losses(step(*discrete, k.batch, 1.0f), l1, "micro-batch 1");
  const Grads g1 = main_grads(*single);
  expect_bitwise(main_grads(*discrete), g1, 1.0f, "discrete vs single, one micro-batch");
  expect_same_losses(step(*discrete, b2, 1.0f), step(*single, b2, 1.0f), "micro-batch 2");
  const Grads acc = main_grads(*single);
  expect_bitwise(main_grads(*discrete), acc, 1.0f, "discrete vs single, accumulated");

  // The same two micro-batches with zero_grad between (same call sequence, so NVFP4's stochastic
  // rounding draws the same bits): the accumulated gradient is their sum.
  auto separate = make(Layout::kSingle);
  step(*separate, k.batch, 1.0f);
  separate->zero_grad();
  step(*separate, b2, 1.0f);
  expect_sum(acc, g1, main_grads(*separate));

  // loss_scale 0.5: a power of two scales dlogits, daux and every later value exactly (quantizer
  // scales are powers of two or ratios of amaxes that scale with it), so the gradients are
  // bitwise half.
  auto half = make(Layout::kSingle);
  step(*half, k.batch, 0.5f);
  expect_bitwise(main_grads(*half), g1, 0.5f, "loss_scale 0.5 vs 1");

  const double rel = std::fabs(l1.lm_loss - k.ref.lm) / k.ref.lm;
  EXPECT_LE(rel, loss_tol(recipe)) << "lm_loss " << l1.lm_loss << ", FP64 " << k.ref.lm;
  std::printf("%s: lm_loss %.6f, FP64 %.6f, rel %.2e (tol %.2e); aux %.6f, FP64 %.6f\n",
              recipe_name(recipe), l1.lm_loss, k.ref.lm, rel, loss_tol(recipe),
              l1.aux_loss, k.ref.aux);
}

INSTANTIATE_TEST_SUITE_P(Recipes, ModelRecipe,
                         testing::Values(Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4),
                         [](const testing::TestParamInfo<Recipe>& i) {
                           return std::string(recipe_name(i.param));
                         });

}  // namespace
}  // namespace packmoe
