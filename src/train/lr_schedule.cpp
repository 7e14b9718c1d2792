// Warmup + cosine learning rate (formula in the header).
#include "train/lr_schedule.h"

#include <cmath>
#include <numbers>
#include <sstream>

namespace packmoe::train {

double LrSchedule::at(int64_t step) const {
  PACKMOE_CHECK(step >= 1, "lr schedule steps count from 1, got " << step);
  if (step <= warmup_steps)
    return lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
  if (step > decay_steps) return min_lr;
  const double ratio = static_cast<double>(step - warmup_steps) /
                       static_cast<double>(decay_steps - warmup_steps);
  return min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));
}

Status validate(const LrSchedule& s) {
  std::ostringstream e;
  if (!std::isfinite(s.lr) || s.lr < 0) {
    e << "lr = " << s.lr << " must be a finite number >= 0";
  } else if (!std::isfinite(s.min_lr) || s.min_lr < 0 || s.min_lr > s.lr) {
    e << "min_lr = " << s.min_lr << " must be in [0, lr = " << s.lr << "]";
  } else if (s.warmup_steps < 0) {
    e << "warmup_steps = " << s.warmup_steps << " must be >= 0";
  } else if (s.decay_steps < 1) {
    e << "decay_steps = " << s.decay_steps << " must be >= 1";
  } else {
    return Status::ok();
  }
  return Status::error(e.str());
}

}  // namespace packmoe::train
