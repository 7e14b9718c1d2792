// Checkpoint directory protocol (see checkpoint_dir.h). Directories leave the step-* namespace only
// by an atomic rename to a .tmp-* name, so a crash during a replace or a delete never leaves a
// half-removed step-* directory; .tmp-* directories carry the writer's pid, and those of pids that
// no longer run on this host are removed by the next commit.
#include "io/checkpoint_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "core/json_limits.h"
#include "io/atomic_file.h"
#include "io/read_progress.h"
#include "io/state_file.h"

namespace packmoe::io {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kMarkerFormat = "packmoe-checkpoint";
constexpr int kMarkerVersion = 1;
constexpr std::string_view kStepPrefix = "step-";
constexpr std::string_view kTmpPrefix = ".tmp-step-";

// Slicing-by-8 tables: kCrcTables[0] is the byte-wise table of the reflected polynomial,
// kCrcTables[k][i] advances kCrcTables[k-1][i] by one more zero byte.
constexpr std::array<std::array<uint32_t, 256>, 8> make_crc_tables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int b = 0; b < 8; ++b) c = (c >> 1) ^ ((c & 1u) ? 0x82F63B78u : 0u);
    t[0][i] = c;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFFu];
  }
  return t;
}
constexpr auto kCrcTables = make_crc_tables();

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// The step of a canonical "step-N" name (exactly what checkpoint_dir_name(N) gives), else none.
std::optional<int64_t> parse_step_name(const std::string& name) {
  if (name.size() <= kStepPrefix.size() || name.compare(0, kStepPrefix.size(), kStepPrefix) != 0) {
    return std::nullopt;
  }
  const std::string digits = name.substr(kStepPrefix.size());
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), is_digit))
    return std::nullopt;
  const int64_t step = std::stoll(digits);
  if (checkpoint_dir_name(step) != name) return std::nullopt;
  return step;
}

// The writer pid of ".tmp-step-<digits>-<pid>[-<suffix>]", else none.
std::optional<pid_t> parse_tmp_pid(const std::string& name) {
  if (name.compare(0, kTmpPrefix.size(), kTmpPrefix) != 0) return std::nullopt;
  size_t i = kTmpPrefix.size();
  const size_t step_begin = i;
  while (i < name.size() && is_digit(name[i])) ++i;
  if (i == step_begin || i >= name.size() || name[i] != '-') return std::nullopt;
  const size_t pid_begin = ++i;
  while (i < name.size() && is_digit(name[i])) ++i;
  if (i == pid_begin || i - pid_begin > 9 || (i < name.size() && name[i] != '-'))
    return std::nullopt;
  return static_cast<pid_t>(std::stol(name.substr(pid_begin, i - pid_begin)));
}

// Whether `pid` runs on this host. kill(pid, 0) succeeds for a zombie too: a process that died
// (e.g. a rank killed mid-save) but that no parent has reaped yet, which can take seconds in a
// container; /proc/<pid>/stat's state 'Z' counts as not running.
bool process_running(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;  // no /proc: kill's answer stands
  const size_t name_end = line.rfind(')');     // "pid (comm) state ..."; comm may hold ')'
  return name_end == std::string::npos || name_end + 2 >= line.size() || line[name_end + 2] != 'Z';
}

std::string tmp_name(int64_t step, const std::string& suffix = "") {
  std::string name(kTmpPrefix);
  name += checkpoint_dir_name(step).substr(kStepPrefix.size());
  // Appended piecewise: GCC 12 gives a false -Wrestrict on the chained operator+ form.
  name += '-';
  name += std::to_string(::getpid());
  if (!suffix.empty()) {
    name += '-';
    name += suffix;
  }
  return name;
}

bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

Status fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return Status::error(path + ": cannot open to fsync: " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::error(path + ": fsync failed: " + errno_text(err));
  return Status::ok();
}

