// Metrics JSONL writer/reader, Megatron-style log line, progress bar, atomic file replacement.
// The JSONL schema is flat and versionless on purpose: each line stands alone, so a reader can
// follow a file that a running trainer is still appending to.
#include "train/metrics.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <utility>

#include "core/json_limits.h"
#include "io/atomic_file.h"

namespace packmoe::train {

using nlohmann::json;

const char* split_name(Split split) { return split == Split::kTrain ? "train" : "eval"; }

namespace {

json number(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

}  // namespace

std::string metrics_record_to_json_line(const MetricsRecord& r) {
  // ordered_json keeps the fields in a reading order (step first) for people who `tail` the file.
  nlohmann::ordered_json j;
  j["step"] = r.step;
  j["split"] = split_name(r.split);
  j["loss"] = number(r.loss);
  j["lr"] = number(r.lr);
  if (r.grad_norm) j["grad_norm"] = number(*r.grad_norm);
  j["tokens_per_s"] = number(r.tokens_per_s);
  if (r.tflops) j["tflops"] = number(*r.tflops);
  if (r.mfu) j["mfu"] = number(*r.mfu);
  j["elapsed_s"] = number(r.elapsed_s);
  return j.dump();
}

Result<MetricsWriter> MetricsWriter::open(const std::string& path, bool append) {
  std::FILE* f = std::fopen(path.c_str(), append ? "ab" : "wb");
  if (!f)
    return Status::error("cannot open metrics file '" + path +
                         "' for writing: " + std::strerror(errno));
  return MetricsWriter(f, path);
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : file_(std::exchange(other.file_, nullptr)), path_(std::move(other.path_)) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& other) noexcept {
  if (this != &other) {
    if (file_) std::fclose(file_);
    file_ = std::exchange(other.file_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

Status MetricsWriter::write(const MetricsRecord& record) {
  PACKMOE_CHECK(file_ != nullptr, "write on a moved-from MetricsWriter");
  std::string line = metrics_record_to_json_line(record) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    return Status::error("cannot write metrics file '" + path_ + "': " + std::strerror(errno));
  return Status::ok();
}

namespace {

Status read_number(const json& j, const char* key, bool required, std::optional<double>& out) {
  auto it = j.find(key);
  if (it == j.end()) {
    if (required) return Status::error(std::string("missing field '") + key + "'");
    return Status::ok();
  }
  if (it->is_null()) {
    out = std::nan("");
  } else if (it->is_number()) {
    out = it->get<double>();
  } else {
    return Status::error(std::string("field '") + key + "' must be a number (got " +
                         it->type_name() + ")");
  }
  return Status::ok();
}

Status read_required(const json& j, const char* key, double& out) {
  std::optional<double> v;
  PACKMOE_RETURN_IF_ERROR(read_number(j, key, true, v));
  out = *v;
  return Status::ok();
}

}  // namespace

Result<MetricsRecord> parse_metrics_line(const std::string& line) {
  if (!check_json_text(line, "the line")) return Status::error("not valid JSON");
  json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::error("not valid JSON");
  if (!j.is_object()) return Status::error("not a JSON object");
  MetricsRecord r;
  auto step = j.find("step");
  if (step == j.end()) return Status::error("missing field 'step'");
  if (!step->is_number_integer()) return Status::error("field 'step' must be an integer");
  r.step = step->get<int64_t>();
  auto split = j.find("split");
  if (split == j.end()) return Status::error("missing field 'split'");
  if (*split == "train") {
    r.split = Split::kTrain;
  } else if (*split == "eval") {
    r.split = Split::kEval;
  } else {
    return Status::error("field 'split' must be \"train\" or \"eval\" (got " + split->dump() + ")");
  }
  PACKMOE_RETURN_IF_ERROR(read_required(j, "loss", r.loss));
  PACKMOE_RETURN_IF_ERROR(read_required(j, "lr", r.lr));
  PACKMOE_RETURN_IF_ERROR(read_required(j, "tokens_per_s", r.tokens_per_s));
  PACKMOE_RETURN_IF_ERROR(read_required(j, "elapsed_s", r.elapsed_s));
  PACKMOE_RETURN_IF_ERROR(read_number(j, "grad_norm", false, r.grad_norm));
  PACKMOE_RETURN_IF_ERROR(read_number(j, "tflops", false, r.tflops));
  PACKMOE_RETURN_IF_ERROR(read_number(j, "mfu", false, r.mfu));
  return r;
}

Result<std::vector<MetricsRecord>> read_metrics(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot open metrics file '" + path + "': " + std::strerror(errno));
  std::vector<MetricsRecord> records;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Result<MetricsRecord> r = parse_metrics_line(line);
    if (!r)
      return Status::error(path + ":" + std::to_string(number) +
                           ": malformed metrics line: " + r.status().message());
    records.push_back(std::move(r).value());
  }
  return records;
}

Status truncate_metrics_after(const std::string& path, int64_t step) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::ok();  // no file yet: nothing to drop
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  std::string kept;
  bool changed = false;
  size_t begin = 0;
  for (int64_t number = 1; begin < text.size(); ++number) {
    const size_t newline = text.find('\n', begin);
    const bool torn = newline == std::string::npos;  // the writer ends every line with '\n'
    const size_t end = torn ? text.size() : newline;
    const std::string line = text.substr(begin, end - begin);
    begin = torn ? text.size() : newline + 1;
    changed |= torn;  // a kept torn line gets its newline, so appending stays line-separated
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    Result<MetricsRecord> r = parse_metrics_line(line);
    if (!r && !torn)
      return Status::error(path + ":" + std::to_string(number) +
                           ": malformed metrics line: " + r.status().message());
    if (!r || r.value().step > step) {
      changed = true;
      continue;
    }
    kept += line + "\n";
  }
  if (!changed) return Status::ok();
  return write_file_atomically(path, kept);
}

namespace {

template <typename... Args>
std::string sprintf_string(const char* format, Args... args) {
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, format, args...);
  PACKMOE_CHECK(n >= 0 && n < static_cast<int>(sizeof buf), "formatted field too long");
  return buf;
}

}  // namespace

std::string format_log_line(const LogLine& l) {
  std::string s;
  s += sprintf_string(" iteration %8lld/%8lld |", static_cast<long long>(l.iteration),
                      static_cast<long long>(l.total_iterations));
  s += sprintf_string(" consumed samples: %12lld |", static_cast<long long>(l.consumed_samples));
  s += sprintf_string(" elapsed time per iteration (ms): %.1f |", l.ms_per_iteration);
  if (l.tflops_per_gpu)
    s += sprintf_string(" throughput per GPU (TFLOP/s/GPU): %.1f |", *l.tflops_per_gpu);
  s += sprintf_string(" learning rate: %.6E |", l.learning_rate);
  s += sprintf_string(" lm loss: %.6E |", l.lm_loss);
  if (l.load_balancing_loss)
    s += sprintf_string(" load_balancing_loss: %.2f |", *l.load_balancing_loss);
  if (l.grad_norm) s += sprintf_string(" grad norm: %.3f |", *l.grad_norm);
  s += sprintf_string(" tokens/s: %.0f |", l.tokens_per_s);
  if (l.peak_memory_gb) s += sprintf_string(" peak memory (GB): %.1f |", *l.peak_memory_gb);
  if (l.eta_s) s += " ETA " + format_duration(*l.eta_s) + " |";
  return s;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  long long s = static_cast<long long>(seconds);  // whole seconds elapsed, like tqdm
  if (s < 3600) return sprintf_string("%lld:%02lld", s / 60, s % 60);
  return sprintf_string("%lld:%02lld:%02lld", s / 3600, (s / 60) % 60, s % 60);
}

std::string progress_bar(int64_t step, int64_t total, double elapsed_s, int width) {
  PACKMOE_CHECK(total > 0 && width >= 1, "progress_bar needs total > 0 and width >= 1");
  step = std::clamp<int64_t>(step, 0, total);
  const int64_t filled = step * width / total;
  std::string bar = "[";
  bar += std::string(static_cast<size_t>(filled), '=');
  if (filled < width) {
    bar += '>';
    bar += std::string(static_cast<size_t>(width - filled - 1), ' ');
  }
  bar += "]";
  const int digits = static_cast<int>(std::to_string(total).size());
  bar += sprintf_string(" %*lld/%lld %3d%%", digits, static_cast<long long>(step),
                        static_cast<long long>(total), static_cast<int>(step * 100 / total));
  bar += ' ';
  bar += format_duration(elapsed_s);
  bar += '<';
  if (step > 0 && elapsed_s > 0) {
    bar +=
        format_duration(elapsed_s / static_cast<double>(step) * static_cast<double>(total - step));
    bar += sprintf_string(" %.2f it/s", static_cast<double>(step) / elapsed_s);
  } else {
    bar += "? ? it/s";
  }
  return bar;
}

Status write_file_atomically(const std::string& path, const std::string& contents) {
  const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(contents.data()),
                                       contents.size());
  return io::write_file_atomic(path, std::span<const std::span<const uint8_t>>(&bytes, 1));
}

}  // namespace packmoe::train
