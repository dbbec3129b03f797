// Device-side attention features shared by the mma.sync flash attention kernels (forward and
// backward): sequence lookup, visible key/query ranges, logit transforms, masks and dropout,
// exactly as semantics.h defines them.
//
// Host:
//   MakeFeatureArgs(p, dims, seed)  flattens ForwardParams/Dims into FeatureArgs (by value into
//                                   the kernel); reads no tensor data.
//   NeedsGeneral(f) / NeedsRanges(f)  which kernel variant a call needs (per-element features;
//                                   per-row key ranges from causal, window or packed sequences).
// Device, per element / per row:
//   LoadFloat(ptr, dtype, i)        element i of a float tensor of any float dtype, as f32.
//   FindSequence(f, i)              the packed sequence holding query i (varlen: binary search
//                                   over cu_seqlens_q, values clamped; otherwise the whole row).
//   FindKeySequence(f, j)           the same for key j (search over cu_seqlens_k).
//   MakeQueryRow(f, b, h, i)        per-query state reused over key tiles: visible key range
//                                   [lo, hi) (absolute key indices; causal, window and sequence
//                                   applied), segment id, dropout row key, padding flag.
//   VisibleQueryRange(...)          the transposed VisibleKeyRange: the queries that see a key,
//                                   for kernels that walk query tiles per key tile.
//   SinkLogit(f, h)                 the sink logit of head h (natural units).
//   LogitLog2(f, s, bias)           raw q.k -> log2(e) * (SoftCap(scale * s) + bias).
//   ReadElements<kN, kKeyPairs>(f, b, h, index, bias, shown)
//                                   bias[b, h, i, j] (broadcast dims honoured, 0 without bias)
//                                   and the mask and segment ids' verdict of a fragment's
//                                   elements, every read issued before any is used.
// Device, per C fragment of mma.m16n8k16 (rows are queries, columns keys; see cuda_mma.h):
//   ScoresToLogits<kN, kGeneral, kCheckRange>(s, f, rows, b, h, col0)
//       s[nt][e] holds raw q.k for row rows[e / 2] and key col0 + 8 * nt + e % 2 (col0 =
//       j0 + 2 * (lane % 4)); replaced by log2(e) * logit, or -inf where not visible.
//       kCheckRange: test [lo, hi) (boundary tiles only); kGeneral: bias, mask, segments.
//   MaskScores<kN>(s, rows, col0)   sets the elements outside [lo, hi) to -inf, leaving the
//                                   others as they are (kernels that fold the scale elsewhere).
//   ApplyDropout<kN>(p, f, rows, j0, tq)  zeroes the dropped probabilities of such a fragment.
//
// Logits are kept in log2 units (exp2f on the SFU); lse = (m + log2(l)) * ln(2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flash_attention/params.h"
#include "flash_attention/semantics.h"
#include "runtime/tensor.h"

