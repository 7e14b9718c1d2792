// The distributed-optimizer checks, shared by tests/dist/test_dist_optimizer.cpp (Local and MPI,
// host memory) and test_nccl_dist_optimizer.cpp (NCCL, one GPU per rank, at most 2 ranks so that
// sums stay bitwise): N ranks with one micro-batch each equal one process accumulating N
// micro-batches (bitwise gradients, masters, primary weights and outputs; the FP64 grad norm
// within 1e-12 relative; a clipped step within the stated bound) for every recipe and gather mode;
// the three modes give bitwise the same weights; reuse-grad-buffer train -> eval -> train -> save
// -> train (and resume) equals train-only bitwise; Megatron's eval-then-train sequence, with the
// grad norm the unzeroed buffer would have given; illegal transitions abort naming both states;
// the bytes each mode all-gathers per step; on CUDA, start-up hands the freed inits back to the
// device before it places the moments.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/dist_optimizer_harness.h"

namespace packmoe::dist_checks {

// A clipped step scales the gradient by a clip factor computed from the norm, which differs in
// the last bits between N ranks and one process (FP64 sums in another order); the clip factors
// then differ by at most one FP32 ulp and the masters by at most this many lr after the step.
inline constexpr double kClippedMasterBound = 1e-5;  // x lr
inline constexpr double kNormRelBound = 1e-12;

// ---- N ranks == one process with N micro-batches -----------------------------------------------

TEST(DistOptimizer, EqualsOneProcessAccumulatingEveryRanksMicroBatch) {
  const int world = comm().size();
  double worst_norm = 0, worst_clipped = 0;
  for (const Case& c : kCases)
    for (GatherMode mode : kModes) {
      SCOPED_TRACE(label(c, mode));
      const MoEBlockInit init = make_init(g_seed);
      Reference ref(comm().backend(), c, init, world);
      DistRun run(c, init, mode);
      for (int s = 0; s < 3; ++s) {
        SCOPED_TRACE("step " + std::to_string(s));
        const bool clipped = s == 2;  // steps 0, 1 unclipped: everything bitwise
        const double max_norm = clipped ? 0.25 : 0.0;
        const RefStep rs = ref.step(g_seed, s, max_norm);
        const DistStep ds = run.train_step(g_seed, s, max_norm);
        ASSERT_TRUE(ds.r.applied);
        EXPECT_TRUE(ds.y == rs.y[comm().rank()]) << "forward output of this rank's micro-batch";
        const double rel = std::fabs(ds.r.grad_norm - rs.norm) / rs.norm;
        EXPECT_LE(rel, kNormRelBound) << ds.r.grad_norm << " vs " << rs.norm;
        worst_norm = std::max(worst_norm, rel);
        if (mode != GatherMode::kReuseGradBuffer)  // reuse: BF16 parameters now fill the buffer
          compare_shard(
              run.opt(), grad_shard(run.opt()), [&](int p) { return ref.grad(p); }, true,
              "reduced gradient");
        if (!clipped) {
          EXPECT_EQ(ds.r.clip_scale, 1.0f);
          EXPECT_EQ(rs.clip, 1.0f);
          compare_shard(
              run.opt(), run.opt().master_shard(), [&](int p) { return ref.master(p); }, true,
              "master");
          run.opt().prepare_forward();
          EXPECT_TRUE(primaries(run.block()) == primaries(ref.block())) << "primary weights";
        } else {
          EXPECT_LT(ds.r.clip_scale, 1.0f);
          EXPECT_LE(std::fabs(ds.r.clip_scale - rs.clip), std::ldexp(1.0f, -24))
              << ds.r.clip_scale << " vs " << rs.clip;
          const double diff = compare_shard(
              run.opt(), run.opt().master_shard(), [&](int p) { return ref.master(p); }, false,
              "master");
          EXPECT_LE(diff, kClippedMasterBound * kAdamW.lr);
          worst_clipped = std::max(worst_clipped, diff / kAdamW.lr);
        }
      }
    }
  worst_norm = max_over_ranks(worst_norm);
  worst_clipped = max_over_ranks(worst_clipped);
  if (comm().rank() == 0)
    std::printf(
        "[dist] %d rank(s) vs one process: grad norm rel diff max %.3g (bound %.0e); "
        "clipped step: master |diff| max %.3g lr (bound %.0e lr)\n",
        world, worst_norm, kNormRelBound, worst_clipped, kClippedMasterBound);
}

// ---- the three gather modes agree bitwise
// --------------------------------------------------------

TEST(DistOptimizer, GatherModesGiveBitwiseTheSameWeightsAndReportTheirBytes) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const MoEBlockInit init = make_init(g_seed + 1);
    std::vector<std::unique_ptr<DistRun>> runs;
    for (GatherMode mode : kModes) runs.push_back(std::make_unique<DistRun>(c, init, mode));
    for (int s = 0; s < 3; ++s) {
      std::vector<DistStep> steps;
      for (auto& run : runs) steps.push_back(run->train_step(g_seed, s, /*max_norm=*/0.1));
      for (auto& run : runs) run->opt().prepare_forward();
      for (size_t m = 1; m < runs.size(); ++m) {
        SCOPED_TRACE(std::string(gather_mode_name(kModes[m])) + ", step " + std::to_string(s));
        EXPECT_TRUE(steps[m].y == steps[0].y);
        EXPECT_EQ(steps[m].r.grad_norm, steps[0].r.grad_norm);
        EXPECT_LT(steps[m].r.clip_scale, 1.0f);
        EXPECT_TRUE(runs[m]->opt().master_shard() == runs[0]->opt().master_shard());
        EXPECT_TRUE(primaries(runs[m]->block()) == primaries(runs[0]->block()));
      }
    }
    if (comm().rank() == 0)
      for (size_t m = 0; m < runs.size(); ++m) {
        const GatherTraffic& t = runs[m]->opt().traffic();
        std::printf(
            "[bytes] %-15s %-17s all-gather %7lld B/step = %.4f B/elem, all-reduce %lld B"
            " (%lld elements)\n",
            c.name, std::string(gather_mode_name(kModes[m])).c_str(),
            static_cast<long long>(t.all_gather_bytes), t.bytes_per_element(),
            static_cast<long long>(t.all_reduce_bytes), static_cast<long long>(t.param_elements));
      }
  }
}

