// The checks of an expert-parallel MoEBlock (dist/ep_token_dispatcher.h: each rank holds E / EP
// experts, tokens travel by all-to-all) against the data-parallel picture it must reproduce: every
// rank runs the whole block (all E experts) on its own tokens, and an expert's gradient is the
// rank-ordered sum of the EP group's per-rank gradients. For every EP dividing the world size (np
// 1, 2, 3, 4 give EP 1..4), BF16 and MXFP8: y, dx and the router gradient bitwise the whole block's
// on the same tokens, each held expert's FC1 / FC2 gradient bitwise the ordered sum. NVFP4: y and
// the router gradient bitwise (its gradients' stochastic rounding is numbered per quantizing call,
// so the expert side of the backward differs from EP = 1 by design: docs/dist.md). Uneven token
// counts per rank, an expert that never gets a token, a rank none of whose experts gets one (it
// receives no row), fresh random inputs per run. The bytes each rank's all-to-alls send, against
// what train::plan_all_to_all says (exact for these counts, within its bound). Shared by
// tests/dist/test_ep_moe_block.cpp (Local and MPI, host memory) and test_nccl_ep_moe_block.cpp
// (NCCL, one GPU per rank: the dispatcher's backward combine on NCCL's side stream).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "common/dist_main.h"
#include "core/codecs.h"
#include "dist/ep_token_dispatcher.h"
#include "dist/expert_layout.h"
#include "nn/moe_block.h"
#include "train/memory_plan.h"

