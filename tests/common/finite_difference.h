// Helpers of the `grad` tests: FP64 central finite differences of a loss and the comparison of an
// analytic gradient against them (max |analytic - fd| <= tol * max |fd|).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

namespace packmoe::grad_check {

// Central differences of loss() w.r.t. every element of x (perturbed in place, then restored).
inline std::vector<double> finite_diff(std::vector<double>& x, const std::function<double()>& loss,
                                       double step) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + step;
    const double up = loss();
    x[i] = x0 - step;
    const double down = loss();
    x[i] = x0;
    g[i] = (up - down) / (2 * step);
  }
  return g;
}

// max |analytic - fd| / max |fd| <= tol, with the worst element printed on failure.
inline void expect_grad_near(const char* what, const std::vector<float>& analytic,
                             const std::vector<double>& fd, double tol) {
  ASSERT_EQ(analytic.size(), fd.size()) << what;
  double max_err = 0, max_fd = 0;
  size_t worst = 0;
  for (size_t i = 0; i < fd.size(); ++i) {
    const double err = std::fabs(analytic[i] - fd[i]);
    if (err > max_err) {
      max_err = err;
      worst = i;
    }
    max_fd = std::max(max_fd, std::fabs(fd[i]));
  }
  ASSERT_GT(max_fd, 0.0) << what << ": the loss does not depend on these inputs";
  EXPECT_LE(max_err, tol * max_fd)
      << what << ": max |analytic - fd| = " << max_err << " at " << worst << " (analytic "
      << analytic[worst] << ", fd " << fd[worst] << "), max |fd| = " << max_fd;
}

}  // namespace packmoe::grad_check