// Start-up frees every init (and every BF16 copy a gather slot replaced) before it places the
// moments, and hands that memory back to the device first: a stream-ordered pool would otherwise
// keep the freed blocks reserved beside the moments (one block per param, none large enough for
// a moment), which nvidia-smi counts (docs/PERF.md, the training step's peak memory). Only a
// backend that reports device memory (CUDA) has anything to check.
TEST(DistOptimizer, StartUpHandsTheFreedInitsBackToTheDevice) {
  Backend& b = comm().backend();
  if (!b.memory_use()) GTEST_SKIP() << "the backend reports no device memory";
  // Three params of 64 MiB of FP32 init each, a live 2 MiB block after each (as a model's other
  // tensors sit between its params), so no freed init is next to another: each hole (the init
  // and the BF16 copy a gather slot replaces, 96 MiB) is smaller than a moment (192 MiB).
  constexpr size_t kInitBytes = size_t{3} * 64 << 20;
  std::vector<std::unique_ptr<GroupedParam>> params;
  std::vector<GroupedParam*> raw;
  std::vector<Tensor> spacers;
  for (int i = 0; i < 3; ++i) {
    const Tensor init = Tensor::empty(b, DType::kF32, {4, 2048, 2048});
    b.fill_zero(init.data(), init.nbytes());
    params.push_back(std::make_unique<GroupedParam>(b, QuantRecipe{Recipe::kBF16, false, 0},
                                                    PrimaryWeight::kLowPrecision,
                                                    Layout::kSingle, init));
    raw.push_back(params.back().get());
    spacers.push_back(Tensor::empty(b, DType::kU8, {2 << 20}));
  }
  DistOptimizer opt(comm(), decayed_params(raw), {kAdamW, GatherMode::kBf16, kBucketElems});
  b.synchronize();
  const Backend::MemoryUse m = *b.memory_use();
  // Kept, the holes would add 288 MiB to the reserve; what stays is the pool's partial chunks.
  EXPECT_LT(m.reserved, m.in_use + kInitBytes)
      << "reserved " << m.reserved << " B with " << m.in_use << " B in use";
}

