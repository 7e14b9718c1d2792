// ProgressLine (tools/progress_line.h): "\r" + the line + erase-to-end, on stderr.
#include "tools/progress_line.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "dist/communicator.h"
#include "train/metrics.h"

namespace packmoe::tools {
namespace {

double seconds_between(std::chrono::steady_clock::time_point a,
                       std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

std::string short_count(int64_t n) {
  char buf[32];
  const double v = static_cast<double>(n);
  if (n >= 1000000000)
    std::snprintf(buf, sizeof buf, "%.1fB", v / 1e9);
  else if (n >= 1000000)
    std::snprintf(buf, sizeof buf, "%.0fM", v / 1e6);
  else if (n >= 1000)
    std::snprintf(buf, sizeof buf, "%.0fK", v / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  return buf;
}

std::string short_bytes(double bytes) {
  char buf[32];
  if (bytes >= 1e9)
    std::snprintf(buf, sizeof buf, "%.1f GB", bytes / 1e9);
  else
    std::snprintf(buf, sizeof buf, "%.0f MB", bytes / 1e6);
  return buf;
}

bool ProgressLine::wanted() { return !launched_by_mpirun() && isatty(STDERR_FILENO) != 0; }

ProgressLine::ProgressLine(std::string label, uint64_t total_bytes, bool enabled)
    : label_(std::move(label)),
      total_(total_bytes),
      enabled_(enabled),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {
  draw(0);
}

ProgressLine::~ProgressLine() {
  if (!enabled_) return;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
}

double ProgressLine::seconds() const {
  return seconds_between(start_, std::chrono::steady_clock::now());
}

void ProgressLine::update(uint64_t bytes) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (seconds_between(last_draw_, now) < 0.1) return;
  last_draw_ = now;
  draw(bytes);
}

void ProgressLine::draw(uint64_t bytes) {
  if (!enabled_) return;
  const double t = seconds();
  std::string line = "\r\033[K  " + label_;
  if (total_ > 0) {
    constexpr int kWidth = 24;
    const double f = std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total_));
    const int filled = static_cast<int>(f * kWidth);
    // The training bar's look (train/metrics.h progress_bar).
    line += "  [";
    line.append(static_cast<size_t>(filled), '=');
    if (filled < kWidth) {
      line += '>';
      line.append(static_cast<size_t>(kWidth - filled - 1), ' ');
    }
    line += ']';
    char buf[160];
    const double rate = t > 0 ? static_cast<double>(bytes) / t : 0;
    std::snprintf(buf, sizeof buf, " %3.0f%%  %s / %s  %s/s", 100 * f,
                  short_bytes(static_cast<double>(bytes)).c_str(),
                  short_bytes(static_cast<double>(total_)).c_str(), short_bytes(rate).c_str());
    line += buf;
    if (rate > 0 && f < 1)
      line += "  ETA " + train::format_duration((static_cast<double>(total_) - bytes) / rate);
  } else {
    line += " ...";
  }
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

}  // namespace packmoe::tools
