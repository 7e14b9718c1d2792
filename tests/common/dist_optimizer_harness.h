// Harness of the distributed-optimizer tests (tests/common/dist_optimizer_checks.h, run by
// tests/dist/test_dist_optimizer.cpp on the CPU and test_nccl_dist_optimizer.cpp on GPUs, and
// tests/dist/test_reshard.cpp): a MoEBlock per rank trained by DistOptimizer, and the reference,
// one process accumulating every rank's micro-batch under the same optimizer over one rank (a
// 1-rank communicator of its own: the whole of every master). Micro-batch (step s, index i) is
// regenerated anywhere from (seed, s, i). The reference runs micro-batch i in its own copy of the
// block (same weights, kept equal after every step) so its NVFP4 stochastic-rounding stream is
// rank i's, and sums the gradients into copy 0 in index order, ((0 + g_0) + g_1) + ..., the bits
// one block accumulating them would produce.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/device_buffer.h"
#include "common/dist_main.h"
#include "common/single_rank_optimizer.h"
#include "core/codecs.h"
#include "dist/dist_optimizer.h"
#include "nn/moe_block.h"

namespace packmoe::dist_checks {

using dist_test::comm;
using dist_test::download;
using dist_test::g_seed;
using dist_test::run_all;
using dist_test::upload;

// T tokens, H hidden, F expert width, E experts: FC1 (E, 2F, H), FC2 (E, H, F), router (1, E, H).
// With E = 3 the shard cuts of 2 and 3 ranks fall inside experts (docs/dist.md lists them).
inline constexpr int64_t kT = 64, kH = 64, kF = 32, kE = 3;
inline constexpr int64_t kBucketElems = 5000;  // three buckets: FC2, FC1, router
inline const AdamWConfig kAdamW{/*lr=*/1e-2f, 0.9f, 0.999f, 1e-8f, /*weight_decay=*/0.1f};

struct Case {
  const char* name;
  QuantRecipe recipe;
  PrimaryWeight primary;
  Layout layout;
};

// Every recipe, both primary-weight kinds and both layouts appear.
inline const Case kCases[] = {
    {"bf16", {Recipe::kBF16, false, 21}, PrimaryWeight::kHighPrecision, Layout::kSingle},
    {"mxfp8", {Recipe::kMxfp8, false, 21}, PrimaryWeight::kLowPrecision, Layout::kDiscrete},
    {"mxfp8_2d", {Recipe::kMxfp8, true, 21}, PrimaryWeight::kLowPrecision, Layout::kSingle},
    {"nvfp4", {Recipe::kNvfp4, false, 21}, PrimaryWeight::kLowPrecision, Layout::kDiscrete},
    {"nvfp4_highprec", {Recipe::kNvfp4, false, 21}, PrimaryWeight::kHighPrecision, Layout::kSingle},
};
inline constexpr GatherMode kModes[] = {GatherMode::kBf16, GatherMode::kLowp,
                                        GatherMode::kReuseGradBuffer};

inline std::string label(const Case& c, GatherMode m) {
  return std::string(c.name) + " / " + std::string(gather_mode_name(m));
}

inline MoEBlockConfig block_config(const Case& c) {
  MoEBlockConfig cfg;
  cfg.top_k = 2;
  cfg.norm_topk_prob = true;
  cfg.aux_loss_coef = 1e-2f;
  cfg.recipe = c.recipe;
  cfg.primary = c.primary;
  cfg.layout = c.layout;
  return cfg;
}

inline std::mt19937_64 rng_for(uint64_t seed, uint64_t a, uint64_t b, uint64_t salt) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(a), static_cast<uint32_t>(b),
                    static_cast<uint32_t>(salt)};
  return std::mt19937_64(seq);
}

// Full-mantissa F32 values; each expert (and each 16-row band) has its own scale, so NVFP4's
// per-expert amax and the tile scales differ across every shard cut.
inline Tensor random_weight(std::mt19937_64& rng, Shape shape, float stddev) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_real_distribution<float> band(0.25f, 2.0f);
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, shape);
  const int64_t row = shape.back();
  float scale = 1.0f;
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (i % (16 * row) == 0) scale = band(rng);
    t.data_as<float>()[i] = dist(rng) * stddev * scale;
  }
  return t;
}

inline MoEBlockInit make_init(uint64_t seed) {
  std::mt19937_64 rng = rng_for(seed, 0, 0, 1);
  return {random_weight(rng, {kE, kH}, 0.1f), random_weight(rng, {kE, 2 * kF, kH}, 0.1f),
          random_weight(rng, {kE, kH, kF}, 0.1f)};
}