// The expert weights' lowp bytes per element: 1 + 1/32 (MXFP8 2D), 2 + 2/32 (MXFP8 1D: both
// copies), 0.5 + 1/16 (NVFP4), 2 (BF16); the router always travels as BF16.
TEST(DistOptimizer, LowpGathersTheDocumentedBytesPerElement) {
  const struct {
    int c;
    double expert_bytes;
  } expected[] = {{0, 2.0}, {1, 2.0625}, {2, 1.03125}, {3, 0.5625}, {4, 2.0}};
  for (const auto& e : expected) {
    const Case& c = kCases[e.c];
    DistRun run(c, make_init(g_seed + 2), GatherMode::kLowp);
    const int64_t experts = kE * 2 * kF * kH + kE * kH * kF, router = kE * kH;
    const double ideal = experts * e.expert_bytes + router * 2.0;
    const GatherTraffic& t = run.opt().traffic();
    EXPECT_GE(t.all_gather_bytes, ideal) << c.name;
    EXPECT_LE(t.all_gather_bytes, ideal + 16 * 3 * 4) << c.name << ": alignment gaps only";
    EXPECT_EQ(t.all_reduce_bytes, run.block().params()[1]->needs_global_amax() ? 2 * kE * 4 : 0);
    EXPECT_EQ(t.param_elements, experts + router);
    run.opt().prepare_forward();
  }
}

// ---- reuse-grad-buffer: train -> eval -> train -> save -> train == train-only; resume ----------

TEST(DistOptimizer, ReuseGradBufferTrainEvalTrainSaveTrainEqualsTrainOnly) {
  for (const Case& c : {kCases[2], kCases[3]}) {
    SCOPED_TRACE(c.name);
    const MoEBlockInit init = make_init(g_seed + 3);
    DistRun mixed(c, init, GatherMode::kReuseGradBuffer);
    DistRun plain(c, init, GatherMode::kReuseGradBuffer);
    std::vector<DistStep> a, b;
    a.push_back(mixed.train_step(g_seed, 0, 0.5));
    const std::vector<uint8_t> eval1 = mixed.eval(g_seed, 100);
    EXPECT_EQ(mixed.opt().state(), GradBufferState::kZeroed);
    a.push_back(mixed.train_step(g_seed, 1, 0.5));
    // Save: neither call changes the state or any buffer.
    EXPECT_EQ(mixed.opt().state(), GradBufferState::kParamsStaged);
    const OptimizerShard shard = mixed.opt().shard_state();
    const FullOptimizerState saved = mixed.opt().gather_state();
    EXPECT_EQ(mixed.opt().state(), GradBufferState::kParamsStaged);
    EXPECT_EQ(saved.steps, 2);
    a.push_back(mixed.train_step(g_seed, 2, 0.5));
    const std::vector<uint8_t> eval2 = mixed.eval(g_seed, 101);
    EXPECT_FALSE(eval1 == eval2);

    for (int s = 0; s < 3; ++s) b.push_back(plain.train_step(g_seed, s, 0.5));
    plain.opt().prepare_forward();
    for (int s = 0; s < 3; ++s) {
      EXPECT_TRUE(a[s].y == b[s].y) << "step " << s << " forward";
      EXPECT_EQ(a[s].r.grad_norm, b[s].r.grad_norm) << "step " << s;
    }
    EXPECT_TRUE(mixed.opt().master_shard() == plain.opt().master_shard());
    EXPECT_TRUE(primaries(mixed.block()) == primaries(plain.block()));
    EXPECT_TRUE(mixed.opt().grad_buffer().download() == plain.opt().grad_buffer().download());

    // Resume from the save into a block built from another init: step 2 and the weights agree.
    // (Not NVFP4: used without a trainer, a block's gradient SR draws from a counter each layer
    // keeps, GroupedLinear::grad_sr_offset, which a fresh block starts at 0; a trainer sets it
    // per micro-batch from the step instead, nvfp4_grad_sr_offset.)
    if (c.recipe.recipe == Recipe::kNvfp4) continue;
    DistRun resumed(c, make_init(g_seed + 4), GatherMode::kReuseGradBuffer);
    ASSERT_TRUE(resumed.opt().load_state(saved).is_ok());
    EXPECT_EQ(resumed.opt().steps(), 2);
    EXPECT_TRUE(resumed.opt().shard_state().master == shard.master);
    const DistStep r2 = resumed.train_step(g_seed, 2, 0.5);
    resumed.opt().prepare_forward();
    EXPECT_TRUE(r2.y == b[2].y);
    EXPECT_EQ(r2.r.grad_norm, b[2].r.grad_norm);
    EXPECT_TRUE(resumed.opt().master_shard() == plain.opt().master_shard());
    EXPECT_TRUE(primaries(resumed.block()) == primaries(plain.block()));
  }
}

