// The MoEBlock's TokenDispatcher seam: a dispatcher that moves the expert MLP's rows through memory
// of its own (as an all-to-all would: fresh buffers both ways) gives bitwise the outputs, input
// gradients and main_grads of the local identity, in every recipe; it is called once per forward
// and once per backward in each direction, with the routing plan's padded counts; the backward's
// combine is started before the expert wgrads and the router's backward and finished after them.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "common/moe_block_harness.h"
#include "nn/token_dispatcher.h"

namespace packmoe {
namespace {

using testing::bytes_of;

struct Calls {
  int dispatches = 0, combines = 0;
  std::vector<int64_t> last_counts;
};

// Copies rows into a fresh tensor on the way to the experts and on the way back.
class CopyingDispatcher final : public TokenDispatcher {
 public:
  CopyingDispatcher(Backend& b, Calls* calls) : b_(&b), calls_(calls) {}
  ExpertRows dispatch(const ExpertRows& all) override {
    ++calls_->dispatches;
    calls_->last_counts.resize(all.counts.numel());
    b_->copy(calls_->last_counts.data(), all.counts.data(), all.counts.nbytes(),
             Backend::CopyKind::kDeviceToHost);
    return {copy(all.rows), copy(all.counts), copy(all.used), {}, {}};
  }
  Tensor combine(const Tensor& rows) override {
    ++calls_->combines;
    return copy(rows);
  }

 private:
  Tensor copy(const Tensor& t) const {
    Tensor out = Tensor::empty(*b_, t.dtype(), t.shape());
    if (t.nbytes()) b_->copy(out.data(), t.data(), t.nbytes(), Backend::CopyKind::kDeviceToDevice);
    return out;
  }
  Backend* b_;
  Calls* calls_;
};

TEST(TokenDispatcher, ACopyingDispatcherEqualsTheLocalOneBitwise) {
  Backend& b = cpu_backend();
  for (Recipe r : {Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4}) {
    SCOPED_TRACE(recipe_name(r));
    std::mt19937 rng(777 + static_cast<int>(r));
    const MoEBlockInit init = testing::make_parity_init(rng);
    const testing::Case c{r, PrimaryWeight::kLowPrecision, true, false};
    MoEBlock local(b, testing::parity_config(c, Layout::kSingle), init);
    MoEBlock seam(b, testing::parity_config(c, Layout::kSingle), init);
    Calls calls;
    seam.set_token_dispatcher(std::make_unique<CopyingDispatcher>(b, &calls));
    for (float mean : {0.0f, 1.0f}) {  // every expert busy, then one starved
      const Tensor x = testing::random_activation(b, rng, DType::kBF16, mean);   // (T, H)
      const Tensor dy = testing::random_activation(b, rng, DType::kF32, 0.0f);   // (T, H)
      EXPECT_TRUE(bytes_of(b, local.forward(x)) == bytes_of(b, seam.forward(x))) << "y";
      EXPECT_EQ(calls.last_counts, seam.plan().padded_counts);
      EXPECT_TRUE(bytes_of(b, local.backward(dy, GradAccum::kAccumulate)) ==
                  bytes_of(b, seam.backward(dy, GradAccum::kAccumulate)))
          << "dx";
      const std::vector<GroupedParam*> a = local.params(), s = seam.params();
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_TRUE(a[i]->main_grad().download() == s[i]->main_grad().download())
            << testing::kParamNames[i] << " main_grad";
    }
    EXPECT_EQ(calls.dispatches, 4);  // per micro-batch: xp forward, dyp backward
    EXPECT_EQ(calls.combines, 4);    // yp forward, dxp backward
  }
}

// Records which gradients are written when the backward's combine starts and when it finishes.
class OverlapProbe final : public TokenDispatcher {
 public:
  ExpertRows dispatch(const ExpertRows& all) override {
    ++dispatches;
    return all;
  }
  ExpertRows dispatch_again(const ExpertRows& all) override {
    ++agains;
    return all;
  }
  Tensor combine(const Tensor& rows) override { return rows; }
  Tensor start_combine(const Tensor& rows) override {
    ++starts;
    written_at_start = written();
    return rows;
  }
  void finish_combine() override {
    ++finishes;
    written_at_finish = written();
  }
  bool overlaps_combine() const override { return true; }
  MoEBlock* block = nullptr;
  int dispatches = 0, agains = 0, starts = 0, finishes = 0;
  std::vector<bool> written_at_start, written_at_finish;  // router, fc1, fc2

 private:
  std::vector<bool> written() const {
    std::vector<bool> out;
    for (GroupedParam* p : block->params()) {
      const std::vector<uint8_t> g = p->main_grad().download();
      out.push_back(std::any_of(g.begin(), g.end(), [](uint8_t v) { return v != 0; }));
    }
    return out;
  }
};

// The backward's dY rows go out with the forward's plan (dispatch_again: under expert
// parallelism no second count exchange), and the dX rows travel back while the expert wgrads and
// the router's backward run: all three gradients are still unwritten when the combine starts,
// and written by the time it finishes (the permute's backward waits for it); the forward's
// combine is whole.
TEST(TokenDispatcher, TheBackwardCombineOverlapsTheWgradsAndTheRouterBackward) {
  Backend& b = cpu_backend();
  std::mt19937 rng(31);
  const testing::Case c{Recipe::kBF16, PrimaryWeight::kLowPrecision, true, false};
  MoEBlock block(b, testing::parity_config(c, Layout::kSingle), testing::make_parity_init(rng));
  auto probe = std::make_unique<OverlapProbe>();
  OverlapProbe* seen = probe.get();
  seen->block = &block;
  block.set_token_dispatcher(std::move(probe));
  block.zero_grad();
  block.forward(testing::random_activation(b, rng, DType::kBF16, 0.0f));
  EXPECT_EQ(seen->starts, 0);
  block.backward(testing::random_activation(b, rng, DType::kF32, 0.0f), GradAccum::kAccumulate);
  EXPECT_EQ(seen->starts, 1);
  EXPECT_EQ(seen->finishes, 1);
  EXPECT_EQ(seen->dispatches, 1);  // the forward's; the backward reuses its plan
  EXPECT_EQ(seen->agains, 1);
  EXPECT_EQ(seen->written_at_start, std::vector<bool>({false, false, false}));
  EXPECT_EQ(seen->written_at_finish, std::vector<bool>({true, true, true}));
}

TEST(TokenDispatcher, ChangesOnlyBetweenSteps) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Backend& b = cpu_backend();
  std::mt19937 rng(5);
  const testing::Case c{Recipe::kBF16, PrimaryWeight::kLowPrecision, true, false};
  MoEBlock block(b, testing::parity_config(c, Layout::kSingle), testing::make_parity_init(rng));
  block.forward(testing::random_activation(b, rng, DType::kBF16, 0.0f));
  Calls calls;
  EXPECT_DEATH(block.set_token_dispatcher(std::make_unique<CopyingDispatcher>(b, &calls)),
               "only between steps");
}

}  // namespace
}  // namespace packmoe
