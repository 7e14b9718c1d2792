// The process-wide KernelPolicy (kernel_policy.h): one copy behind a mutex, read by each launch.
#include "backend/cuda/kernel_policy.h"

#include <mutex>
#include <string>

#include "core/check.h"

namespace packmoe {
namespace {

std::mutex& policy_mutex() {
  static std::mutex mu;
  return mu;
}

KernelPolicy& current() {
  static KernelPolicy p;
  return p;
}

}  // namespace

KernelPolicy kernel_policy() {
  std::lock_guard<std::mutex> lock(policy_mutex());
  return current();
}

Status set_kernel_policy(const KernelPolicy& p) {
  const GemmPolicy& g = p.gemm;
  if (g.tile_n != 0 && g.tile_n != 128 && g.tile_n != 256)
    return Status::error("kernel policy: gemm.tile_n must be 0, 128 or 256 (got " +
                         std::to_string(g.tile_n) + ")");
  if (g.cluster < 0 || g.cluster > 2)
    return Status::error("kernel policy: gemm.cluster must be 0, 1 or 2 (got " +
                         std::to_string(g.cluster) + ")");
  if (g.max_ctas < 0 || p.quantize.nvfp4_max_ctas < 0)
    return Status::error("kernel policy: CTA limits must be >= 0 (0: every resident CTA)");
  std::lock_guard<std::mutex> lock(policy_mutex());
  current() = p;
  return Status::ok();
}

ScopedKernelPolicy::ScopedKernelPolicy(const KernelPolicy& policy) : previous_(kernel_policy()) {
  const Status st = set_kernel_policy(policy);
  PACKMOE_CHECK(st.is_ok(), st.message());
}

ScopedKernelPolicy::~ScopedKernelPolicy() {
  const Status st = set_kernel_policy(previous_);
  PACKMOE_CHECK(st.is_ok(), st.message());
}

}  // namespace packmoe