// Size and CRC-32C of a regular file, optionally fsync'ing it on the way.
Status scan_file(const std::string& path, bool sync, uint64_t* bytes, uint32_t* crc) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return Status::error(path + ": cannot open: " + errno_text(errno));
  std::vector<uint8_t> buf(size_t{4} << 20);
  uint64_t n = 0;
  uint32_t c = 0;
  for (;;) {
    const ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      ::close(fd);
      return Status::error(path + ": read failed: " + errno_text(err));
    }
    if (r == 0) break;
    c = crc32c(std::span<const uint8_t>(buf.data(), static_cast<size_t>(r)), c);
    n += static_cast<uint64_t>(r);
    ReadProgress::add(static_cast<uint64_t>(r));
  }
  if (sync && ::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::error(path + ": fsync failed: " + errno_text(err));
  }
  ::close(fd);
  *bytes = n;
  *crc = c;
  return Status::ok();
}

// Parses a marker already read from `marker_path` (the error prefix).
Result<CheckpointInfo> parse_marker(const Json& m, const std::string& marker_path) {
  auto bad = [&](const std::string& why) { return Status::error(marker_path + ": " + why); };
  if (!m.is_object()) return bad("not a JSON object");
  if (m.value("format", Json()) != kMarkerFormat) {
    return bad(std::string("\"format\" is not \"") + kMarkerFormat + "\"");
  }
  const Json version = m.value("version", Json());
  if (!version.is_number_integer() || version.get<int64_t>() != kMarkerVersion) {
    return bad("unsupported \"version\" " + json_brief(version) + " (this build reads " +
               std::to_string(kMarkerVersion) + ")");
  }
  const Json step = m.value("step", Json());
  if (!step.is_number_integer() || step.get<int64_t>() < 0) {
    return bad("\"step\" is not a non-negative integer");
  }
  const Json files = m.value("files", Json());
  if (!files.is_array()) return bad("\"files\" is not an array");
  CheckpointInfo info;
  info.step = step.get<int64_t>();
  std::set<std::string> seen;
  for (const Json& f : files) {
    if (!f.is_object()) return bad("a \"files\" entry is not an object");
    const Json name = f.value("name", Json());
    const Json bytes = f.value("bytes", Json());
    const Json crc = f.value("crc32c", Json());
    if (!name.is_string() || !plain_file_name(name.get<std::string>()) ||
        name.get<std::string>() == kCheckpointMarker) {
      return bad("a \"files\" entry has no valid \"name\"");
    }
    const std::string n = name.get<std::string>();
    if (!seen.insert(n).second) return bad("file " + Json(n).dump() + " is listed twice");
    if (!bytes.is_number_unsigned())
      return bad("file " + Json(n).dump() + " has no valid \"bytes\"");
    const std::string c = crc.is_string() ? crc.get<std::string>() : "";
    if (c.size() != 8 || !std::all_of(c.begin(), c.end(), [](char ch) {
          return is_digit(ch) || (ch >= 'a' && ch <= 'f');
        })) {
      return bad("file " + Json(n).dump() + " has no valid \"crc32c\" (8 lower-case hex digits)");
    }
    info.files.push_back(
        {n, bytes.get<uint64_t>(), static_cast<uint32_t>(std::stoul(c, nullptr, 16))});
  }
  std::sort(info.files.begin(), info.files.end(),
            [](const CheckpointFile& a, const CheckpointFile& b) { return a.name < b.name; });
  return info;
}

// The marker of `dir` parsed, without looking at the files (used to count checkpoints to keep).
Result<CheckpointInfo> read_marker(const std::string& dir) {
  const std::string marker = (fs::path(dir) / kCheckpointMarker).string();
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(marker, ec))) {
    return Status::error(dir + ": no " + kCheckpointMarker +
                         " (an unfinished or damaged checkpoint)");
  }
  Result<Json> m = read_json_file(marker);
  if (!m) return m.status();
  Result<CheckpointInfo> info = parse_marker(m.value(), marker);
  if (!info) return info;
  info.value().dir = dir;
  return info;
}

// step -> directory of every canonical step-* directory under `root`.
Result<std::vector<std::pair<int64_t, std::string>>> list_steps(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) return Status::error(root + ": cannot list: " + ec.message());
  for (const fs::directory_entry& e : it) {
    const std::optional<int64_t> step = parse_step_name(e.path().filename().string());
    if (step && e.is_directory(ec)) out.emplace_back(*step, e.path().string());
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

}  // namespace