namespace ejk::flash_attention::mma {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct FeatureArgs {
  int32_t seqlen_q = 0, seqlen_k = 0;  // per batch row; packed totals with varlen
  int32_t num_q_heads = 1;
  int32_t group = 1;  // num_q_heads / num_kv_heads
  // The call's head dim: at most the kernel's, whose columns past it load as zeros and are
  // never stored.
  int32_t head_dim = 0;
  // Varlen: cu_q/cu_k non-null, num_sequences entries + 1 each, device memory (clamped here).
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  int32_t num_sequences = 0;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float scale = 1.0f;       // softmax_scale
  float scale_log2 = kLog2e;  // softmax_scale * log2(e)
  float soft_cap = 0.0f;    // 0: off
  // bias/mask element (b, h, i, j) is at b * stride_b + h * stride_h + i * seqlen_k + j; a
  // broadcast dim has stride 0.
  const void* bias = nullptr;
  DType bias_dtype = DType::kF32;
  int64_t bias_stride_b = 0, bias_stride_h = 0;
  const uint8_t* mask = nullptr;
  int64_t mask_stride_b = 0, mask_stride_h = 0;
  const int32_t* q_segment = nullptr;   // [B, Sq]
  const int32_t* kv_segment = nullptr;  // [B, Sk]
  const void* sink = nullptr;  // [Hq] sink logits
  DType sink_dtype = DType::kF32;
  bool dropout = false;
  const uint32_t* dropout_seed = nullptr;  // device scalar
  const uint32_t* dropout_origin = nullptr;  // device words, or null (DropoutBatchHead)
  uint32_t dropout_threshold = 0;
  float dropout_scale = 1.0f;  // 1 / (1 - p)
};

inline FeatureArgs MakeFeatureArgs(const ForwardParams& p, const Dims& d, const uint32_t* dropout_seed) {
  FeatureArgs f;
  f.seqlen_q = static_cast<int32_t>(d.seqlen_q);
  f.seqlen_k = static_cast<int32_t>(d.seqlen_k);
  f.num_q_heads = static_cast<int32_t>(d.num_q_heads);
  f.group = static_cast<int32_t>(d.num_q_heads / d.num_kv_heads);
  f.head_dim = static_cast<int32_t>(d.head_dim);
  if (d.varlen) {
    f.cu_q = p.cu_seqlens_q.ptr<int32_t>();
    f.cu_k = p.cu_seqlens_k.ptr<int32_t>();
    f.num_sequences = static_cast<int32_t>(d.num_sequences);
  }
  f.causal = p.causal;
  f.window_left = p.window_left;
  f.window_right = p.window_right;
  f.scale = p.softmax_scale;
  f.scale_log2 = p.softmax_scale * kLog2e;
  f.soft_cap = p.logits_soft_cap;
  const int64_t plane = d.seqlen_q * d.seqlen_k;
  if (p.bias.present()) {
    f.bias = p.bias.data;
    f.bias_dtype = p.bias.dtype;
    f.bias_stride_h = p.bias.dim(1) == 1 ? 0 : plane;
    f.bias_stride_b = p.bias.dim(0) == 1 ? 0 : p.bias.dim(1) * plane;
  }
  if (p.mask.present()) {
    f.mask = p.mask.ptr<uint8_t>();
    f.mask_stride_h = p.mask.dim(1) == 1 ? 0 : plane;
    f.mask_stride_b = p.mask.dim(0) == 1 ? 0 : p.mask.dim(1) * plane;
  }
  if (p.q_segment_ids.present()) {
    f.q_segment = p.q_segment_ids.ptr<int32_t>();
    f.kv_segment = p.kv_segment_ids.ptr<int32_t>();
  }
  if (p.softmax_aux.present()) {
    f.sink = p.softmax_aux.data;
    f.sink_dtype = p.softmax_aux.dtype;
  }
  if (p.dropout_prob > 0.0f) {
    f.dropout = true;
    f.dropout_seed = dropout_seed;
    f.dropout_origin = p.dropout_origin;
    f.dropout_threshold = DropoutThreshold(p.dropout_prob);
    f.dropout_scale = 1.0f / (1.0f - p.dropout_prob);
  }
  return f;
}

// True when some per-element feature (bias, mask, segments, dropout) is on.
inline bool NeedsGeneral(const FeatureArgs& f) {
  return f.bias != nullptr || f.mask != nullptr || f.q_segment != nullptr || f.dropout;
}

// True when rows see different key ranges (causal, window or packed sequences).
inline bool NeedsRanges(const FeatureArgs& f) {
  return f.causal || f.window_left >= 0 || f.window_right >= 0 || f.cu_q != nullptr;
}

__device__ __forceinline__ float LoadFloat(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kF16: return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kF64: return static_cast<float>(static_cast<const double*>(base)[i]);
    default: return 0.0f;
  }
}

__device__ __forceinline__ int32_t ClampIndex(int32_t x, int32_t lo, int32_t hi) { return min(max(x, lo), hi); }

// One packed sequence: queries [q_begin, q_end), keys [k_begin, k_end); real is false for
// rows past the last sequence (padding).
struct SeqBounds {
  int32_t q_begin, q_end, k_begin, k_end;
  bool real;
};

__device__ __forceinline__ SeqBounds SequenceAt(const FeatureArgs& f, int32_t n) {
  SeqBounds s;
  s.q_begin = ClampIndex(__ldg(f.cu_q + n), 0, f.seqlen_q);
  s.q_end = ClampIndex(__ldg(f.cu_q + n + 1), s.q_begin, f.seqlen_q);
  s.k_begin = ClampIndex(__ldg(f.cu_k + n), 0, f.seqlen_k);
  s.k_end = ClampIndex(__ldg(f.cu_k + n + 1), s.k_begin, f.seqlen_k);
  s.real = true;
  return s;
}

