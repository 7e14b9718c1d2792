// carve_payload: the group-major layout of a DispatchPayload (nn/dispatch_payload.h).
#include "nn/dispatch_payload.h"

namespace packmoe {

PayloadGroups carve_payload(void* base, const std::vector<int64_t>& m, int64_t data_row_bytes,
                            int64_t scale_row_bytes) {
  PayloadGroups g;
  auto* at = static_cast<uint8_t*>(base);
  for (int64_t rows : m) {
    g.data.push_back(at);
    g.scale.push_back(at + rows * data_row_bytes);
    at += rows * (data_row_bytes + scale_row_bytes);
  }
  return g;
}

}  // namespace packmoe