namespace packmoe::dist_test::ep_checks {

constexpr int64_t kE = 12, kH = 64, kF = 32, kTopK = 2;
constexpr int64_t kStarved = 5;  // its router row is far below the others: it never gets a token

Tensor random_host(Shape shape, std::mt19937_64& rng, float mean, float stddev) {
  std::normal_distribution<float> dist(mean, stddev);
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = dist(rng);
  return t;
}

Tensor bf16_rows(Backend& b, std::mt19937_64& rng, int64_t rows, float mean) {
  const Tensor f = random_host({rows, kH}, rng, mean, 1.0f);
  Tensor h = Tensor::empty(cpu_backend(), DType::kBF16, f.shape());
  for (int64_t i = 0; i < h.numel(); ++i)
    h.data_as<uint16_t>()[i] = f32_to_bf16(f.data_as<float>()[i]);
  return b.to_device(h);
}

std::vector<uint8_t> bytes_of(Backend& b, const Tensor& t) {
  std::vector<uint8_t> h(t.nbytes());
  if (!h.empty()) b.copy(h.data(), t.data(), h.size(), Backend::CopyKind::kDeviceToHost);
  return h;
}

std::vector<float> floats_of(const std::vector<uint8_t>& bytes) {
  std::vector<float> f(bytes.size() / sizeof(float));
  std::memcpy(f.data(), bytes.data(), bytes.size());
  return f;
}

// Experts [first, first + count) of an (E, N, K) host init, as a view.
Tensor experts_of(const Tensor& all, int64_t first, int64_t count) {
  const int64_t per = all.dim(1) * all.dim(2);
  return Tensor::view(all.data_as<float>() + first * per, DType::kF32, {count, all.dim(1), all.dim(2)},
                      Device::kCPU);
}

// Every rank's `mine` (the same size on each), in rank order.
std::vector<std::vector<float>> gather_all(const std::vector<float>& mine) {
  Communicator& c = comm();
  const int64_t bytes = static_cast<int64_t>(mine.size() * sizeof(float));
  DeviceBuffer in = upload(mine);
  DeviceBuffer out(c.backend(), static_cast<size_t>(bytes * c.size()));
  c.all_gather(in.get(), out.get(), bytes);
  const std::vector<float> all = download<float>(out);
  std::vector<std::vector<float>> per(c.size());
  for (int r = 0; r < c.size(); ++r)
    per[r].assign(all.begin() + r * mine.size(), all.begin() + (r + 1) * mine.size());
  return per;
}

// The block both EP checks run: weights from `shared` (the same on every rank), expert kStarved
// never routed to, and with last_rank_idle the last E / world experts neither (EP = world: the
// last rank's).
struct EpBlock {
  MoEBlockInit init;
  MoEBlockConfig cfg;
};
EpBlock ep_block(std::mt19937_64& shared, Recipe recipe, bool last_rank_idle, int world_size) {
  EpBlock r{{random_host({kE, kH}, shared, 0.0f, 0.1f),
             random_host({kE, 2 * kF, kH}, shared, 0.0f, 0.1f),
             random_host({kE, kH, kF}, shared, 0.0f, 0.1f)},
            {}};
  float* router = r.init.router.data_as<float>();
  for (int64_t h = 0; h < kH; ++h) router[kStarved * kH + h] = -0.2f;
  if (last_rank_idle)
    for (int64_t e = kE - kE / world_size; e < kE; ++e)
      for (int64_t h = 0; h < kH; ++h) router[e * kH + h] = -0.2f;
  r.cfg.top_k = kTopK;
  r.cfg.norm_topk_prob = true;
  r.cfg.aux_loss_coef = 1e-2f;
  r.cfg.recipe = {recipe, false, /*sr_seed=*/7};
  return r;
}

struct Case {
  Recipe recipe;
  // The last EP rank's experts get no token from any rank (it receives and computes no row).
  bool last_rank_idle;
};

class EpMoeBlock : public ::testing::TestWithParam<Case> {};

TEST_P(EpMoeBlock, ReproducesTheWholeBlockOnEveryRanksTokens) {
  const Recipe recipe = GetParam().recipe;
  Communicator& world = comm();
  if (GetParam().last_rank_idle && world.size() == 1) GTEST_SKIP() << "needs 2+ ranks";
  Backend& b = world.backend();
  const int rank = world.rank();
  std::mt19937_64 shared(g_seed);  // the same init on every rank
  const auto [init, cfg] = ep_block(shared, recipe, GetParam().last_rank_idle, world.size());

  std::mt19937_64 own(g_seed + 1000 + static_cast<uint64_t>(rank));
  const int64_t T = 24 + 8 * rank;  // uneven tokens per rank
  const Tensor x = bf16_rows(b, own, T, 0.5f);  // mean > 0: expert kStarved gets nothing
  const Tensor dy = bf16_rows(b, own, T, 0.0f);

  // The data-parallel picture: the whole block on this rank's tokens.
  MoEBlock whole(b, cfg, init);
  const std::vector<uint8_t> y_want = bytes_of(b, whole.forward(x));
  const std::vector<uint8_t> dx_want = bytes_of(b, whole.backward(dy, GradAccum::kOverwrite));
  const std::vector<uint8_t> router_want = whole.router().param().main_grad().download();
  const auto fc1_all = gather_all(floats_of(whole.fc1().param().main_grad().download()));
  const auto fc2_all = gather_all(floats_of(whole.fc2().param().main_grad().download()));
  // Every rank's padded rows per expert (what its dispatch sends each expert's holder).
  const std::vector<int64_t> padded = whole.plan().padded_counts;
  const auto counts_all = gather_all(std::vector<float>(padded.begin(), padded.end()));
  int64_t own_rows = 0;
  for (int64_t c : padded) own_rows += c;

  for (int ep = 1; ep <= world.size(); ++ep) {
    if (world.size() % ep != 0 || kE % ep != 0) continue;
    SCOPED_TRACE(::testing::Message() << "EP " << ep << " of " << world.size() << " ranks");
    const ExpertLayout layout = make_expert_layout(world.size(), ep, kE, 1).value();
    std::unique_ptr<Communicator> ep_comm = world.split(layout.ep_group(rank));
    ASSERT_EQ(ep_comm->size(), ep);
    ASSERT_EQ(ep_comm->rank(), layout.ep_rank(rank));
    const int64_t first = layout.first_expert(rank), el = layout.local_experts();
    MoEBlockInit slice{init.router, experts_of(init.fc1, first, el), experts_of(init.fc2, first, el)};
    MoEBlock sharded(b, cfg, slice);
    auto owned = std::make_unique<EpTokenDispatcher>(*ep_comm, kE);
    const EpTokenDispatcher& dispatcher = *owned;
    sharded.set_token_dispatcher(std::move(owned));
    EXPECT_EQ(bytes_of(b, sharded.forward(x)), y_want);
    const std::vector<uint8_t> dx = bytes_of(b, sharded.backward(dy, GradAccum::kOverwrite));
    // The rows sent: own rows twice (dispatch, dY), received rows twice (combine, dX); within
    // the plan's bound for the most tokens any rank has.
    int64_t received = 0;
    for (int s = 0; s < ep; ++s)
      for (int64_t e = first; e < first + el; ++e)
        received += static_cast<int64_t>(counts_all[layout.ep_group(rank) * ep + s][e]);
    const int64_t row_bytes = kH * 2;
    EXPECT_EQ(dispatcher.row_bytes_sent(), 2 * (own_rows + received) * row_bytes);
    ModelConfig shape;
    shape.hidden_size = kH;
    shape.num_experts = kE;
    shape.num_experts_per_tok = kTopK;
    shape.num_hidden_layers = 1;
    shape.decoder_sparse_step = 1;
    const train::AllToAllPlan planned =
        train::plan_all_to_all(shape, recipe, DispatchDtype::kBF16, ep, 24 + 8 * (world.size() - 1), 1);
    if (ep > 1) {
      EXPECT_LE(dispatcher.row_bytes_sent(), planned.max_bytes_per_step);
      EXPECT_LE(received * row_bytes, planned.max_receive_bytes);  // this dispatch's buffer
    }
    EXPECT_EQ(sharded.router().param().main_grad().download(), router_want);
    if (recipe == Recipe::kNvfp4) continue;
    EXPECT_EQ(dx, dx_want);
    // Each held expert's gradient: the EP group's ranks' in order, summed left to right.
    const int group_first = layout.ep_group(rank) * ep;
    for (const auto& [all, got] :
         {std::pair{&fc1_all, floats_of(sharded.fc1().param().main_grad().download())},
          std::pair{&fc2_all, floats_of(sharded.fc2().param().main_grad().download())}}) {
      const size_t per_expert = got.size() / static_cast<size_t>(el);
      std::vector<float> want(got.size(), 0.0f);
      for (int s = 0; s < ep; ++s) {
        const std::vector<float>& g = (*all)[group_first + s];
        for (size_t i = 0; i < got.size(); ++i) {
          const float v = g[first * per_expert + i];
          want[i] = s == 0 ? v : want[i] + v;
        }
      }
      EXPECT_EQ(got, want);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, EpMoeBlock,
                         ::testing::Values(Case{Recipe::kBF16, false}, Case{Recipe::kMxfp8, false},
                                           Case{Recipe::kNvfp4, false}, Case{Recipe::kBF16, true},
                                           Case{Recipe::kMxfp8, true}));

}  // namespace packmoe::dist_test::ep_checks

#include "common/ep_dispatch_dtype_checks.h"  // IWYU pragma: keep (its tests run here too)
