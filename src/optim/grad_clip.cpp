// Global gradient norm over main_grads with one device buffer and one download.
#include "optim/grad_clip.h"

#include <cmath>
#include <cstring>

#include "backend/device_buffer.h"

namespace packmoe {

double global_grad_norm(Backend& backend, const std::vector<const GroupedStorage*>& grads) {
  if (grads.empty()) return 0.0;
  DeviceBuffer sums(backend, grads.size() * sizeof(double));  // (P) F64
  double* out = static_cast<double*>(sums.get());
  for (size_t i = 0; i < grads.size(); ++i) {
    PACKMOE_CHECK(&grads[i]->memory() == &backend, "grad " << i << " lives in another backend");
    PACKMOE_CHECK(grads[i]->bytes_per_group() % sizeof(float) == 0, "grad " << i << " is not F32");
    check_op(ops::sum_squares(backend, segments<const float>(*grads[i]), out + i), "sum_squares");
  }
  const std::vector<uint8_t> bytes = sums.download();
  double total = 0.0;
  for (size_t i = 0; i < grads.size(); ++i) {
    double v;
    std::memcpy(&v, bytes.data() + i * sizeof(double), sizeof(double));
    total = total + v;
  }
  return std::sqrt(total);
}

float clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  const double coef = max_norm / (norm + 1e-6);
  if (std::isnan(coef)) return std::nanf("");
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

}  // namespace packmoe