// The last sequence whose (clamped) start in `cu` is <= x; -1 if none.
__device__ __forceinline__ int32_t LastStartAtOrBefore(const int32_t* cu, int32_t n, int32_t total, int32_t x) {
  int32_t lo = 0, hi = n;  // answer in [lo - 1, hi)
  while (lo < hi) {
    const int32_t mid = (lo + hi) / 2;
    if (ClampIndex(__ldg(cu + mid), 0, total) <= x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo - 1;
}

__device__ __forceinline__ SeqBounds FindSequence(const FeatureArgs& f, int32_t i) {
  if (f.cu_q == nullptr) return SeqBounds{0, f.seqlen_q, 0, f.seqlen_k, true};
  const int32_t n = LastStartAtOrBefore(f.cu_q, f.num_sequences, f.seqlen_q, i);
  if (n < 0) return SeqBounds{0, 0, 0, 0, false};
  SeqBounds s = SequenceAt(f, n);
  s.real = i < s.q_end;
  return s;
}

__device__ __forceinline__ SeqBounds FindKeySequence(const FeatureArgs& f, int32_t j) {
  if (f.cu_q == nullptr) return SeqBounds{0, f.seqlen_q, 0, f.seqlen_k, true};
  const int32_t n = LastStartAtOrBefore(f.cu_k, f.num_sequences, f.seqlen_k, j);
  if (n < 0) return SeqBounds{0, 0, 0, 0, false};
  SeqBounds s = SequenceAt(f, n);
  s.real = j < s.k_end;
  return s;
}

// Queries [*begin, *end) of a sequence of num_queries queries that see local key j, the
// inverse of VisibleKeyRange (same offset = num_keys - num_queries).
__device__ __forceinline__ void VisibleQueryRange(int64_t j, int64_t num_queries, int64_t offset, bool causal,
                                                  int64_t window_left, int64_t window_right, int64_t* begin,
                                                  int64_t* end) {
  int64_t lo = 0, hi = num_queries;
  // causal: j <= i + offset; window_right: j <= i + offset + wr; window_left: i + offset - wl <= j.
  if (causal && j - offset > lo) lo = j - offset;
  if (window_right >= 0 && j - offset - window_right > lo) lo = j - offset - window_right;
  if (window_left >= 0 && j - offset + window_left + 1 < hi) hi = j - offset + window_left + 1;
  if (hi < lo) hi = lo;
  *begin = lo;
  *end = hi;
}

// Per query row, computed once and reused over key tiles.
struct QueryRow {
  int32_t index;      // query index within the batch row (packed with varlen), <= Sq - 1
  int32_t lo, hi;     // visible keys [lo, hi), absolute; lo == hi when none
  int32_t segment;    // q segment id (segments on)
  uint32_t dropout_key;
  int32_t key_begin;  // the sequence's first key (dropout hashes keys by their index in it)
  bool real;          // in [0, Sq) and not padding
};

// b, h: batch row and query head; i may be >= Sq (then the row sees nothing, real is false,
// and index is clamped so that feature reads for it stay in bounds). Needs Sq >= 1.
__device__ __forceinline__ QueryRow MakeQueryRow(const FeatureArgs& f, int32_t b, int32_t h, int32_t i) {
  QueryRow r;
  r.index = i < f.seqlen_q ? i : f.seqlen_q - 1;  // rows past Sq read row Sq - 1's data
  r.lo = 0;
  r.hi = 0;
  r.segment = 0;
  r.key_begin = 0;
  r.dropout_key = 0;
  r.real = false;
  if (i >= f.seqlen_q) return r;
  const SeqBounds s = FindSequence(f, i);
  if (!s.real) return r;
  r.real = true;
  const int64_t q_len = s.q_end - s.q_begin, k_len = s.k_end - s.k_begin;
  int64_t lo, hi;
  VisibleKeyRange(i - s.q_begin, k_len, k_len - q_len, f.causal, f.window_left, f.window_right, &lo, &hi);
  lo = lo < k_len ? lo : k_len;
  hi = hi > lo ? hi : lo;
  r.lo = s.k_begin + static_cast<int32_t>(lo);
  r.hi = s.k_begin + static_cast<int32_t>(hi);
  if (f.q_segment != nullptr) r.segment = __ldg(f.q_segment + static_cast<int64_t>(b) * f.seqlen_q + i);
  if (f.dropout) {
    r.key_begin = static_cast<int32_t>(s.k_begin);
    r.dropout_key = DropoutRowKey(
        __ldg(f.dropout_seed),
        DropoutBatchHead(f.dropout_origin, static_cast<uint32_t>(f.num_q_heads), static_cast<uint32_t>(b),
                         static_cast<uint32_t>(h)),
        static_cast<uint32_t>(i));
  }
  return r;
}

__device__ __forceinline__ float SinkLogit(const FeatureArgs& f, int32_t h) { return LoadFloat(f.sink, f.sink_dtype, h); }

// Raw q.k (plus the bias term, 0 without bias) -> log2(e) * (SoftCap(scale * s) + bias).
__device__ __forceinline__ float LogitLog2(const FeatureArgs& f, float s, float bias) {
  if (f.soft_cap > 0.0f) return (f.soft_cap * tanhf(s * f.scale / f.soft_cap) + bias) * kLog2e;
  return fmaf(s, f.scale_log2, bias * kLog2e);
}

// A bias tensor's element type, for reads typed at compile time (NoBias: none).
struct NoBias {};
template <typename Fn>
__device__ __forceinline__ void DispatchBias(const FeatureArgs& f, Fn&& fn) {
  if (f.bias == nullptr) return fn(static_cast<const NoBias*>(nullptr));
  switch (f.bias_dtype) {
    case DType::kBF16: return fn(static_cast<const __nv_bfloat16*>(f.bias));
    case DType::kF16: return fn(static_cast<const __half*>(f.bias));
    case DType::kF64: return fn(static_cast<const double*>(f.bias));
    default: return fn(static_cast<const float*>(f.bias));
  }
}
__device__ __forceinline__ float BiasAt(const NoBias*, int64_t) { return 0.0f; }
__device__ __forceinline__ float BiasAt(const float* bias, int64_t at) { return __ldg(bias + at); }
__device__ __forceinline__ float BiasAt(const double* bias, int64_t at) { return static_cast<float>(__ldg(bias + at)); }
__device__ __forceinline__ float BiasAt(const __nv_bfloat16* bias, int64_t at) { return __bfloat162float(__ldg(bias + at)); }
__device__ __forceinline__ float BiasAt(const __half* bias, int64_t at) { return __half2float(__ldg(bias + at)); }

// The bias (0 without one) and whether the attention mask and segment ids show the element
// (true without them), for kN x 4 elements of batch row b and query head h: element (n, e)
// at query index(n, e).x and key index(n, e).y of the batch row, clamped into the tensors
// (callers mask the elements outside by range). Every read is unconditional and none is used
// before all are issued, so that their latencies overlap: behind a per-element visibility
// test they ran one after another, and a call with a bias or mask took ~10x the time.
// kKeyPairs: elements (n, 2k) and (n, 2k + 1) are keys j and j + 1 of one query, with j of
// the parity of element (0, 0)'s key; read as one word where that is even, the key count is
// even and the tensor aligned (then no pair straddles a row or a word).
template <int kN, bool kKeyPairs, typename Index>
__device__ __forceinline__ void ReadElements(const FeatureArgs& f, int32_t b, int32_t h, Index&& index,
                                             float (&bias)[kN][4], bool (&shown)[kN][4]) {
  // Keys past the row are clamped to its last (the last pair's first for pairs).
  const auto at = [&](int n, int e, int64_t stride_b, int64_t stride_h, int32_t last_key) {
    const int2 ij = index(n, e);
    return b * stride_b + h * stride_h + static_cast<int64_t>(min(ij.x, f.seqlen_q - 1)) * f.seqlen_k +
           min(ij.y, last_key);
  };
  const bool even_keys = f.seqlen_k % 2 == 0 && index(0, 0).y % 2 == 0;
  const auto aligned = [](const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  DispatchBias(f, [&](const auto* typed) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(typed)>>;
    if constexpr (kKeyPairs && (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half> ||
                                std::is_same_v<T, float>)) {
      if (even_keys && aligned(typed, 2 * sizeof(T))) {
#pragma unroll
        for (int n = 0; n < kN; ++n) {
#pragma unroll
          for (int e = 0; e < 4; e += 2) {
            const int64_t i = at(n, e, f.bias_stride_b, f.bias_stride_h, f.seqlen_k - 2);
            float2 pair;
            if constexpr (std::is_same_v<T, float>) {
              pair = __ldg(reinterpret_cast<const float2*>(typed + i));
            } else if constexpr (std::is_same_v<T, __half>) {
              pair = __half22float2(__ldg(reinterpret_cast<const __half2*>(typed + i)));
            } else {
              pair = __bfloat1622float2(__ldg(reinterpret_cast<const __nv_bfloat162*>(typed + i)));
            }
            bias[n][e] = pair.x;
            bias[n][e + 1] = pair.y;
          }
        }
        return;
      }
    }
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) bias[n][e] = BiasAt(typed, at(n, e, f.bias_stride_b, f.bias_stride_h, f.seqlen_k - 1));
    }
  });
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) shown[n][e] = true;
  }
  if (f.mask != nullptr) {
    if (kKeyPairs && even_keys && aligned(f.mask, 2)) {
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const uint16_t pair = __ldg(reinterpret_cast<const uint16_t*>(
              f.mask + at(n, e, f.mask_stride_b, f.mask_stride_h, f.seqlen_k - 2)));
          shown[n][e] = (pair & 0xffu) != 0;
          shown[n][e + 1] = (pair >> 8) != 0;
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          shown[n][e] = __ldg(f.mask + at(n, e, f.mask_stride_b, f.mask_stride_h, f.seqlen_k - 1)) != 0;
        }
      }
    }
  }
  if (f.q_segment != nullptr) {
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int2 ij = index(n, e);
        const int32_t q_id = __ldg(f.q_segment + static_cast<int64_t>(b) * f.seqlen_q + min(ij.x, f.seqlen_q - 1));
        const int32_t kv_id = __ldg(f.kv_segment + static_cast<int64_t>(b) * f.seqlen_k + min(ij.y, f.seqlen_k - 1));
        shown[n][e] = shown[n][e] && q_id == kv_id;
      }
    }
  }
}

