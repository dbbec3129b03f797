#include "flash_attention/params.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/format.h"

namespace ejk::flash_attention {
namespace {

Status Invalid(const std::string& message) { return Status::InvalidArgument(message); }

std::string Str(int64_t x) { return std::to_string(x); }

std::string ShapeStr(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  for (int64_t x : dims) s += (s.size() > 1 ? "," : "") + Str(x);
  return s + "]";
}

// Optional operands are absent as default (rank 0) views; a view of too high a rank has
// rank -1, counts as given, and CheckTensor rejects it.
bool Given(const TensorView& t) { return t.rank != 0; }

bool HasShape(const TensorView& t, std::initializer_list<int64_t> dims) {
  if (t.rank != static_cast<int>(dims.size())) return false;
  int i = 0;
  for (int64_t x : dims) {
    if (t.shape[i++] != x) return false;
  }
  return true;
}

Status CheckShape(const TensorView& t, const char* name, std::initializer_list<int64_t> dims,
                  const std::string& what) {
  if (HasShape(t, dims)) return Status::Ok();
  return Invalid(std::string(name) + " must have shape " + ShapeStr(dims) + " (" + what +
                 "), got " + t.ToString());
}

Status CheckNonNegative(const TensorView& t, const char* name) {
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] < 0) return Invalid(std::string(name) + ": dimensions must be non-negative, got " + t.ToString());
  }
  return Status::Ok();
}

// A [B|1, Hq|1, Sq, Sk] operand (bias, mask).
Status CheckBroadcast(const TensorView& t, const char* name, const ForwardParams& p) {
  const int64_t b = p.q.dim(0), sq = p.q.dim(1), hq = p.q.dim(2), sk = p.k.dim(1);
  if ((t.dim(0) != 1 && t.dim(0) != b) || (t.dim(1) != 1 && t.dim(1) != hq) || t.dim(2) != sq ||
      t.dim(3) != sk) {
    return Invalid(std::string(name) + " " + t.ToString() + " must broadcast to [batch=" + Str(b) +
                   ", num_q_heads=" + Str(hq) + ", seq_len_q=" + Str(sq) + ", seq_len_k=" + Str(sk) +
                   "] (batch and head dims may be 1); query " + p.q.ToString() + ", key " +
                   p.k.ToString());
  }
  return Status::Ok();
}

constexpr std::initializer_list<DType> kInputDTypes = {DType::kF32, DType::kBF16, DType::kF16};
constexpr std::initializer_list<DType> kFloatDTypes = {DType::kF32, DType::kBF16, DType::kF16,
                                                       DType::kF64};

}  // namespace