// ---- Megatron's bug sequence: a parameter sync forced by eval, then a training step ------------

TEST(DistOptimizer, MegatronEvalThenTrainZeroesTheBufferAndShowsTheNormItWouldHaveHad) {
  const Case& c = kCases[1];  // MXFP8, as in Megatron's reuse_grad_buf_for_mxfp8_param_ag
  const MoEBlockInit init = make_init(g_seed + 5);
  DistRun run(c, init, GatherMode::kReuseGradBuffer);
  DistRun train_only(c, init, GatherMode::kReuseGradBuffer);
  run.train_step(g_seed, 0, 0.0);
  train_only.train_step(g_seed, 0, 0.0);

  // Eval forces the parameter sync. The all-gather leaves the BF16 image of every master in the
  // first half of the buffer's bytes (the rest holds step 0's stale gradients).
  const FullOptimizerState masters = run.opt().gather_state();
  run.opt().gather_params();
  ASSERT_EQ(run.opt().state(), GradBufferState::kParamsGathered);
  const std::vector<uint8_t> stale = run.opt().grad_buffer().download();
  int64_t not_params = 0;
  for (int p = 0; p < run.opt().plan().params(); ++p) {
    const ParamSlot& slot = run.opt().plan().slot(p);
    for (int64_t i = 0; i < slot.numel; ++i) {
      uint16_t v;
      std::memcpy(&v, stale.data() + 2 * (slot.offset + i), 2);
      not_params += v != f32_to_bf16(masters.master[p][i]);
    }
  }
  EXPECT_EQ(not_params, 0);
  // The eval forward goes through prepare_forward, and its zeroing is the only way on.
  run.eval(g_seed, 100);
  ASSERT_EQ(run.opt().state(), GradBufferState::kZeroed);
  const std::vector<uint8_t> zeroed = run.opt().grad_buffer().download();
  EXPECT_TRUE(std::all_of(zeroed.begin(), zeroed.end(), [](uint8_t b) { return b == 0; }));

  // The training step after eval: this rank's gradient, then the step.
  run.forward_backward(g_seed, 1);
  train_only.forward_backward(g_seed, 1);
  const std::vector<uint8_t> local = run.opt().grad_buffer().download();
  EXPECT_TRUE(local == train_only.opt().grad_buffer().download());
  const DistStepResult fixed = run.opt().step(0.0);
  const DistStepResult reference = train_only.opt().step(0.0);
  EXPECT_EQ(fixed.grad_norm, reference.grad_norm);

  // Megatron's step: backward accumulated onto the stale bytes (each wgrad adds its result to what
  // main_grad holds: stale + g per element, on every rank), then the sum over ranks.
  const int64_t total = run.opt().plan().total();
  std::vector<float> buggy(total), stale_f(total), local_f(total);
  std::memcpy(stale_f.data(), stale.data(), total * sizeof(float));
  std::memcpy(local_f.data(), local.data(), total * sizeof(float));
  for (int64_t x = 0; x < total; ++x) buggy[x] = stale_f[x] + local_f[x];
  DeviceBuffer summed = upload(buggy);
  comm().all_reduce(static_cast<float*>(summed.get()), static_cast<float*>(summed.get()), total,
                    ReduceOp::kSum);
  double sum_sq = 0;
  for (float v : download<float>(summed)) sum_sq += static_cast<double>(v) * v;
  const double would_have = std::sqrt(sum_sq);
  if (comm().rank() == 0)
    std::printf(
        "[megatron replay] %d rank(s): grad norm of the step after eval %.6g with the "
        "zeroing; %.6g had the buffer kept the gathered parameters\n",
        comm().size(), fixed.grad_norm, would_have);
  // The stale bytes' energy depends on the random init: 1.97x to 3.8x over 40 seeds (one rank).
  EXPECT_GT(would_have, 1.5 * fixed.grad_norm);
  run.opt().prepare_forward();
}