template <int kN, bool kGeneral, bool kCheckRange>
__device__ __forceinline__ void ScoresToLogits(float (&s)[kN][4], const FeatureArgs& f, const QueryRow (&rows)[2],
                                               int32_t b, int32_t h, int32_t col0) {
  if constexpr (!kGeneral) {
    if (f.soft_cap > 0.0f) {
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = LogitLog2(f, s[nt][e], 0.0f);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= f.scale_log2;
      }
    }
    if constexpr (kCheckRange) {
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int32_t j = col0 + nt * 8 + (e & 1);
          const QueryRow& r = rows[e >> 1];
          if (j < r.lo || j >= r.hi) s[nt][e] = -INFINITY;
        }
      }
    }
  } else {
    // Four n-tiles at a time: a whole 64-key fragment's reads next to S and O spilled.
    constexpr int kChunk = kN < 4 ? kN : 4;
    static_assert(kN % kChunk == 0, "n-tiles in chunks");
#pragma unroll
    for (int c = 0; c < kN; c += kChunk) {
      float bias[kChunk][4];
      bool shown[kChunk][4];
      ReadElements<kChunk, true>(
          f, b, h, [&](int nt, int e) { return make_int2(rows[e >> 1].index, col0 + (c + nt) * 8 + (e & 1)); }, bias,
          shown);
#pragma unroll
      for (int nt = 0; nt < kChunk; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int32_t j = col0 + (c + nt) * 8 + (e & 1);
          const QueryRow& r = rows[e >> 1];
          const bool in_range = !kCheckRange || (j >= r.lo && j < r.hi);
          s[c + nt][e] = in_range && shown[nt][e] ? LogitLog2(f, s[c + nt][e], bias[nt][e]) : -INFINITY;
        }
      }
    }
  }
}

