// TensorBoard event writer: hand-encoded protobuf fields (wire types 0 varint, 1 fixed64,
// 2 length-delimited, 5 fixed32, all little-endian) inside TFRecord frames.
#include "train/tensorboard.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "io/checkpoint_dir.h"

namespace packmoe::train {
namespace {

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void put_fixed(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

// Field key: (number << 3) | wire type.
void put_key(std::string& out, int field, int wire) { put_varint(out, (uint64_t(field) << 3) | wire); }

void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_double(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, 1);
  put_fixed(out, bits, 8);
}

void put_float(std::string& out, int field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, 5);
  put_fixed(out, bits, 4);
}

// Event fields 1 (wall_time) and 2 (step).
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_double(e, 1, wall_time);
  put_key(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));
  return e;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t masked_crc32c(std::span<const uint8_t> bytes) {
  const uint32_t crc = io::crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string len;
  put_fixed(len, data.size(), 8);
  auto span_of = [](std::string_view s) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  };
  std::string r = len;
  put_fixed(r, masked_crc32c(span_of(len)), 4);
  r += data;
  put_fixed(r, masked_crc32c(span_of(data)), 4);
  return r;
}

std::string version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string scalars_event(double wall_time, int64_t step, const Scalars& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    put_float(v, 2, value);
    put_bytes(summary, 1, v);
  }
  std::string e = event_head(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

Result<TensorBoardWriter> TensorBoardWriter::open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::error("--tensorboard " + dir + ": cannot create the directory: " + ec.message());
  char host[256] = "localhost";
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  host[sizeof host - 1] = '\0';
  const double now = now_seconds();
  const std::string path = (std::filesystem::path(dir) /
                            ("events.out.tfevents." + std::to_string(static_cast<long long>(now)) +
                             "." + host + "." + std::to_string(getpid())))
                               .string();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return Status::error("cannot open event file '" + path + "': " + std::strerror(errno));
  TensorBoardWriter w(f, path);
  PACKMOE_RETURN_IF_ERROR(w.append(version_event(now)));
  return w;
}

TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&& other) noexcept
    : file_(std::exchange(other.file_, nullptr)), path_(std::move(other.path_)) {}

TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&& other) noexcept {
  if (this != &other) {
    if (file_) std::fclose(file_);
    file_ = std::exchange(other.file_, nullptr);
    path_ = std::move(other.path_);
  }
  return *this;
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

Status TensorBoardWriter::write(int64_t step, const Scalars& scalars) {
  return append(scalars_event(now_seconds(), step, scalars));
}

Status TensorBoardWriter::append(const std::string& event) {
  PACKMOE_CHECK(file_ != nullptr, "write on a moved-from TensorBoardWriter");
  const std::string record = tfrecord(event);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() || std::fflush(file_) != 0)
    return Status::error("cannot write event file '" + path_ + "': " + std::strerror(errno));
  return Status::ok();
}

}  // namespace packmoe::train