uint32_t crc32c(std::span<const uint8_t> bytes, uint32_t crc) {
  const auto& t = kCrcTables;
  uint32_t c = ~crc;
  const uint8_t* p = bytes.data();
  size_t n = bytes.size();
  for (; n >= 8; p += 8, n -= 8) {
    uint32_t lo, hi;  // the next 8 bytes as two little-endian words
    lo = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
    hi = uint32_t{p[4]} | uint32_t{p[5]} << 8 | uint32_t{p[6]} << 16 | uint32_t{p[7]} << 24;
    lo ^= c;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; n > 0; ++p, --n) c = t[0][(c ^ *p) & 0xFF] ^ (c >> 8);
  return ~c;
}

std::string checkpoint_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

// ---- CheckpointWriter ---------------------------------------------------------------------------

Result<CheckpointWriter> CheckpointWriter::begin(const std::string& root, int64_t step,
                                                 int keep_last) {
  if (step < 0) return Status::error(root + ": checkpoint step " + std::to_string(step) + " < 0");
  if (keep_last < 1) {
    return Status::error(root + ": keep_last = " + std::to_string(keep_last) + " must be >= 1");
  }
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return Status::error(root + ": cannot create the checkpoint directory: " + ec.message());
  if (!fs::is_directory(root, ec)) return Status::error(root + ": not a directory");
  CheckpointWriter w;
  w.root_ = root;
  w.step_ = step;
  w.keep_last_ = keep_last;
  const std::string tmp = (fs::path(root) / tmp_name(step)).string();
  if (::mkdir(tmp.c_str(), 0777) != 0) {
    return Status::error(tmp + ": cannot create: " + errno_text(errno));
  }
  w.tmp_dir_ = tmp;
  return w;
}

CheckpointWriter::CheckpointWriter(CheckpointWriter&& other) noexcept
    : root_(std::move(other.root_)),
      tmp_dir_(std::exchange(other.tmp_dir_, std::string())),
      step_(other.step_),
      keep_last_(other.keep_last_) {}

CheckpointWriter& CheckpointWriter::operator=(CheckpointWriter&& other) noexcept {
  if (this != &other) {
    abort();
    root_ = std::move(other.root_);
    tmp_dir_ = std::exchange(other.tmp_dir_, std::string());
    step_ = other.step_;
    keep_last_ = other.keep_last_;
  }
  return *this;
}

CheckpointWriter::~CheckpointWriter() { abort(); }

std::string CheckpointWriter::path(const std::string& file_name) const {
  PACKMOE_CHECK(!tmp_dir_.empty(), "the checkpoint writer was already committed or aborted");
  return (fs::path(tmp_dir_) / file_name).string();
}

void CheckpointWriter::abort() {
  if (tmp_dir_.empty()) return;
  std::error_code ec;
  fs::remove_all(tmp_dir_, ec);  // best effort: a leftover is removed by a later commit
  tmp_dir_.clear();
}

