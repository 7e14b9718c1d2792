// CPU reference of the init ops (backend/ops/init.h): one OpenMP loop over the Philox draws,
// static schedule; each element is a pure function of its index, so the bytes do not depend on
// the thread count.
#include <algorithm>

#include "backend/ops/init.h"

namespace packmoe {

Status init_normal_cpu(const InitNormalArgs& a) {
  const PhiloxKeys keys = philox_seed_keys(a.seed);
  const int64_t pairs = (a.n + 1) / 2;
  float* out = a.out;
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < pairs; ++j) {
    float even, odd;
    init_normal_pair(philox_draw(keys, static_cast<uint64_t>(j), a.stream), a.stddev, even, odd);
    out[2 * j] = even;
    if (2 * j + 1 < a.n) out[2 * j + 1] = odd;
  }
  return Status::ok();
}

Status fill_f32_cpu(const FillArgs& a) {
  std::fill(a.out, a.out + a.n, a.value);
  return Status::ok();
}

}  // namespace packmoe
