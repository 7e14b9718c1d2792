// Entries of the init op family (backend/ops/init.h): the argument checks, once, then the
// backend's implementation.
#include "backend/ops/init.h"

#include <string>

#include "backend/arg_checks.h"
#include "backend/backend.h"

namespace packmoe {

Status validate_init_normal(const InitNormalArgs& a) {
  if (a.n < 0) return Status::error("init_normal: negative element count");
  if (!std::isfinite(a.stddev) || a.stddev < 0)
    return Status::error("init_normal: stddev " + std::to_string(a.stddev) +
                         " must be finite and >= 0");
  return a.n > 0 ? require_non_null("init_normal", {{a.out, "out"}}) : Status::ok();
}

Status validate_fill(const FillArgs& a) {
  if (a.n < 0) return Status::error("fill_f32: negative element count");
  return a.n > 0 ? require_non_null("fill_f32", {{a.out, "out"}}) : Status::ok();
}

namespace ops {

Status init_normal(Backend& b, const InitNormalArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_init_normal(a));
  return b.kernels().init->init_normal(b, a);
}

Status fill_f32(Backend& b, const FillArgs& a) {
  PACKMOE_RETURN_IF_ERROR(validate_fill(a));
  return b.kernels().init->fill_f32(b, a);
}

}  // namespace ops
}  // namespace packmoe