Result<CheckpointWriter::Committed> CheckpointWriter::commit() {
  PACKMOE_CHECK(!tmp_dir_.empty(), "the checkpoint writer was already committed or aborted");
  auto fail = [&](Status s) {
    abort();
    return s;
  };
  std::error_code ec;

  // 1. Every file to disk, with its size and checksum.
  std::vector<std::string> names;
  fs::directory_iterator it(tmp_dir_, ec);
  if (ec) return fail(Status::error(tmp_dir_ + ": cannot list: " + ec.message()));
  for (const fs::directory_entry& e : it) {
    const std::string name = e.path().filename().string();
    if (name == kCheckpointMarker) {
      return fail(Status::error(e.path().string() + ": the name is reserved for the marker"));
    }
    if (!e.is_regular_file(ec) || e.is_symlink(ec)) {
      return fail(Status::error(e.path().string() +
                                ": not a regular file (a checkpoint holds only files)"));
    }
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  Committed done;
  done.info.step = step_;
  Json files = Json::array();
  for (const std::string& name : names) {
    CheckpointFile f{name, 0, 0};
    Status s = scan_file((fs::path(tmp_dir_) / name).string(), /*sync=*/true, &f.bytes, &f.crc32c);
    if (!s) return fail(s);
    files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"crc32c", hex32(f.crc32c)}});
    done.info.files.push_back(std::move(f));
  }

  // 2. The marker, then the directory entries.
  const Json marker = {
      {"format", kMarkerFormat}, {"version", kMarkerVersion}, {"step", step_}, {"files", files}};
  if (Status s = write_json_file((fs::path(tmp_dir_) / kCheckpointMarker).string(), marker); !s) {
    return fail(s);
  }
  if (Status s = fsync_path(tmp_dir_, true); !s) return fail(s);

  // 3. Publish: an existing directory of this step is first renamed out of the step-* namespace.
  const std::string target = (fs::path(root_) / checkpoint_dir_name(step_)).string();
  std::string replaced;
  if (fs::exists(fs::symlink_status(target, ec))) {
    replaced = (fs::path(root_) / tmp_name(step_, "replaced")).string();
    fs::remove_all(replaced, ec);
    if (::rename(target.c_str(), replaced.c_str()) != 0) {
      return fail(Status::error(
          target + ": cannot move the existing checkpoint aside: " + errno_text(errno)));
    }
  }
  if (::rename(tmp_dir_.c_str(), target.c_str()) != 0) {
    const int err = errno;
    if (!replaced.empty()) (void)::rename(replaced.c_str(), target.c_str());
    return fail(
        Status::error(target + ": cannot rename " + tmp_dir_ + " into place: " + errno_text(err)));
  }
  tmp_dir_.clear();
  done.info.dir = target;
  // The checkpoint is in place; a failed fsync of ROOT means a power loss could still undo the
  // rename, which the caller should hear about, but the checkpoint is complete either way.
  if (Status s = fsync_path(root_, true); !s) done.warnings.push_back(s.message());

  // 4. Clean-up; failures here are reported but do not undo the commit.
  auto remove_dir = [&](const std::string& dir, const std::string& shown) {
    std::error_code rec;
    fs::remove_all(dir, rec);
    if (rec) {
      done.warnings.push_back(dir + ": cannot remove: " + rec.message());
    } else {
      done.removed.push_back(shown);
    }
  };
  if (!replaced.empty()) remove_dir(replaced, replaced);
  Result<std::vector<std::pair<int64_t, std::string>>> steps = list_steps(root_);
  if (!steps) {
    done.warnings.push_back(steps.status().message());
    return done;
  }
  // Only checkpoints that verify count as kept (the one just committed does): a damaged newer one
  // must not cost a good older one its place. One among the kept stays (evidence of the damage).
  int kept = 0;
  for (const auto& [step, dir] : steps.value()) {
    if (step > step_ || !read_marker(dir)) continue;  // newer runs' and foreign dirs stay
    if (kept < keep_last_) {
      if (step == step_ || verify_checkpoint(dir)) ++kept;
      continue;
    }
    const std::string doomed = (fs::path(root_) / tmp_name(step, "old")).string();
    if (::rename(dir.c_str(), doomed.c_str()) != 0) {
      done.warnings.push_back(dir + ": cannot remove: " + errno_text(errno));
      continue;
    }
    remove_dir(doomed, dir);
  }
  fs::directory_iterator rit(root_, ec);
  if (ec) {
    done.warnings.push_back(root_ + ": cannot list: " + ec.message());
    return done;
  }
  std::vector<std::string> stale;
  for (const fs::directory_entry& e : rit) {
    const std::optional<pid_t> pid = parse_tmp_pid(e.path().filename().string());
    if (!pid || *pid == ::getpid()) continue;
    if (!process_running(*pid)) stale.push_back(e.path().string());
  }
  for (const std::string& dir : stale) remove_dir(dir, dir);
  return done;
}

// ---- reading
// -------------------------------------------------------------------------------------

