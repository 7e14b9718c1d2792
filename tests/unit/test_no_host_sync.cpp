// No host synchronisation inside a micro-batch: on a backend that counts its waits (device-to-host
// copies and synchronize() calls; the CPU's memory and ops underneath), an MoE block's forward +
// backward and a whole model's queued forward + backward wait zero times, with and without the aux
// loss and delayed wgrads; reading the step's losses (read_losses) is one copy for any number of
// micro-batches and gives the values Model::forward reads.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/moe_block_harness.h"
#include "nn/model.h"

namespace packmoe {
namespace {

// The CPU backend with every wait counted. H2D copies are counted apart: a batch's ids go to the
// device at the start of a forward (no result of the device is awaited there on the CPU).
class CountingBackend final : public Backend {
 public:
  Device device() const override { return Device::kCPU; }
  void* allocate(size_t bytes) override { return cpu_backend().allocate(bytes); }
  void deallocate(void* ptr) override { cpu_backend().deallocate(ptr); }
  std::string name() const override { return "cpu (counting waits)"; }
  void copy(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    if (kind == CopyKind::kDeviceToHost) ++device_to_host;
    if (kind == CopyKind::kHostToDevice) ++host_to_device;
    cpu_backend().copy(dst, src, bytes, kind);
  }
  void fill_zero(void* dst, size_t bytes) override { cpu_backend().fill_zero(dst, bytes); }
  void synchronize() override { ++synchronizations; }
  double time_ms(const std::function<void()>& body, int warmup, int iters) override {
    return cpu_backend().time_ms(body, warmup, iters);
  }
  const OpKernels& kernels() const override { return cpu_backend().kernels(); }

  int waits() const { return device_to_host + synchronizations; }
  void reset() { device_to_host = host_to_device = synchronizations = 0; }

  int device_to_host = 0, host_to_device = 0, synchronizations = 0;
};

TEST(NoHostSync, MoEBlockForwardBackwardNeverWaits) {
  CountingBackend b;
  for (float aux_coef : {0.0f, 1e-2f})
    for (bool delay : {false, true}) {
      SCOPED_TRACE(std::string("aux ") + (aux_coef != 0 ? "on" : "off") +
                   (delay ? ", delayed wgrad" : ""));
      std::mt19937 rng(31 + (delay ? 1 : 0));
      const MoEBlockInit init = testing::make_parity_init(rng);
      MoEBlockConfig cfg = testing::parity_config(
          {Recipe::kBF16, PrimaryWeight::kLowPrecision, true, delay}, Layout::kSingle);
      cfg.aux_loss_coef = aux_coef;
      MoEBlock block(b, cfg, init);
      for (float mean : {0.0f, 1.0f}) {  // every expert busy, then one starved
        const Tensor x = testing::random_activation(b, rng, DType::kBF16, mean);  // (T, H)
        const Tensor dy = testing::random_activation(b, rng, DType::kF32, 0.0f);  // (T, H)
        b.reset();
        block.forward(x);
        block.backward(dy, GradAccum::kAccumulate);
        if (delay) block.backward_dw();
        EXPECT_EQ(b.device_to_host, 0) << "device-to-host copies in a micro-batch";
        EXPECT_EQ(b.synchronizations, 0);
        EXPECT_EQ(b.host_to_device, 0);
      }
    }
}

// V = 40, H = 32; layers 0 and 2 MoE (E = 4, top-2, aux loss on), layer 1 a dense MLP.
ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 40;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.moe_intermediate_size = 16;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 64;
  c.num_experts_per_tok = 2;
  c.num_experts = 4;
  c.mlp_only_layers = {1};
  c.router_aux_loss_coef = 0.01;
  return c;
}

Batch random_batch(std::mt19937& rng, const ModelConfig& c) {
  Batch batch;
  batch.batch = 2;
  batch.seq = 16;
  for (int64_t i = 0; i < batch.batch * batch.seq; ++i) {
    batch.inputs.push_back(static_cast<int32_t>(rng() % c.vocab_size));
    batch.targets.push_back(i % 7 == 3 ? -100 : static_cast<int32_t>(rng() % c.vocab_size));
  }
  return batch;
}

TEST(NoHostSync, ModelMicroBatchesNeverWaitAndTheStepReadsItsLossesOnce) {
  CountingBackend b;
  const ModelConfig c = small_config();
  Model model(b, c, ModelPrecision{}, random_model_weights(c, 5));
  Model twin(cpu_backend(), c, ModelPrecision{}, random_model_weights(c, 5));
  std::mt19937 rng(8);
  std::vector<Batch> batches;
  for (int i = 0; i < 3; ++i) batches.push_back(random_batch(rng, c));

  b.reset();
  std::vector<QueuedLosses> queued;
  for (const Batch& batch : batches) {
    Result<QueuedLosses> l = model.queue_forward(batch, 1.0f / 3.0f);
    ASSERT_TRUE(l.is_ok()) << l.status().message();
    queued.push_back(l.value());
    model.backward();
  }
  EXPECT_EQ(b.waits(), 0) << b.device_to_host << " device-to-host copies, " << b.synchronizations
                          << " synchronizations in 3 micro-batches";
  const std::vector<ForwardLosses> got = read_losses(b, queued);
  EXPECT_EQ(b.device_to_host, 1) << "the step's losses: one copy";
  EXPECT_EQ(b.synchronizations, 0);

  // The host-reading forward of the same weights and batches: the same values, bit for bit (its
  // twin backward keeps the two models' weights and state alike).
  ASSERT_EQ(got.size(), batches.size());
  for (size_t i = 0; i < batches.size(); ++i) {
    Result<ForwardLosses> want = twin.forward(batches[i], 1.0f / 3.0f);
    ASSERT_TRUE(want.is_ok());
    twin.backward();
    EXPECT_EQ(std::memcmp(&got[i].lm_loss, &want.value().lm_loss, sizeof(float)), 0) << i;
    EXPECT_EQ(std::memcmp(&got[i].aux_loss, &want.value().aux_loss, sizeof(float)), 0) << i;
    EXPECT_GT(got[i].aux_loss, 0.0f) << "two MoE layers' aux summed";
    EXPECT_EQ(got[i].target_tokens, want.value().target_tokens);
    EXPECT_EQ(got[i].aux_coef, 0.01f);
  }
}

}  // namespace
}  // namespace packmoe