// ---- illegal transitions abort, naming both states (one rank: death tests fork) ----------------

TEST(DistOptimizer, IllegalTransitionsAbortNamingBothStates) {
  if (comm().size() > 1 || comm().kind() == CommKind::kNccl)
    GTEST_SKIP() << "death tests run with one rank, on the CPU";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  DistRun run(kCases[3], make_init(g_seed + 6), GatherMode::kReuseGradBuffer);
  Backend& b = comm().backend();
  const Tensor x = micro_x(b, g_seed, 0, 0);
  // Construction staged the masters: no forward, backward or step before the gather.
  EXPECT_EQ(run.opt().state(), GradBufferState::kParamsStaged);
  EXPECT_DEATH(run.block().forward(x), "the primary weight is older than the master");
  EXPECT_DEATH(run.opt().prepare_backward(),
               "grad buffer: illegal transition ParamsStaged -> Accumulating");
  EXPECT_DEATH(run.opt().step(), "illegal transition ParamsStaged -> Reduced");
  // Gathered: the parameters fill the buffer; accumulating onto them is Megatron's bug.
  run.opt().gather_params();
  EXPECT_DEATH(run.opt().prepare_backward(),
               "grad buffer: illegal transition ParamsGathered -> Accumulating");
  EXPECT_DEATH(run.opt().gather_params(), "illegal transition ParamsGathered -> ParamsGathered");
  EXPECT_DEATH(run.opt().shard_state(), "in the middle of a step \\(grad buffer ParamsGathered\\)");
  run.opt().prepare_forward();
  EXPECT_DEATH(run.opt().step(), "illegal transition Zeroed -> Reduced");
  run.forward_backward(g_seed, 0);
  EXPECT_DEATH(run.opt().gather_state(),
               "gather_state in the middle of a step \\(grad buffer "
               "Accumulating\\)");
  FullOptimizerState none;
  EXPECT_DEATH((void)run.opt().load_state(none), "load_state in the middle of a step");
  // A sharded master cannot be used as a full one.
  EXPECT_DEATH(run.block().params()[1]->fp32_weight(), "no FP32 weight here: the param is Released");
  run.opt().step();
  run.opt().prepare_forward();
  // User data: a state of other parameters is a Status, and nothing changes.
  FullOptimizerState other = run.opt().gather_state();
  other.params[0].cols += 16;
  EXPECT_EQ(run.opt().load_state(other).message(),
            "optimizer state: its parameters (shapes or quantization blocks) differ from this "
            "model's");
  EXPECT_EQ(run.opt().state(), GradBufferState::kZeroed);
  EXPECT_FALSE(parse_gather_mode("fp8").is_ok());
  EXPECT_EQ(parse_gather_mode("reuse-grad-buffer").value(), GatherMode::kReuseGradBuffer);
}

}  // namespace packmoe::dist_checks
