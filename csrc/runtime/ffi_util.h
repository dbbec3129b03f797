// Glue between XLA FFI buffers and ejkernel's TensorViews and Status.
#pragma once

#include <cstdint>

#include "runtime/status.h"
#include "runtime/tensor.h"
#include "xla/ffi/api/ffi.h"

#define EJK_EXPORT extern "C" __attribute__((visibility("default")))

namespace ejk {

inline StatusOr<DType> DTypeFromFfi(xla::ffi::DataType t) {
  using xla::ffi::DataType;
  switch (t) {
    case DataType::F32: return DType::kF32;
    case DataType::F16: return DType::kF16;
    case DataType::BF16: return DType::kBF16;
    case DataType::F64: return DType::kF64;
    case DataType::S32: return DType::kI32;
    case DataType::S64: return DType::kI64;
    case DataType::U32: return DType::kU32;
    case DataType::U8: return DType::kU8;
    case DataType::PRED: return DType::kBool;
    case DataType::F8E4M3FN: return DType::kF8E4M3;
    default: return Status::InvalidArgument("unsupported XLA element type");
  }
}

// A contiguous view of an FFI buffer (XLA passes row-major buffers to FFI custom calls).
inline StatusOr<TensorView> ViewOf(const xla::ffi::AnyBuffer& b, const char* name) {
  StatusOr<DType> dtype = DTypeFromFfi(b.element_type());
  if (!dtype.ok()) return Status::InvalidArgument(std::string(name) + ": " + dtype.status().message());
  auto dims = b.dimensions();
  if (dims.size() > static_cast<size_t>(kMaxRank)) {
    return Status::InvalidArgument(std::string(name) + ": rank above " + std::to_string(kMaxRank));
  }
  return TensorView::Contiguous(b.untyped_data(), *dtype, dims.begin(), static_cast<int>(dims.size()));
}

// Optional operands travel as zero-element placeholders; those become absent views.
inline StatusOr<TensorView> OptionalViewOf(const xla::ffi::AnyBuffer& b, const char* name, bool present) {
  if (!present) return TensorView{};
  return ViewOf(b, name);
}

inline xla::ffi::Error ToFfiError(const Status& s) {
  if (s.ok()) return xla::ffi::Error::Success();
  using xla::ffi::ErrorCode;
  ErrorCode code = ErrorCode::kInternal;
  switch (s.code()) {
    case StatusCode::kInvalidArgument: code = ErrorCode::kInvalidArgument; break;
    case StatusCode::kNotFound: code = ErrorCode::kNotFound; break;
    case StatusCode::kUnimplemented: code = ErrorCode::kUnimplemented; break;
    case StatusCode::kResourceExhausted: code = ErrorCode::kResourceExhausted; break;
    case StatusCode::kFailedPrecondition: code = ErrorCode::kFailedPrecondition; break;
    default: break;
  }
  return xla::ffi::Error(code, s.message());
}

}  // namespace ejk

#define EJK_FFI_ASSIGN_OR_RETURN(lhs, expr)                                    \
  auto EJK_STATUS_CONCAT(ejk_ffi_or_, __LINE__) = (expr);                      \
  if (!EJK_STATUS_CONCAT(ejk_ffi_or_, __LINE__).ok())                          \
    return ::ejk::ToFfiError(EJK_STATUS_CONCAT(ejk_ffi_or_, __LINE__).status()); \
  lhs = std::move(EJK_STATUS_CONCAT(ejk_ffi_or_, __LINE__)).value()
