// TensorBoard event files: a run's scalars as TFRecord-framed tensorflow.Event protobufs, the
// format TensorBoard reads (tensorflow/core/util/event.proto, framework/summary.proto). The few
// protobuf fields needed are encoded here by hand (no protobuf library): Event {wall_time = 1
// (double), step = 2 (int64), file_version = 3 (string), summary = 5 (Summary)}, Summary {value =
// 1 (repeated Value)}, Value {tag = 1 (string), simple_value = 2 (float)}. Invariant: every record
// is length (u64 little-endian), masked CRC-32C of the length, the bytes, masked CRC-32C of the
// bytes, and is flushed whole, so a reader sees complete records only (a crash may cut the last).
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace packmoe::train {

using Scalars = std::vector<std::pair<std::string, float>>;  // (tag, value), e.g. ("train/loss", x)

// TFRecord's CRC mask: ((crc >> 15) | (crc << 17)) + 0xa282ead8 of the CRC-32C of `bytes`.
uint32_t masked_crc32c(std::span<const uint8_t> bytes);
// One TFRecord around `data`.
std::string tfrecord(std::string_view data);
// The Event bytes: the file's first event (file_version "brain.Event:2"), and one event holding
// `scalars` at `step`.
std::string version_event(double wall_time);
std::string scalars_event(double wall_time, int64_t step, const Scalars& scalars);

class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) and in it a new events.out.tfevents.<unix seconds>.<host>.<pid>
  // file (TensorBoard reads every such file of a directory, so a resumed run adds one), starting
  // with the version event.
  static Result<TensorBoardWriter> open(const std::string& dir);
  TensorBoardWriter(TensorBoardWriter&& other) noexcept;
  TensorBoardWriter& operator=(TensorBoardWriter&& other) noexcept;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter();

  Status write(int64_t step, const Scalars& scalars);  // one event at the current time, flushed
  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(std::FILE* file, std::string path) : file_(file), path_(std::move(path)) {}
  Status append(const std::string& event);
  std::FILE* file_ = nullptr;
  std::string path_;
};

}  // namespace packmoe::train
