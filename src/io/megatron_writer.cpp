// MegatronWriter (see megatron_writer.h): tokens are converted to the dtype into a buffer that is
// flushed to the temporary .bin every few MB; sequence lengths are kept for the index.
#include "io/megatron_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <limits>
#include <vector>

#include "io/atomic_file.h"

namespace packmoe::io {
namespace {

constexpr size_t kFlushBytes = size_t{4} << 20;

bool write_all(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

template <typename T>
void put(std::vector<uint8_t>* out, T v) {
  const size_t at = out->size();
  out->resize(at + sizeof(T));
  std::memcpy(out->data() + at, &v, sizeof(T));
}

// Bytes per token and the largest id of the integer dtypes (as token_data.cpp's table).
bool dtype_limits(MegatronDType d, uint32_t* bytes, uint64_t* max) {
  switch (d) {
    case MegatronDType::kU8: *bytes = 1, *max = 255; return true;
    case MegatronDType::kI8: *bytes = 1, *max = 127; return true;
    case MegatronDType::kI16: *bytes = 2, *max = 32767; return true;
    case MegatronDType::kU16: *bytes = 2, *max = 65535; return true;
    case MegatronDType::kI32: *bytes = 4, *max = 2147483647; return true;
    case MegatronDType::kI64: *bytes = 8, *max = std::numeric_limits<uint32_t>::max(); return true;
    default: return false;
  }
}

}  // namespace

struct MegatronWriter::State {
  std::string prefix, bin_tmp;
  MegatronDType dtype{};
  uint32_t bytes = 0;
  uint64_t max_token = 0;
  int fd = -1;
  bool failed = false, finished = false;
  std::vector<uint8_t> buffer;
  std::vector<int32_t> lengths;  // (D)
  uint64_t tokens = 0;

  ~State() {
    if (fd >= 0) ::close(fd);
    if (!finished && !bin_tmp.empty()) ::unlink(bin_tmp.c_str());
  }
  Status fail(const std::string& what) {
    failed = true;
    return Status::error(prefix + ".bin: " + what + " (nothing written)");
  }
  Status flush() {
    if (!write_all(fd, buffer.data(), buffer.size())) return fail("write failed: " + errno_text(errno));
    buffer.clear();
    return Status::ok();
  }
};

MegatronWriter::MegatronWriter(std::unique_ptr<State> s) : s_(std::move(s)) {}
MegatronWriter::MegatronWriter(MegatronWriter&&) noexcept = default;
MegatronWriter& MegatronWriter::operator=(MegatronWriter&&) noexcept = default;
MegatronWriter::~MegatronWriter() = default;

Result<MegatronWriter> MegatronWriter::create(const std::string& prefix, MegatronDType dtype) {
  auto s = std::make_unique<State>();
  s->prefix = prefix;
  s->dtype = dtype;
  if (!dtype_limits(dtype, &s->bytes, &s->max_token))
    return Status::error(prefix + ".idx: dtype code " + std::to_string(static_cast<int>(dtype)) +
                         " cannot hold token ids");
  namespace fs = std::filesystem;
  const fs::path target(prefix + ".bin");
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; attempt < 100 && s->fd < 0; ++attempt) {
    std::string name = ".";
    name += target.filename().string();
    name += ".tmp.";
    name += std::to_string(::getpid());
    name += ".";
    name += std::to_string(counter++);
    s->bin_tmp = (dir / name).string();
    s->fd = ::open(s->bin_tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (s->fd < 0 && errno != EEXIST) {
      const int err = errno;
      s->bin_tmp.clear();
      return Status::error(target.string() + ": cannot create a temporary file in '" +
                           dir.string() + "': " + errno_text(err));
    }
  }
  if (s->fd < 0) {
    s->bin_tmp.clear();
    return Status::error(target.string() + ": cannot create a temporary file: too many collisions");
  }
  s->buffer.reserve(kFlushBytes + 4096);
  return MegatronWriter(std::move(s));
}

Status MegatronWriter::add_document(std::span<const uint32_t> tokens) {
  State& s = *s_;
  PACKMOE_CHECK(!s.failed && !s.finished, "MegatronWriter used after an error or finish()");
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    return s.fail("document " + std::to_string(s.lengths.size()) + " has " +
                  std::to_string(tokens.size()) + " tokens, more than an int32 sequence length");
  for (uint32_t t : tokens) {
    if (t > s.max_token)
      return s.fail("token " + std::to_string(t) + " of document " +
                    std::to_string(s.lengths.size()) + " does not fit the dtype (largest " +
                    std::to_string(s.max_token) + ")");
    switch (s.dtype) {
      case MegatronDType::kU8: put<uint8_t>(&s.buffer, static_cast<uint8_t>(t)); break;
      case MegatronDType::kI8: put<int8_t>(&s.buffer, static_cast<int8_t>(t)); break;
      case MegatronDType::kI16: put<int16_t>(&s.buffer, static_cast<int16_t>(t)); break;
      case MegatronDType::kU16: put<uint16_t>(&s.buffer, static_cast<uint16_t>(t)); break;
      case MegatronDType::kI32: put<int32_t>(&s.buffer, static_cast<int32_t>(t)); break;
      case MegatronDType::kI64: put<int64_t>(&s.buffer, static_cast<int64_t>(t)); break;
      default: PACKMOE_CHECK(false, "dtype checked at create");
    }
    if (s.buffer.size() >= kFlushBytes) PACKMOE_RETURN_IF_ERROR(s.flush());
  }
  s.lengths.push_back(static_cast<int32_t>(tokens.size()));
  s.tokens += tokens.size();
  return Status::ok();
}

Status MegatronWriter::finish() {
  State& s = *s_;
  PACKMOE_CHECK(!s.failed && !s.finished, "MegatronWriter used after an error or finish()");
  PACKMOE_RETURN_IF_ERROR(s.flush());
  if (::fsync(s.fd) != 0) return s.fail("fsync failed: " + errno_text(errno));
  const int closed = ::close(s.fd);
  s.fd = -1;
  if (closed != 0) return s.fail("close failed: " + errno_text(errno));

  const uint64_t n = s.lengths.size();
  std::vector<uint8_t> idx(kMegatronMagic, kMegatronMagic + sizeof(kMegatronMagic));
  put<uint64_t>(&idx, kMegatronVersion);
  put<uint8_t>(&idx, static_cast<uint8_t>(s.dtype));
  put<uint64_t>(&idx, n);      // sequences
  put<uint64_t>(&idx, n + 1);  // document index entries
  for (int32_t len : s.lengths) put<int32_t>(&idx, len);
  uint64_t pointer = 0;
  for (int32_t len : s.lengths) {
    put<int64_t>(&idx, static_cast<int64_t>(pointer));
    pointer += static_cast<uint64_t>(len) * s.bytes;
  }
  for (uint64_t d = 0; d <= n; ++d) put<int64_t>(&idx, static_cast<int64_t>(d));

  // .bin first: a reader that finds the new .idx then also finds the new .bin.
  const std::string bin_path = s.prefix + ".bin";
  if (::rename(s.bin_tmp.c_str(), bin_path.c_str()) != 0)
    return s.fail("rename over the target failed: " + errno_text(errno));
  s.finished = true;
  const std::span<const uint8_t> parts[] = {idx};
  return write_file_atomic(s.prefix + ".idx", parts);
}

uint64_t MegatronWriter::documents() const { return s_->lengths.size(); }
uint64_t MegatronWriter::tokens() const { return s_->tokens; }

}  // namespace packmoe::io