// Micro-batch (s, i): x (T, H) BF16 of N(0, 1); dy (T, H) F32 of N(0, 1) * loss_scale / T (the
// gradient of a mean over tokens, so gradients are small next to the weights, as in training).
inline Tensor micro_x(Backend& b, uint64_t seed, int s, int i, uint64_t salt = 2) {
  std::mt19937_64 rng = rng_for(seed, s, i, salt);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Tensor h = Tensor::empty(cpu_backend(), DType::kBF16, {kT, kH});
  for (int64_t j = 0; j < h.numel(); ++j) h.data_as<uint16_t>()[j] = f32_to_bf16(dist(rng));
  return b.to_device(h);
}

inline Tensor micro_dy(Backend& b, uint64_t seed, int s, int i, float loss_scale) {
  std::mt19937_64 rng = rng_for(seed, s, i, 3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Tensor h = Tensor::empty(cpu_backend(), DType::kF32, {kT, kH});
  for (int64_t j = 0; j < h.numel(); ++j)
    h.data_as<float>()[j] = dist(rng) * loss_scale / static_cast<float>(kT);
  return b.to_device(h);
}

inline std::vector<uint8_t> bytes_of(Backend& b, const Tensor& t) {
  std::vector<uint8_t> h(t.nbytes());
  if (!h.empty()) b.copy(h.data(), t.data(), h.size(), Backend::CopyKind::kDeviceToHost);
  return h;
}

inline std::vector<float> floats_of(const GroupedStorage& s) {
  const std::vector<uint8_t> b = s.download();
  std::vector<float> f(b.size() / sizeof(float));
  std::memcpy(f.data(), b.data(), b.size());
  return f;
}

// Every weight component (the primary, and a high-precision primary's current compute copies).
inline std::vector<std::vector<uint8_t>> primaries(MoEBlock& block) {
  std::vector<std::vector<uint8_t>> out;
  for (GroupedParam* p : block.params())
    for (const NamedStorage& s : p->weight_components()) out.push_back(s.storage->download());
  return out;
}

// ---- the reference: one process, every micro-batch, one rank ---------------------------------

struct RefStep {
  double norm = 0;
  float clip = 1;
  std::vector<std::vector<uint8_t>> y;  // per micro-batch index
};

// The primary weight of `p` from an FP32 master (E*N*K, host), as the optimizer's BF16 gather
// writes it: bf16 (RNE), then the recipe's quantization over the pack.
inline void write_primary_from_master(GroupedParam& p, const std::vector<float>& master) {
  Backend& b = p.backend();
  const int64_t per_expert = p.n() * p.k();
  GroupedStorage f32(b, Layout::kSingle, p.experts(), per_expert * sizeof(float));
  b.copy(f32.packed(), master.data(), master.size() * sizeof(float),
         Backend::CopyKind::kHostToDevice);
  GroupedStorage bf16(b, p.layout(), p.experts(), per_expert * 2);
  cast_f32_to_bf16(f32, bf16);
  p.write_primary_from_bf16(bf16);
}

class Reference {
 public:
  Reference(Backend& b, const Case& c, const MoEBlockInit& init, int micro)
      : b_(b), micro_(micro) {
    for (int i = 0; i < micro; ++i)
      blocks_.push_back(std::make_unique<MoEBlock>(b, block_config(c), init));
    opt_ = std::make_unique<SingleRankOptimizer>(b, decayed_params(blocks_[0]->params()), kAdamW);
  }

  MoEBlock& block() { return *blocks_[0]; }

  // Block 0's masters as an init (F32 host tensors): a fresh reference that continues from here.
  MoEBlockInit masters_as_init() {
    auto host = [&](int p, Shape shape) {
      Tensor t = Tensor::empty(cpu_backend(), DType::kF32, std::move(shape));
      const std::vector<float> m = master(p);
      std::memcpy(t.data(), m.data(), m.size() * sizeof(float));
      return t;
    };
    return {host(0, {kE, kH}), host(1, {kE, 2 * kF, kH}), host(2, {kE, kH, kF})};
  }
  // The optimizer state (masters, moments, step count) of `from` (same parameters).
  void take_optimizer_state(Reference& from) {
    const Status s = (*opt_)->load_state((*from.opt_)->gather_state());
    PACKMOE_CHECK(s.is_ok(), s.message());
  }

  RefStep step(uint64_t seed, int s, double max_norm) {
    RefStep out;
    const float scale = 1.0f / static_cast<float>(micro_);
    DistOptimizer& opt = **opt_;
    opt.prepare_forward();  // block 0's gather; its gradients zeroed
    opt.prepare_backward();
    for (int i = 0; i < micro_; ++i) {
      MoEBlock& blk = *blocks_[i];
      if (i > 0) blk.zero_grad();
      out.y.push_back(bytes_of(b_, blk.forward(micro_x(b_, seed, s, i))));
      blk.backward(micro_dy(b_, seed, s, i, scale), GradAccum::kAccumulate, scale);
    }
    grads_.clear();
    for (size_t p = 0; p < blocks_[0]->params().size(); ++p) {
      for (int i = 1; i < micro_; ++i)
        add_f32(blocks_[0]->params()[p]->main_grad(), blocks_[i]->params()[p]->main_grad());
      grads_.push_back(floats_of(blocks_[0]->params()[p]->main_grad()));
    }
    const DistStepResult r = opt.step(max_norm);
    PACKMOE_CHECK(r.applied, "reference step not applied");
    out.norm = r.grad_norm;
    out.clip = r.clip_scale;
    const FullOptimizerState state = opt.gather_state();
    for (int i = 1; i < micro_; ++i)
      for (size_t p = 0; p < blocks_[0]->params().size(); ++p)
        write_primary_from_master(*blocks_[i]->params()[p], state.master[p]);
    opt.prepare_forward();  // block 0's primaries current, for comparisons
    return out;
  }

  // Parameter p's summed gradient (of the last step) and master, (E*N*K) F32.
  std::vector<float> grad(int p) { return grads_.at(p); }
  std::vector<float> master(int p) { return opt_->master(p); }

 private:
  Backend& b_;
  int micro_;
  std::vector<std::unique_ptr<MoEBlock>> blocks_;
  std::unique_ptr<SingleRankOptimizer> opt_;
  std::vector<std::vector<float>> grads_;  // the last step's summed gradients
};

// ---- a rank's block under DistOptimizer ------------------------------------------------------

inline std::vector<DistParam> dist_params(MoEBlock& block) {
  return decayed_params(block.params());
}

struct DistStep {
  DistStepResult r;
  std::vector<uint8_t> y;
};

class DistRun {
 public:
  DistRun(const Case& c, const MoEBlockInit& init, GatherMode mode)
      : block_(comm().backend(), block_config(c), init),
        opt_(comm(), dist_params(block_), {kAdamW, mode, kBucketElems}) {}

  MoEBlock& block() { return block_; }
  DistOptimizer& opt() { return opt_; }
  Backend& backend() { return comm().backend(); }

  // Forward and backward of micro-batch (s, rank), without the optimizer step.
  std::vector<uint8_t> forward_backward(uint64_t seed, int s) {
    opt_.prepare_forward();
    const Tensor y = block_.forward(micro_x(backend(), seed, s, comm().rank()));
    opt_.prepare_backward();
    block_.backward(micro_dy(backend(), seed, s, comm().rank(), opt_.loss_scale(1)),
                    GradAccum::kAccumulate, opt_.loss_scale(1));
    return bytes_of(backend(), y);
  }

  DistStep train_step(uint64_t seed, int s, double max_norm) {
    DistStep out;
    out.y = forward_backward(seed, s);
    out.r = opt_.step(max_norm);
    return out;
  }

  // A forward outside training (eval): the parameter sync, then the forward.
  std::vector<uint8_t> eval(uint64_t seed, int s) {
    opt_.prepare_forward();
    return bytes_of(backend(), block_.forward(micro_x(backend(), seed, s, comm().rank(), 9)));
  }

 private:
  MoEBlock block_;
  DistOptimizer opt_;
};

// Per piece of this rank's shard: `dist` (the shard, indexed from its begin) against the
// reference's values of that parameter. Returns the largest |difference|; with `bitwise`, every
// element must have the same bits.
template <typename RefFn>
double compare_shard(const DistOptimizer& opt, const std::vector<float>& dist, RefFn ref_values,
                     bool bitwise, const std::string& what) {
  double worst = 0;
  std::vector<std::vector<float>> ref(opt.plan().params());
  for (const ShardPiece& piece : opt.plan().pieces(comm().rank())) {
    if (ref[piece.param].empty()) ref[piece.param] = ref_values(piece.param);
    const float* d = dist.data() + (piece.offset - opt.shard().begin);
    const float* r = ref[piece.param].data() + piece.begin;
    if (bitwise) {
      EXPECT_EQ(0, std::memcmp(d, r, piece.count * sizeof(float)))
          << what << ": parameter " << piece.param << " elements [" << piece.begin << ", "
          << piece.begin + piece.count << ") differ";
    }
    for (int64_t i = 0; i < piece.count; ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(d[i]) - r[i]));
  }
  return worst;
}

// This rank's reduced gradient shard (modes that keep it in the buffer after the step).
inline std::vector<float> grad_shard(const DistOptimizer& opt) {
  const std::vector<uint8_t> all = opt.grad_buffer().download();
  const FlatRange sh = opt.shard();
  std::vector<float> out(sh.size());
  if (!out.empty()) std::memcpy(out.data(), all.data() + sh.begin * sizeof(float), out.size() * 4);
  return out;
}

// A double that every rank agrees on: the max over ranks.
inline double max_over_ranks(double v) {
  DeviceBuffer b = upload(std::vector<double>{v});
  comm().all_reduce(static_cast<double*>(b.get()), static_cast<double*>(b.get()), 1,
                    ReduceOp::kMax);
  return download<double>(b)[0];
}

}  // namespace packmoe::dist_checks
