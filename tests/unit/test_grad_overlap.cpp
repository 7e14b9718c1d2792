// The overlapped gradient reduce-scatter's ordering (docs/dist.md "Overlap with backward"), seen
// through a one-rank communicator that records its calls and fences: a bucket is launched on the
// side stream, after a side-waits-for-backend fence, exactly when the last of its params reports
// its gradient final in the step's last backward; step() reduces the rest on the backend stream
// and then fences the backend after the side stream; without the last-backward flag nothing is
// launched early. The sums themselves (bitwise equal to reducing after backward) are checked by
// the dist tests.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dist/dist_optimizer.h"
#include "nn/grouped_param.h"

namespace packmoe {
namespace {

// One rank over host memory (the Local communicator's copies), declared as NCCL so that it may
// take a stream, with a side stream of its own and a log of what it was asked to do.
class RecordingCommunicator final : public Communicator {
 public:
  explicit RecordingCommunicator(Backend& b)
      : Communicator(CommKind::kNccl, 0, 1, b, CommOptions{false, 0.0}) {}
  [[noreturn]] void abort_job() override { std::abort(); }

  StreamHandle side_stream() override { return kSide; }
  void side_waits_for_backend() override { log.push_back("side waits"); }
  void backend_waits_for_side() override { log.push_back("backend waits"); }

  std::vector<std::string> log;

 protected:
  void do_all_reduce(ReduceType type, const void* in, void* out, int64_t count, ReduceOp,
                     StreamHandle) override {
    copy(out, in, count * (type == ReduceType::kF32 ? 4 : 8));
  }
  void do_reduce_scatterv(const float* in, float* out, std::span<const int64_t> counts,
                          StreamHandle stream) override {
    log.push_back(std::string("reduce-scatter ") + std::to_string(counts[0]) + " on " +
                  (stream == kSide ? "side" : "backend"));
    copy(out, in, counts[0] * 4);
  }
  void do_all_gatherv(const void* in, void* out, std::span<const int64_t> bytes,
                      StreamHandle) override {
    copy(out, in, bytes[0]);
  }
  void do_broadcast(void*, int64_t, int, StreamHandle) override {}
  void do_all_to_allv(const void* in, std::span<const int64_t> send_bytes, void* out,
                      std::span<const int64_t>, StreamHandle) override {
    copy(out, in, send_bytes[0]);
  }
  std::unique_ptr<Communicator> do_split(int) override {
    return std::make_unique<RecordingCommunicator>(backend());
  }
  void do_barrier() override {}
  void exchange_host(const void* mine, void* all, int64_t bytes) override {
    std::memcpy(all, mine, static_cast<size_t>(bytes));
  }

 private:
  static inline const StreamHandle kSide = reinterpret_cast<StreamHandle>(uintptr_t{1});
  static void copy(void* dst, const void* src, int64_t bytes) {
    if (bytes > 0 && dst != src) std::memcpy(dst, src, static_cast<size_t>(bytes));
  }
};

// Four BF16 params (1, 64, 64) of random values; buckets of 8192 elements hold two each. The
// buffer is laid out in reverse order, so bucket 0 = {p3, p2}, bucket 1 = {p1, p0}.
struct Fixture {
  RecordingCommunicator comm{cpu_backend()};
  std::vector<std::unique_ptr<GroupedParam>> params;
  std::unique_ptr<DistOptimizer> opt;

  Fixture() {
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<DistParam> dist;
    for (int p = 0; p < 4; ++p) {
      Tensor init = Tensor::empty(cpu_backend(), DType::kF32, {1, 64, 64});
      for (int64_t i = 0; i < init.numel(); ++i) init.data_as<float>()[i] = normal(rng);
      params.push_back(std::make_unique<GroupedParam>(cpu_backend(),
                                                      QuantRecipe{Recipe::kBF16, false, 0},
                                                      PrimaryWeight::kHighPrecision,
                                                      Layout::kSingle, init));
      dist.push_back({params.back().get(), true});
    }
    opt = std::make_unique<DistOptimizer>(comm, dist,
                                          DistOptimizerConfig{AdamWConfig{}, GatherMode::kBf16, 8192});
    opt->prepare_forward();
    comm.log.clear();
  }
  // prepare_backward, then what a backward's writers do first (the gradients' values do not
  // matter here).
  void backward(bool last_of_step = false) {
    opt->prepare_backward(last_of_step);
    for (auto& p : params) p->take_grad_write();
  }
};

TEST(GradOverlap, TheLastParamOfABucketLaunchesItOnTheSideStream) {
  Fixture f;
  ASSERT_EQ(f.opt->plan().buckets().size(), 2u);
  f.backward(true);
  f.opt->grad_ready(3);
  EXPECT_TRUE(f.comm.log.empty());
  f.opt->grad_ready(2);  // bucket 0 complete
  EXPECT_EQ(f.comm.log, (std::vector<std::string>{"side waits", "reduce-scatter 8192 on side"}));
  EXPECT_TRUE(f.opt->grad_buffer().reducing());
  f.opt->grad_ready(0);
  EXPECT_EQ(f.comm.log.size(), 2u);
  f.opt->grad_ready(1);  // bucket 1 complete
  EXPECT_EQ(f.comm.log.size(), 4u);
  f.comm.log.clear();
  EXPECT_TRUE(f.opt->step().applied);
  // Nothing left to reduce: the backend waits for the side stream before the norm reads it.
  EXPECT_EQ(f.comm.log, (std::vector<std::string>{"backend waits"}));
  EXPECT_FALSE(f.opt->grad_buffer().reducing());
}

TEST(GradOverlap, StepReducesWhatWasNotLaunchedOnTheBackendStream) {
  Fixture f;
  f.backward();  // not the last backward: grad_ready launches nothing
  for (int p = 3; p >= 0; --p) f.opt->grad_ready(p);
  EXPECT_TRUE(f.comm.log.empty());
  f.backward(true);
  f.opt->grad_ready(1);
  f.opt->grad_ready(0);  // bucket 1 only
  f.comm.log.clear();
  EXPECT_TRUE(f.opt->step().applied);
  EXPECT_EQ(f.comm.log,
            (std::vector<std::string>{"reduce-scatter 8192 on backend", "backend waits"}));
  f.comm.log.clear();
  f.opt->prepare_forward();
  f.backward(true);
  f.comm.log.clear();
  EXPECT_TRUE(f.opt->step().applied);  // no hook at all: everything in the step, no fence
  EXPECT_EQ(f.comm.log, (std::vector<std::string>{"reduce-scatter 8192 on backend",
                                                  "reduce-scatter 8192 on backend"}));
}

TEST(GradOverlap, MisuseAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  Fixture f;
  f.backward(true);
  f.opt->grad_ready(3);
  EXPECT_DEATH(f.opt->grad_ready(3), "grad_ready\\(3\\): not a param, or reported twice");
  f.opt->grad_ready(2);
  EXPECT_DEATH(f.opt->prepare_backward(), "after 1 bucket\\(s\\) began their reduce-scatter");
  EXPECT_DEATH(f.opt->grad_ready(7), "grad_ready\\(7\\)");
}

}  // namespace
}  // namespace packmoe
