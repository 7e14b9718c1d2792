// ProgressLine: one status line on stderr for a long start-up phase of `packmoe train` (reading a
// checkpoint or Hugging Face weights, building the model), redrawn in place while stderr is a
// terminal — with a known byte total a bar, bytes/s and ETA — and erased when the phase ends.
// Invariant: it prints nothing unless enabled (stderr a terminal, one process): a log keeps only
// the summary lines printed after the start-up succeeded, and a bad input stays one error line.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace packmoe::tools {

class ProgressLine {
 public:
  // total_bytes 0: no bar, "label ..." until the phase ends.
  ProgressLine(std::string label, uint64_t total_bytes, bool enabled);
  ~ProgressLine();  // erases the line
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Redraws with `bytes` done (at most ~10 times a second).
  void update(uint64_t bytes);
  double seconds() const;

  // Whether a `packmoe train` process draws progress lines: stderr is a terminal, not under
  // mpirun (whose ranks see pseudo-terminals even when the job's output goes to a file).
  static bool wanted();

 private:
  void draw(uint64_t bytes);

  std::string label_;
  uint64_t total_;
  bool enabled_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// "3.1B", "102M", "107K", "512": a count for a status line.
std::string short_count(int64_t n);
// "12.4 GB", "356 MB": bytes for a status line (powers of 1000).
std::string short_bytes(double bytes);

}  // namespace packmoe::tools