StatusOr<Dims> ValidateForward(const ForwardParams& p) {
  EJK_RETURN_IF_ERROR(CheckTensor(p.q, "query", 4, kInputDTypes));
  EJK_RETURN_IF_ERROR(CheckTensor(p.k, "key", 4, kInputDTypes));
  EJK_RETURN_IF_ERROR(CheckTensor(p.v, "value", 4, kInputDTypes));
  EJK_RETURN_IF_ERROR(CheckNonNegative(p.q, "query"));
  EJK_RETURN_IF_ERROR(CheckNonNegative(p.k, "key"));
  EJK_RETURN_IF_ERROR(CheckNonNegative(p.v, "value"));
  const std::string qk = "; query " + p.q.ToString() + ", key " + p.k.ToString();
  if (p.k.dtype != p.q.dtype) {
    return Invalid(std::string("key: dtype (") + DTypeName(p.k.dtype) + ") must equal query's (" +
                   DTypeName(p.q.dtype) + ")" + qk);
  }
  if (p.v.dtype != p.q.dtype) {
    return Invalid(std::string("value: dtype (") + DTypeName(p.v.dtype) + ") must equal query's (" +
                   DTypeName(p.q.dtype) + "); query " + p.q.ToString() + ", value " + p.v.ToString());
  }
  const int64_t B = p.q.dim(0), Sq = p.q.dim(1), Hq = p.q.dim(2), D = p.q.dim(3);
  const int64_t Sk = p.k.dim(1), Hkv = p.k.dim(2);
  if (p.k.dim(0) != B) {
    return Invalid("key: batch (" + Str(p.k.dim(0)) + ") must equal query batch (" + Str(B) + ")" + qk);
  }
  if (p.k.dim(3) != D) {
    return Invalid("key: head_dim (" + Str(p.k.dim(3)) + ") must equal query head_dim (" + Str(D) + ")" + qk);
  }
  if (!HasShape(p.v, {B, Sk, Hkv, D})) {
    return Invalid("value: shape must equal key's; key " + p.k.ToString() + ", value " + p.v.ToString());
  }
  if (D == 0) return Invalid("query: head_dim must be positive, got " + p.q.ToString());
  if (Hq == 0) return Invalid("query: num_q_heads must be positive, got " + p.q.ToString());
  if (Hkv == 0 || Hq % Hkv != 0) {
    return Invalid("key: num_kv_heads (" + Str(Hkv) + ") must divide num_q_heads (" + Str(Hq) + ")" + qk);
  }
  // Dropout hashes 32-bit query/key indices.
  constexpr int64_t kMaxSeq = std::numeric_limits<int32_t>::max();
  if (Sq > kMaxSeq) return Invalid("query: seq_len_q must be below 2^31, got " + p.q.ToString());
  if (Sk > kMaxSeq) return Invalid("key: seq_len_k must be below 2^31, got " + p.k.ToString());

  if (Given(p.bias)) {
    EJK_RETURN_IF_ERROR(CheckTensor(p.bias, "bias", 4, kFloatDTypes));
    EJK_RETURN_IF_ERROR(CheckBroadcast(p.bias, "bias", p));
  }
  if (Given(p.mask)) {
    EJK_RETURN_IF_ERROR(CheckTensor(p.mask, "attention_mask", 4, {DType::kBool, DType::kU8}));
    EJK_RETURN_IF_ERROR(CheckBroadcast(p.mask, "attention_mask", p));
  }
  if (Given(p.softmax_aux)) {
    EJK_RETURN_IF_ERROR(CheckTensor(p.softmax_aux, "softmax_aux", 1, kFloatDTypes));
    EJK_RETURN_IF_ERROR(CheckShape(p.softmax_aux, "softmax_aux", {Hq}, "num_q_heads; query " + p.q.ToString()));
  }

  const bool varlen = Given(p.cu_seqlens_q) || Given(p.cu_seqlens_k);
  int64_t num_sequences = B;
  if (varlen) {
    if (!Given(p.cu_seqlens_q) || !Given(p.cu_seqlens_k)) {
      return Invalid(std::string("cum_seqlens_q and cum_seqlens_k must be given together, got only ") +
                     (Given(p.cu_seqlens_q) ? "cum_seqlens_q " + p.cu_seqlens_q.ToString()
                                            : "cum_seqlens_k " + p.cu_seqlens_k.ToString()));
    }
    EJK_RETURN_IF_ERROR(CheckTensor(p.cu_seqlens_q, "cum_seqlens_q", 1, {DType::kI32}));
    EJK_RETURN_IF_ERROR(CheckTensor(p.cu_seqlens_k, "cum_seqlens_k", 1, {DType::kI32}));
    if (p.cu_seqlens_q.dim(0) < 2) {
      return Invalid("cum_seqlens_q must have shape [num_sequences + 1] with at least 2 entries, got " +
                     p.cu_seqlens_q.ToString());
    }
    if (p.cu_seqlens_k.dim(0) != p.cu_seqlens_q.dim(0)) {
      return Invalid("cum_seqlens_k " + p.cu_seqlens_k.ToString() + " must have the length of cum_seqlens_q " +
                     p.cu_seqlens_q.ToString());
    }
    if (B != 1) {
      return Invalid("cum_seqlens_q: packed sequences need batch 1, got query " + p.q.ToString());
    }
    num_sequences = p.cu_seqlens_q.dim(0) - 1;
  }
  if (Given(p.q_segment_ids) || Given(p.kv_segment_ids)) {
    if (!Given(p.q_segment_ids) || !Given(p.kv_segment_ids)) {
      return Invalid(std::string("q_segment_ids and kv_segment_ids must be given together, got only ") +
                     (Given(p.q_segment_ids) ? "q_segment_ids " + p.q_segment_ids.ToString()
                                             : "kv_segment_ids " + p.kv_segment_ids.ToString()));
    }
    if (varlen) return Invalid("q_segment_ids: use either cum_seqlens_q/k or q/kv_segment_ids, not both");
    EJK_RETURN_IF_ERROR(CheckTensor(p.q_segment_ids, "q_segment_ids", 2, {DType::kI32}));
    EJK_RETURN_IF_ERROR(CheckTensor(p.kv_segment_ids, "kv_segment_ids", 2, {DType::kI32}));
    EJK_RETURN_IF_ERROR(CheckShape(p.q_segment_ids, "q_segment_ids", {B, Sq}, "batch, seq_len_q; query " + p.q.ToString()));
    EJK_RETURN_IF_ERROR(CheckShape(p.kv_segment_ids, "kv_segment_ids", {B, Sk}, "batch, seq_len_k; key " + p.k.ToString()));
  }

  if (p.window_left < -1 || p.window_right < -1) {
    return Invalid("sliding_window: sides must be >= 0 or -1 (unbounded), got (" + Str(p.window_left) + ", " +
                   Str(p.window_right) + ")");
  }
  if (!std::isfinite(p.logits_soft_cap) || p.logits_soft_cap < 0.0f) {
    return Invalid("logits_soft_cap must be finite and >= 0 (0: off), got " + FormatFloat(p.logits_soft_cap));
  }
  if (!(p.dropout_prob >= 0.0f && p.dropout_prob < 1.0f)) {
    return Invalid("dropout_prob must be in [0, 1), got " + FormatFloat(p.dropout_prob));
  }
  if (!std::isfinite(p.softmax_scale)) {
    return Invalid("softmax_scale must be finite, got " + FormatFloat(p.softmax_scale));
  }

  EJK_RETURN_IF_ERROR(CheckTensor(p.out, "out", 4, {p.q.dtype}));
  EJK_RETURN_IF_ERROR(CheckShape(p.out, "out", {B, Sq, Hq, D}, "like query " + p.q.ToString()));
  EJK_RETURN_IF_ERROR(CheckTensor(p.lse, "lse", 3, {DType::kF32}));
  EJK_RETURN_IF_ERROR(CheckShape(p.lse, "lse", {B, Hq, Sq}, "batch, num_q_heads, seq_len_q; query " + p.q.ToString()));

  return Dims{B, Sq, Sk, Hq, Hkv, D, num_sequences, varlen};
}

