#include "runtime/tensor.h"

#include <algorithm>

namespace ejk {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kF64: return "float64";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kU32: return "uint32";
    case DType::kU8: return "uint8";
    case DType::kBool: return "bool";
    case DType::kF8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

bool DTypeFromName(const std::string& name, DType* out) {
  for (int32_t i = 0; i <= static_cast<int32_t>(DType::kF8E4M3); ++i) {
    if (name == DTypeName(static_cast<DType>(i))) {
      *out = static_cast<DType>(i);
      return true;
    }
  }
  return false;
}

int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64: return 8;
    case DType::kF32:
    case DType::kI32:
    case DType::kU32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kU8:
    case DType::kBool:
    case DType::kF8E4M3: return 1;
  }
  return 0;
}

TensorView TensorView::Contiguous(void* data, DType dtype, const int64_t* shape, int rank) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  if (rank < 0 || rank > kMaxRank) {
    t.rank = -1;
    return t;
  }
  t.rank = rank;
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride *= std::max<int64_t>(shape[i], 1);
  }
  return t;
}

TensorView TensorView::Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return Contiguous(data, dtype, shape.begin(), static_cast<int>(shape.size()));
}

int64_t TensorView::NumElements() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool TensorView::IsContiguous() const {
  if (NumElements() == 0) return true;  // no element to address, whatever the strides
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != stride) return false;
    stride *= shape[i];
  }
  return true;
}

std::string TensorView::ToString() const {
  std::string s = DTypeName(dtype);
  s += "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Status CheckTensor(const TensorView& t, const char* name, int rank,
                   std::initializer_list<DType> allowed_dtypes) {
  if (t.rank != rank) {
    return Status::InvalidArgument(std::string(name) + " must have rank " + std::to_string(rank) +
                                   ", got shape " + t.ToString());
  }
  if (std::find(allowed_dtypes.begin(), allowed_dtypes.end(), t.dtype) == allowed_dtypes.end()) {
    std::string allowed;
    for (DType d : allowed_dtypes) allowed += std::string(allowed.empty() ? "" : ", ") + DTypeName(d);
    return Status::InvalidArgument(std::string(name) + " must have dtype in {" + allowed + "}, got " +
                                   t.ToString());
  }
  if (!t.IsContiguous()) {
    return Status::InvalidArgument(std::string(name) + " must be contiguous, got " + t.ToString());
  }
  if (t.data == nullptr && t.NumElements() > 0) {
    return Status::InvalidArgument(std::string(name) + " has no data, shape " + t.ToString());
  }
  return Status::Ok();
}

}  // namespace ejk