template <int kN>
__device__ __forceinline__ void MaskScores(float (&s)[kN][4], const QueryRow (&rows)[2], int32_t col0) {
#pragma unroll
  for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int32_t j = col0 + nt * 8 + (e & 1);
      const QueryRow& r = rows[e >> 1];
      if (j < r.lo || j >= r.hi) s[nt][e] = -INFINITY;
    }
  }
}

// j0: the tile's first key, absolute; tq: the thread's column pair (columns j0 + nt * 8 +
// 2 tq + {0, 1}). Fragments nt and nt + 1 hold keys 8 apart, so a row whose sequence's keys
// start a multiple of 16 before j0 hashes once per two elements (DropoutKeepPair); other
// rows (packed sequences starting elsewhere) hash per element.
template <int kN>
__device__ __forceinline__ void ApplyDropout(float (&p)[kN][4], const FeatureArgs& f, const QueryRow (&rows)[2],
                                             int32_t j0, int tq) {
  static_assert(kN % 2 == 0, "key tiles of whole groups of 16");
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const QueryRow& row = rows[hh];
    const int32_t first = j0 - row.key_begin;  // the tile's first key, local to the sequence
    if ((first & 15) == 0) {
      const uint32_t shifted_threshold = f.dropout_threshold << 16;
#pragma unroll
      for (int np = 0; np < kN / 2; ++np) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          bool keep, keep_plus_8;
          DropoutKeepPair(row.dropout_key, static_cast<uint32_t>(first + np * 16 + 2 * tq + c), shifted_threshold,
                          keep, keep_plus_8);
          if (!keep) p[2 * np][2 * hh + c] = 0.0f;
          if (!keep_plus_8) p[2 * np + 1][2 * hh + c] = 0.0f;
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int32_t j = first + nt * 8 + 2 * tq + c;
          if (!DropoutKeep(row.dropout_key, static_cast<uint32_t>(j), f.dropout_threshold)) p[nt][2 * hh + c] = 0.0f;
        }
      }
    }
  }
}

}  // namespace ejk::flash_attention::mma