StatusOr<Dims> ValidateBackward(const BackwardParams& p) {
  EJK_ASSIGN_OR_RETURN(const Dims d, ValidateForward(p.fwd));
  const ForwardParams& f = p.fwd;
  const int64_t B = d.batch, Sq = d.seqlen_q, Sk = d.seqlen_k, Hq = d.num_q_heads;
  const int64_t Hkv = d.num_kv_heads, D = d.head_dim;
  const std::string like_q = "like query " + f.q.ToString();
  const std::string like_k = "like key " + f.k.ToString();
  EJK_RETURN_IF_ERROR(CheckTensor(p.dout, "dout", 4, {f.q.dtype}));
  EJK_RETURN_IF_ERROR(CheckShape(p.dout, "dout", {B, Sq, Hq, D}, like_q));
  if (Given(p.dlse)) {
    EJK_RETURN_IF_ERROR(CheckTensor(p.dlse, "dlse", 3, {DType::kF32}));
    EJK_RETURN_IF_ERROR(CheckShape(p.dlse, "dlse", {B, Hq, Sq}, "like lse " + f.lse.ToString()));
  }
  EJK_RETURN_IF_ERROR(CheckTensor(p.dq, "dq", 4, {f.q.dtype}));
  EJK_RETURN_IF_ERROR(CheckShape(p.dq, "dq", {B, Sq, Hq, D}, like_q));
  EJK_RETURN_IF_ERROR(CheckTensor(p.dk, "dk", 4, {f.k.dtype, DType::kF32}));
  EJK_RETURN_IF_ERROR(CheckShape(p.dk, "dk", {B, Sk, Hkv, D}, like_k));
  EJK_RETURN_IF_ERROR(CheckTensor(p.dv, "dv", 4, {f.v.dtype, DType::kF32}));
  EJK_RETURN_IF_ERROR(CheckShape(p.dv, "dv", {B, Sk, Hkv, D}, like_k));
  if (p.dv.dtype != p.dk.dtype) {
    return Invalid(std::string("dv: dtype (") + DTypeName(p.dv.dtype) + ") must equal dk's (" +
                   DTypeName(p.dk.dtype) + "); dk " + p.dk.ToString() + ", dv " + p.dv.ToString());
  }
  if (Given(p.dbias)) {
    if (!Given(f.bias)) return Invalid("dbias " + p.dbias.ToString() + " given without bias");
    const bool bias_16bit = f.bias.dtype == DType::kBF16 || f.bias.dtype == DType::kF16;
    EJK_RETURN_IF_ERROR(CheckTensor(p.dbias, "dbias", 4, {DType::kF32, bias_16bit ? f.bias.dtype : DType::kF32}));
    EJK_RETURN_IF_ERROR(CheckShape(p.dbias, "dbias",
                                   {f.bias.dim(0), f.bias.dim(1), f.bias.dim(2), f.bias.dim(3)},
                                   "like bias " + f.bias.ToString()));
    if (p.dbias.dtype != DType::kF32 && BiasGradSummed(f.bias, d)) {
      return Invalid("dbias " + p.dbias.ToString() + " must be f32: bias " + f.bias.ToString() +
                     " broadcasts over the batch or the heads, so its gradient is a sum");
    }
  }
  if (Given(p.dsoftmax_aux)) {
    if (!Given(f.softmax_aux)) {
      return Invalid("dsoftmax_aux " + p.dsoftmax_aux.ToString() + " given without softmax_aux");
    }
    EJK_RETURN_IF_ERROR(CheckTensor(p.dsoftmax_aux, "dsoftmax_aux", 1, {DType::kF32}));
    EJK_RETURN_IF_ERROR(CheckShape(p.dsoftmax_aux, "dsoftmax_aux", {Hq}, "like softmax_aux " + f.softmax_aux.ToString()));
  }
  return d;
}

