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

// |analytic_i - fd_i| <= tol * max |fd| + bound_i for every i: bound_i is what a known, counted
// rounding can move element i (e.g. a BF16 intermediate the analytic gradient reads), tol the
// FP32 arithmetic's share; the worst element by its excess printed on failure.
inline void expect_grad_within(const char* what, const std::vector<float>& analytic,
                               const std::vector<double>& fd, double tol,
                               const std::vector<double>& bound) {
  ASSERT_EQ(analytic.size(), fd.size()) << what;
  ASSERT_EQ(bound.size(), fd.size()) << what;
  double max_fd = 0;
  for (double v : fd) max_fd = std::max(max_fd, std::fabs(v));
  ASSERT_GT(max_fd, 0.0) << what << ": the loss does not depend on these inputs";
  double worst_excess = -1;
  size_t worst = 0;
  for (size_t i = 0; i < fd.size(); ++i) {
    const double excess = std::fabs(analytic[i] - fd[i]) - (tol * max_fd + bound[i]);
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  EXPECT_LE(worst_excess, 0.0) << what << ": |analytic - fd| = "
                               << std::fabs(analytic[worst] - fd[worst]) << " at " << worst
                               << " (analytic " << analytic[worst] << ", fd " << fd[worst]
                               << ") over tol * max |fd| = " << tol * max_fd << " + bound "
                               << bound[worst];
}

}  // namespace packmoe::grad_check
