// TensorBoard event files (train/tensorboard.h) against the format's spec, decoded by a reader
// written in THIS file: TFRecord frames (u64 length, masked CRC-32C of it, data, masked CRC-32C
// of the data) checked with a bit-by-bit CRC-32C of its own (checked on the standard vector), and
// the Event / Summary / Value protobuf fields parsed from the wire format. Fresh random scalars.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/test_files.h"
#include "train/tensorboard.h"

namespace packmoe::train {
namespace {

// CRC-32C bit by bit: reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF.
uint32_t crc32c_bitwise(const uint8_t* p, size_t n) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return crc ^ 0xFFFFFFFFu;
}

uint32_t mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint64_t le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

// The records of a TFRecord file; every CRC checked.
std::vector<std::string> read_records(const std::vector<uint8_t>& f) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < f.size()) {
    EXPECT_GE(f.size() - at, 12u) << "truncated header at " << at;
    if (f.size() - at < 12) break;
    const uint64_t len = le(&f[at], 8);
    EXPECT_EQ(le(&f[at + 8], 4), mask(crc32c_bitwise(&f[at], 8))) << "length CRC at " << at;
    EXPECT_GE(f.size() - at - 12, len + 4) << "truncated record at " << at;
    if (f.size() - at - 12 < len + 4) break;
    const uint8_t* data = &f[at + 12];
    EXPECT_EQ(le(data + len, 4), mask(crc32c_bitwise(data, len))) << "data CRC at " << at;
    out.emplace_back(reinterpret_cast<const char*>(data), len);
    at += 12 + len + 4;
  }
  return out;
}

// A minimal protobuf reader: (field, wire type) -> the raw value (varint / fixed as integer bits,
// length-delimited as bytes).
struct Field {
  int number, wire;
  uint64_t bits = 0;
  std::string bytes;
};

std::vector<Field> parse(const std::string& m) {
  std::vector<Field> fields;
  size_t i = 0;
  auto varint = [&] {
    uint64_t v = 0;
    for (int shift = 0; i < m.size(); shift += 7) {
      const uint8_t b = static_cast<uint8_t>(m[i++]);
      v |= uint64_t{b & 0x7Fu} << shift;
      if (!(b & 0x80)) break;
    }
    return v;
  };
  while (i < m.size()) {
    const uint64_t key = varint();
    Field f{static_cast<int>(key >> 3), static_cast<int>(key & 7), 0, {}};
    if (f.wire == 0) {
      f.bits = varint();
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      f.bits = le(reinterpret_cast<const uint8_t*>(m.data() + i), n);
      i += n;
    } else if (f.wire == 2) {
      const uint64_t n = varint();
      f.bytes = m.substr(i, n);
      i += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      break;
    }
    fields.push_back(f);
  }
  return fields;
}

struct Event {
  double wall_time = 0;
  int64_t step = -1;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
};

Event decode_event(const std::string& bytes) {
  Event e;
  for (const Field& f : parse(bytes)) {
    if (f.number == 1 && f.wire == 1) {
      std::memcpy(&e.wall_time, &f.bits, 8);
    } else if (f.number == 2 && f.wire == 0) {
      e.step = static_cast<int64_t>(f.bits);
    } else if (f.number == 3 && f.wire == 2) {
      e.file_version = f.bytes;
    } else if (f.number == 5 && f.wire == 2) {
      for (const Field& v : parse(f.bytes)) {
        EXPECT_TRUE(v.number == 1 && v.wire == 2) << "Summary holds only values";
        std::string tag;
        float value = NAN;
        for (const Field& x : parse(v.bytes)) {
          if (x.number == 1 && x.wire == 2) tag = x.bytes;
          if (x.number == 2 && x.wire == 5) {
            const uint32_t b = static_cast<uint32_t>(x.bits);
            std::memcpy(&value, &b, 4);
          }
        }
        e.values.emplace_back(tag, value);
      }
    } else {
      ADD_FAILURE() << "unexpected Event field " << f.number;
    }
  }
  return e;
}

TEST(TensorBoard, ReferenceCrcOnTheStandardVector) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c_bitwise(reinterpret_cast<const uint8_t*>(s), 9), 0xE3069283u);
  EXPECT_EQ(masked_crc32c({reinterpret_cast<const uint8_t*>(s), 9}), mask(0xE3069283u));
}

TEST(TensorBoard, OneScalarEventHasTheSpecsBytes) {
  // Hand-encoded: Event{wall_time 1.0 (09 + 8 bytes), step 300 (10 ac 02), summary (2a len)
  // {value (0a len) {tag "a" (0a 01 61), simple_value 2.0f (15 00 00 00 40)}}}.
  const std::string want = std::string("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f", 9) +
                           std::string("\x10\xac\x02", 3) +
                           std::string("\x2a\x0a\x0a\x08\x0a\x01\x61\x15\x00\x00\x00\x40", 12);
  EXPECT_EQ(scalars_event(1.0, 300, {{"a", 2.0f}}), want);
}

TEST(TensorBoard, WriterFileDecodesWithValidCrcs) {
  const std::filesystem::path dir = test::make_test_dir("tensorboard_");
  std::mt19937_64 rng(test::recorded_random_seed());
  std::uniform_real_distribution<float> u(-10.0f, 10.0f);
  std::map<int64_t, Scalars> written;
  std::string path;
  {
    Result<TensorBoardWriter> w = TensorBoardWriter::open((dir / "tb").string());
    ASSERT_TRUE(w.is_ok()) << w.status().message();
    path = w.value().path();
    for (int64_t step = 1; step <= 20; ++step) {
      Scalars s = {{"train/loss", u(rng)}, {"train/lr", u(rng)}};
      if (step % 5 == 0) s.emplace_back("eval/loss", u(rng));
      written[step] = s;
      ASSERT_TRUE(w.value().write(step, s).is_ok());
    }
  }
  EXPECT_NE(std::filesystem::path(path).filename().string().find("events.out.tfevents."),
            std::string::npos);
  const std::vector<std::string> records = read_records(test::read_raw(path));
  ASSERT_EQ(records.size(), 21u);
  const Event first = decode_event(records[0]);
  EXPECT_EQ(first.file_version, "brain.Event:2");
  EXPECT_GT(first.wall_time, 1.7e9);
  for (size_t i = 1; i < records.size(); ++i) {
    const Event e = decode_event(records[i]);
    ASSERT_EQ(written.count(e.step), 1u) << "step " << e.step;
    const Scalars& want = written[e.step];
    ASSERT_EQ(e.values.size(), want.size());
    for (size_t j = 0; j < want.size(); ++j) {
      EXPECT_EQ(e.values[j].first, want[j].first);
      EXPECT_EQ(e.values[j].second, want[j].second);
    }
    EXPECT_GE(e.wall_time, first.wall_time - 1.0);
  }
  // A flipped data byte is caught by the reader's CRC.
  std::vector<uint8_t> bad = test::read_raw(path);
  bad[bad.size() - 6] ^= 1;
  EXPECT_NONFATAL_FAILURE(read_records(bad), "data CRC");
  test::remove_test_dir(dir);
}

}  // namespace
}  // namespace packmoe::train
