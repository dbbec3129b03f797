// Status and StatusOr: the error type of every ejkernel entry point.
// Entry points validate their inputs and return a Status instead of crashing.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace ejk {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kUnimplemented,
  kResourceExhausted,
  kFailedPrecondition,
  kInternal,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
  static Status ResourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
  static Status FailedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message"
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {}  // NOLINT: implicit by design
  StatusOr(T value) : value_(std::move(value)) {}          // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace ejk

#define EJK_STATUS_CONCAT_INNER(a, b) a##b
#define EJK_STATUS_CONCAT(a, b) EJK_STATUS_CONCAT_INNER(a, b)

#define EJK_RETURN_IF_ERROR(expr)                      \
  do {                                                 \
    ::ejk::Status ejk_status_tmp_ = (expr);            \
    if (!ejk_status_tmp_.ok()) return ejk_status_tmp_; \
  } while (0)

#define EJK_ASSIGN_OR_RETURN(lhs, expr)                                        \
  auto EJK_STATUS_CONCAT(ejk_statusor_, __LINE__) = (expr);                    \
  if (!EJK_STATUS_CONCAT(ejk_statusor_, __LINE__).ok())                        \
    return EJK_STATUS_CONCAT(ejk_statusor_, __LINE__).status();                \
  lhs = std::move(EJK_STATUS_CONCAT(ejk_statusor_, __LINE__)).value()
