// Status / Result<T> for errors caused by user input (files, flags, shapes). The CLI prints the
// message as one line and exits non-zero. Programmer errors use PACKMOE_CHECK instead.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "core/check.h"

namespace packmoe {

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status ok() { return Status(); }
  static Status error(std::string message) { return Status(std::move(message), true); }

  bool is_ok() const { return !failed_; }
  explicit operator bool() const { return is_ok(); }
  const std::string& message() const { return message_; }

 private:
  Status(std::string message, bool failed) : message_(std::move(message)), failed_(failed) {}
  std::string message_;
  bool failed_ = false;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    PACKMOE_CHECK(!status_.is_ok(), "a Result built from a Status must carry an error");
  }

  bool is_ok() const { return value_.has_value(); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const { return status_; }
  T& value() & { PACKMOE_CHECK(is_ok(), status_.message()); return *value_; }
  const T& value() const& { PACKMOE_CHECK(is_ok(), status_.message()); return *value_; }
  T&& value() && { PACKMOE_CHECK(is_ok(), status_.message()); return std::move(*value_); }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace packmoe

// Propagate a failed Status to the caller.
#define PACKMOE_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    auto packmoe_status_ = (expr);                     \
    if (!packmoe_status_.is_ok()) return packmoe_status_; \
  } while (0)