Status ValidateCuSeqlensValues(const ForwardParams& p, const Dims& dims) {
  if (!dims.varlen) return Status::Ok();
  const struct {
    const char* name;
    const TensorView* t;
    int64_t total;
  } arrays[] = {{"cum_seqlens_q", &p.cu_seqlens_q, dims.seqlen_q},
                {"cum_seqlens_k", &p.cu_seqlens_k, dims.seqlen_k}};
  for (const auto& a : arrays) {
    const int32_t* cu = a.t->ptr<int32_t>();
    const std::string name = a.name;
    if (cu[0] != 0) return Invalid(name + "[0] must be 0, got " + Str(cu[0]));
    for (int64_t n = 1; n <= dims.num_sequences; ++n) {
      if (cu[n] < cu[n - 1]) {
        return Invalid(name + " must be non-decreasing: " + name + "[" + Str(n) + "]=" + Str(cu[n]) + " < " +
                       name + "[" + Str(n - 1) + "]=" + Str(cu[n - 1]));
      }
    }
    if (cu[dims.num_sequences] > a.total) {
      return Invalid(name + "[" + Str(dims.num_sequences) + "]=" + Str(cu[dims.num_sequences]) +
                     " exceeds the packed length " + Str(a.total) + " (" +
                     (a.t == &p.cu_seqlens_q ? "query " + p.q.ToString() : "key " + p.k.ToString()) + ")");
    }
  }
  return Status::Ok();
}

Status CheckDropoutSeedOperand(int64_t element_count, bool is_32_bit_integer) {
  if (!is_32_bit_integer || (element_count != 1 && element_count != kDropoutSeedWithOrigin)) {
    return Status::InvalidArgument("dropout_seed must be one 32-bit integer, or four (the seed, then the first batch "
                                   "row, first q head and q heads of the call it is a part of); got " +
                                   std::to_string(element_count) +
                                   (is_32_bit_integer ? " of them" : " elements of another dtype"));
  }
  return Status::Ok();
}

Status CheckDropoutOrigin(const uint32_t* origin, int64_t num_q_heads) {
  const uint64_t heads = static_cast<uint64_t>(num_q_heads), first_head = origin[1], total = origin[2];
  if (total < heads || first_head > total - heads) {
    return Status::InvalidArgument("dropout_seed: a part's q heads " + std::to_string(first_head) + " to " +
                                   std::to_string(first_head + heads) + " exceed the call's " + std::to_string(total));
  }
  return Status::Ok();
}

}  // namespace ejk::flash_attention