Result<CheckpointInfo> verify_checkpoint(const std::string& dir) {
  Result<CheckpointInfo> read = read_marker(dir);
  if (!read) return read;
  CheckpointInfo& info = read.value();
  const std::optional<int64_t> named = parse_step_name(fs::path(dir).filename().string());
  if (named && *named != info.step) {
    return Status::error(dir + ": " + kCheckpointMarker + " records step " +
                         std::to_string(info.step) + ", the directory name says " +
                         std::to_string(*named));
  }
  std::error_code ec;
  for (const CheckpointFile& f : info.files) {
    const fs::path p = fs::path(dir) / f.name;
    const fs::file_status st = fs::symlink_status(p, ec);
    if (!fs::exists(st)) {
      return Status::error(p.string() + ": missing (listed in " + kCheckpointMarker + ")");
    }
    if (!fs::is_regular_file(st)) return Status::error(p.string() + ": not a regular file");
    const uint64_t size = fs::file_size(p, ec);
    if (ec) return Status::error(p.string() + ": cannot stat: " + ec.message());
    if (size != f.bytes) {
      return Status::error(p.string() + ": " + std::to_string(size) + " bytes, " +
                           kCheckpointMarker + " records " + std::to_string(f.bytes) +
                           (size < f.bytes ? " (truncated?)" : " (appended to?)"));
    }
  }
  std::set<std::string> listed;
  for (const CheckpointFile& f : info.files) listed.insert(f.name);
  fs::directory_iterator it(dir, ec);
  if (ec) return Status::error(dir + ": cannot list: " + ec.message());
  for (const fs::directory_entry& e : it) {
    const std::string name = e.path().filename().string();
    if (name != kCheckpointMarker && !listed.count(name)) {
      return Status::error(e.path().string() + ": not listed in " + kCheckpointMarker);
    }
  }
  for (const CheckpointFile& f : info.files) {
    const std::string p = (fs::path(dir) / f.name).string();
    uint64_t bytes = 0;
    uint32_t crc = 0;
    PACKMOE_RETURN_IF_ERROR(scan_file(p, /*sync=*/false, &bytes, &crc));
    if (bytes != f.bytes) {
      return Status::error(p + ": changed size while being read (" + std::to_string(bytes) +
                           " bytes, " + kCheckpointMarker + " records " + std::to_string(f.bytes) +
                           ")");
    }
    if (crc != f.crc32c) {
      return Status::error(p + ": CRC-32C " + hex32(crc) + " does not match " + hex32(f.crc32c) +
                           " recorded in " + kCheckpointMarker + " (corrupted)");
    }
  }
  return read;
}

Result<std::vector<std::string>> checkpoint_dirs(const std::string& root) {
  std::error_code ec;
  if (!fs::exists(fs::status(root, ec))) return std::vector<std::string>{};
  Result<std::vector<std::pair<int64_t, std::string>>> steps = list_steps(root);
  if (!steps) return steps.status();
  std::vector<std::string> out;
  for (auto& [step, dir] : steps.value()) out.push_back(std::move(dir));
  return out;
}

Status remove_checkpoints(const std::string& root) {
  Result<std::vector<std::string>> dirs = checkpoint_dirs(root);
  if (!dirs) return dirs.status();
  for (const std::string& d : dirs.value()) {
    std::error_code ec;
    fs::remove_all(d, ec);
    if (ec) return Status::error(d + ": cannot remove: " + ec.message());
  }
  return Status::ok();
}

Result<LatestCheckpoint> latest_checkpoint(const std::string& root) {
  LatestCheckpoint out;
  std::error_code ec;
  const fs::file_status st = fs::status(root, ec);
  if (!fs::exists(st)) return out;
  if (!fs::is_directory(st)) return Status::error(root + ": not a directory");
  Result<std::vector<std::pair<int64_t, std::string>>> steps = list_steps(root);
  if (!steps) return steps.status();
  for (const auto& [step, dir] : steps.value()) {
    Result<CheckpointInfo> info = verify_checkpoint(dir);
    if (info) {
      out.found = std::move(info.value());
      break;
    }
    out.skipped.push_back(info.status().message());
  }
  return out;
}

}  // namespace packmoe::io
