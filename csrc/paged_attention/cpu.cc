// CPU paged attention and KV-cache update.
//
// Attention runs one task per (sequence, block of query rows, kv heads): one kv head with
// the head-major layout, whose pages hold each head's keys contiguously; as many as
// parallelism allows with the token-major layout, whose slots interleave the heads. For
// each kv head the task stacks the rows of all q heads of its group into one query matrix
// Q [M][D] (M = rows x group), so each key and value is loaded, converted and multiplied
// once per group. Per key tile, gathered from the pages:
//   S = Q K^T   keys across vector lanes (the tile is transposed while it is converted)
//   online softmax per row (f32), then O = diag(alpha) O + P V   (head_dim across lanes)
// Both products run on the register-blocked micro-kernel of the flash attention CPU code,
// which keeps every lane busy even for single-token decode, where M is just the group.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "flash_attention/cpu_common.h"
#include "paged_attention/fp8.h"
#include "paged_attention/params.h"
#include "runtime/tensor.h"

namespace ejk::paged_attention {
namespace {

namespace cpu = ::ejk::flash_attention::cpu;
using cpu::Accumulate;
using cpu::FloatBuffer;
using cpu::kInf;
using cpu::kLanes;
using cpu::VecF;
using cpu::VecI;

// Query rows stacked per task (rows x group), unless the group alone is larger.
constexpr int64_t kTargetRows = 64;
// Keys are transposed in groups of this many (one 16 x 16 block per 16 head_dim columns).
constexpr int64_t kKeyGroup = 16;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define EJK_PAGED_AVX512 1

// Elements [i, i + 16) of a cache row as f32; lanes outside `mask` read nothing and are 0.
// (The maskz forms of the conversions also keep GCC from warning about the unmasked
// forms' undefined pass-through operand.)
template <DType kDType>
inline __m512 LoadRow16(const void* row, int64_t i, __mmask16 mask) {
  if constexpr (kDType == DType::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(row) + i);
  } else if constexpr (kDType == DType::kBF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + i);
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(mask, _mm512_maskz_cvtepu16_epi32(mask, h), 16));
  } else if constexpr (kDType == DType::kF16) {
    return _mm512_maskz_cvtph_ps(mask, _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + i));
  } else {
    // float8 e4m3fn: the bits, sign-extended to 16 and shifted left by 7, are an f16 of the
    // value times 2^-8 (subnormals included) once bit 14 (a copy of the sign) is cleared;
    // a NaN (magnitude 0x7f) lands on 480, a magnitude no finite e4m3fn value has.
    const __m128i b = _mm_maskz_loadu_epi8(mask, static_cast<const uint8_t*>(row) + i);
    const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
    const __m512 f = _mm512_mul_ps(
        _mm512_maskz_cvtph_ps(mask, _mm256_and_si256(w, _mm256_set1_epi16(static_cast<int16_t>(0xbf80)))),
        _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(480.0f), _CMP_EQ_OQ);
    return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
}

#endif

// n float8 e4m3fn values as f32 (see LoadRow16; the AVX2 path is the same in 8 lanes).
void ConvertF8Row(const uint8_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef EJK_PAGED_AVX512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, LoadRow16<DType::kF8E4M3>(src, i, 0xffff));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i keep = _mm_set1_epi16(static_cast<int16_t>(0xbf80));
  const __m256 two8 = _mm256_set1_ps(256.0f), nan_mag = _mm256_set1_ps(480.0f);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 nan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
  for (; i + 8 <= n; i += 8) {
    int64_t bytes;
    std::memcpy(&bytes, src + i, 8);
    const __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_cvtsi64_si128(bytes)), 7);
    const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(_mm_and_si128(w, keep)), two8);
    const __m256 is_nan = _mm256_cmp_ps(_mm256_and_ps(f, abs_mask), nan_mag, _CMP_EQ_OQ);
    _mm256_storeu_ps(dst + i, _mm256_blendv_ps(f, nan, is_nan));
  }
#endif
  for (; i < n; ++i) dst[i] = F8E4M3ToFloat(src[i]);
}

// Row `offset` (in elements) of a cache as D floats.
inline void LoadCacheRow(const TensorView& cache, int64_t offset, int64_t n, float* dst) {
  if (cache.dtype == DType::kF8E4M3) {
    ConvertF8Row(cache.ptr<uint8_t>() + offset, n, dst);
  } else {
    cpu::ConvertRow(cache.data, cache.dtype, offset, n, dst);
  }
}

#ifdef EJK_PAGED_AVX512
// dst[c * ld + r] = row_r[c] for r < 16 and c < cols, converting to f32 on the way
// (null rows read as 0): 16 x 16 blocks transposed in registers by two-source permutes
// (index i < 16: a[i], else b[i - 16]), the selections of unpack{lo,hi}_ps,
// unpack{lo,hi}_pd and two rounds of 128-bit lane shuffles.
template <DType kDType>
void TransposeKeys(const void* const* rows, int64_t cols, float* dst, int64_t ld) {
  const __m512i lo_ps = _mm512_setr_epi32(0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
  const __m512i hi_ps = _mm512_setr_epi32(2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  const __m512i lo_pd = _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
  const __m512i hi_pd = _mm512_setr_epi32(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const __m512i lanes01 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i lanes23 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i lanes02 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i lanes13 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, cols - c0);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) {
      r[i] = rows[i] ? LoadRow16<kDType>(rows[i], c0, mask) : _mm512_setzero_ps();
    }
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_permutex2var_ps(r[2 * i], lo_ps, r[2 * i + 1]);
      t[2 * i + 1] = _mm512_permutex2var_ps(r[2 * i], hi_ps, r[2 * i + 1]);
    }
    // In 128-bit lane k, r[4i + c] then holds column 4k + c of rows 4i .. 4i + 3.
    for (int i = 0; i < 4; ++i) {
      r[4 * i] = _mm512_permutex2var_ps(t[4 * i], lo_pd, t[4 * i + 2]);
      r[4 * i + 1] = _mm512_permutex2var_ps(t[4 * i], hi_pd, t[4 * i + 2]);
      r[4 * i + 2] = _mm512_permutex2var_ps(t[4 * i + 1], lo_pd, t[4 * i + 3]);
      r[4 * i + 3] = _mm512_permutex2var_ps(t[4 * i + 1], hi_pd, t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 u0 = _mm512_permutex2var_ps(r[c], lanes01, r[4 + c]);
      const __m512 u1 = _mm512_permutex2var_ps(r[c], lanes23, r[4 + c]);
      const __m512 u2 = _mm512_permutex2var_ps(r[8 + c], lanes01, r[12 + c]);
      const __m512 u3 = _mm512_permutex2var_ps(r[8 + c], lanes23, r[12 + c]);
      const __m512 out[4] = {_mm512_permutex2var_ps(u0, lanes02, u2),
                             _mm512_permutex2var_ps(u0, lanes13, u2),
                             _mm512_permutex2var_ps(u1, lanes02, u3),
                             _mm512_permutex2var_ps(u1, lanes13, u3)};
      for (int k = 0; k < 4; ++k) {
        if (4 * k + c < n) _mm512_storeu_ps(dst + (c0 + 4 * k + c) * ld, out[k]);
      }
    }
  }
}
#endif

// Keys `rows` (16 cache rows; null: a zero row) of `cache` into columns of
// dst[c * ld + r], c < D, in f32. `buf` holds 16 padded rows for the portable path.
void LoadKeysTransposed(const TensorView& cache, const void* const* rows, int64_t D,
                        float* dst, int64_t ld, float* buf, int64_t buf_ld) {
#ifdef EJK_PAGED_AVX512
  switch (cache.dtype) {
    case DType::kF32: return TransposeKeys<DType::kF32>(rows, D, dst, ld);
    case DType::kBF16: return TransposeKeys<DType::kBF16>(rows, D, dst, ld);
    case DType::kF16: return TransposeKeys<DType::kF16>(rows, D, dst, ld);
    default: return TransposeKeys<DType::kF8E4M3>(rows, D, dst, ld);
  }
#else
  const int64_t elem = DTypeSize(cache.dtype);
  for (int64_t r = 0; r < 16; ++r) {
    float* row = buf + r * buf_ld;
    if (rows[r]) {
      const int64_t offset = (static_cast<const char*>(rows[r]) -
                              static_cast<const char*>(cache.data)) / elem;
      LoadCacheRow(cache, offset, D, row);
    } else {
      std::fill(row, row + D, 0.0f);
    }
    for (int64_t c = 0; c < D; ++c) dst[c * ld + r] = row[c];
  }
#endif
}

struct Context {
  const Params* p;
  Dims d;
  int64_t group, head_dim_padded, rows_per_block, max_rows, block_kv, heads_per_task;
  const int32_t *kv_lens, *tables, *qsl, *kv_starts;
  float q_scale, cap, v_scale;
};

// Query rows [row_begin, row_begin + rows) of a sequence against kv heads
// [head_begin, head_begin + heads).
struct Task {
  int32_t seq, head_begin, heads, row_begin, rows;
  int64_t cost;
};

// Per kv head of a task: Q, O [max_rows][Dp] and the softmax state [max_rows]; the key
// tile (K^T [Dp][BK], V [BK][Dp], S [max_rows][BK]) is shared by the heads in turn.
struct Scratch {
  FloatBuffer q, o, s, kt, vr, keys, m, l, alpha;
  std::vector<int32_t> lo, hi;
  explicit Scratch(const Context& c)
      : q(c.heads_per_task * c.max_rows * c.head_dim_padded),
        o(c.heads_per_task * c.max_rows * c.head_dim_padded),
        s(c.max_rows * c.block_kv),
        kt(c.head_dim_padded * c.block_kv),
        vr(c.block_kv * c.head_dim_padded),
        keys(kKeyGroup * c.head_dim_padded),
        m(c.heads_per_task * c.max_rows),
        l(c.heads_per_task * c.max_rows),
        alpha(c.max_rows),
        lo(c.max_rows),
        hi(c.max_rows) {
    // Columns past head_dim stay zero: the products read them.
    std::fill(vr.get(), vr.get() + c.block_kv * c.head_dim_padded, 0.0f);
    std::fill(keys.get(), keys.get() + kKeyGroup * c.head_dim_padded, 0.0f);
    std::fill(q.get(), q.get() + c.heads_per_task * c.max_rows * c.head_dim_padded, 0.0f);
  }
};

// Element offset of key position j's row (kv head h) of sequence n in a cache.
inline int64_t RowOffset(const Context& c, int64_t n, int64_t h, int64_t j) {
  const int64_t S = c.d.page_size, Hkv = c.d.num_kv_heads, D = c.d.head_dim;
  const int64_t page = c.tables[n * c.d.max_pages_per_seq + j / S], slot = j % S;
  return c.p->layout == KvLayout::kHeadMajor ? ((page * Hkv + h) * S + slot) * D
                                             : ((page * S + slot) * Hkv + h) * D;
}

// One key tile [j0, j0 + nk) for kv head h: S = Q K^T, online softmax, O += P V.
void AttendTile(const Context& c, int64_t n, int64_t h, int64_t j0, int64_t nk, int64_t key_end,
                int64_t M, float* q, float* o, float* m, float* l, Scratch& sc) {
  const Params& p = *c.p;
  const int64_t D = c.d.head_dim, Dp = c.head_dim_padded, BK = c.block_kv;
  const int64_t nv = (nk + kLanes - 1) / kLanes;
  float *s = sc.s.get(), *kt = sc.kt.get(), *vr = sc.vr.get(), *keys = sc.keys.get();
  float* alpha = sc.alpha.get();
  const int64_t elem = DTypeSize(p.key_cache.dtype), row_bytes = D * elem;
  const char* k_base = static_cast<const char*>(p.key_cache.data);
  const char* v_base = static_cast<const char*>(p.value_cache.data);

  // K^T [D][BK] and V [BK][Dp] of the tile, in f32. Pages are scattered, which defeats
  // the hardware prefetchers: each key's load requests the same key of the next tile.
  for (int64_t g0 = 0; g0 < nk; g0 += kKeyGroup) {
    const void* rows[kKeyGroup];
    for (int64_t r = 0; r < kKeyGroup; ++r) {
      rows[r] = nullptr;
      const int64_t j = j0 + g0 + r;
      if (g0 + r >= nk) continue;
      if (j + BK < key_end) {
        const int64_t ahead = RowOffset(c, n, h, j + BK) * elem;
        for (int64_t b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(k_base + ahead + b, 0, 2);
          __builtin_prefetch(v_base + ahead + b, 0, 2);
        }
      }
      const int64_t offset = RowOffset(c, n, h, j);
      rows[r] = k_base + offset * elem;
      LoadCacheRow(p.value_cache, offset, D, vr + (g0 + r) * Dp);
    }
    LoadKeysTransposed(p.key_cache, rows, D, kt + g0, BK, keys, Dp);
  }

  cpu::Gemm<Accumulate::kOverwrite>(M, nv, D, q, Dp, 1, kt, BK, s, BK);

  const VecI lane = cpu::Iota();
  for (int64_t row = 0; row < M; ++row) {
    float* sr = s + row * BK;
    const VecI lo = cpu::SplatI(static_cast<int32_t>(sc.lo[row] - j0));
    const VecI hi = cpu::SplatI(static_cast<int32_t>(std::min<int64_t>(sc.hi[row] - j0, nk)));
    VecF mx = cpu::Splat(-kInf);
    // The max, exp and tanh would turn a NaN logit into a number: note it instead.
    VecI nan{};
    for (int64_t v = 0; v < nv; ++v) {
      VecF x = cpu::LoadF(sr + v * kLanes);
      const VecI key = lane + cpu::SplatI(static_cast<int32_t>(v * kLanes));
      const VecI visible = (key >= lo) & (key < hi);
      nan |= visible & (x != x);
      if (c.cap > 0.0f) x = cpu::Splat(c.cap) * cpu::Tanh(x);
      x = cpu::Select(visible, x, cpu::Splat(-kInf));
      cpu::StoreF(sr + v * kLanes, x);
      mx = cpu::Max(mx, x);
    }
    const float m_old = m[row];
    float m_new = m_old;
    bool has_nan = false;
    for (int i = 0; i < kLanes; ++i) {
      m_new = std::max(m_new, mx[i]);
      has_nan |= nan[i] != 0;
    }
    // A row that has seen nothing keeps max -inf; exp against 0 then gives exact zeros.
    const float ref = m_new == -kInf ? 0.0f : m_new;
    const VecF ref_v = cpu::Splat(ref);
    VecF sum{};
    for (int64_t v = 0; v < nv; ++v) {
      const VecF e = cpu::Exp(cpu::LoadF(sr + v * kLanes) - ref_v);
      sum += e;
      cpu::StoreF(sr + v * kLanes, e);
    }
    float total = 0.0f;
    for (int i = 0; i < kLanes; ++i) total += sum[i];
    const float a = std::exp(m_old - ref);
    l[row] = has_nan ? std::numeric_limits<float>::quiet_NaN() : a * l[row] + total;
    m[row] = m_new;
    alpha[row] = a;
  }
  for (int64_t row = 0; row < M; ++row) {
    if (alpha[row] == 1.0f) continue;
    const VecF a = cpu::Splat(alpha[row]);
    float* orow = o + row * Dp;
    for (int64_t k = 0; k < Dp; k += kLanes) cpu::StoreF(orow + k, cpu::LoadF(orow + k) * a);
  }
  cpu::Gemm<Accumulate::kAdd>(M, Dp / kLanes, nk, s, BK, 1, vr, Dp, o, Dp);
}

void RunTask(const Context& c, const Task& t, Scratch& sc) {
  const Params& p = *c.p;
  const int64_t n = t.seq, G = c.group, D = c.d.head_dim, Dp = c.head_dim_padded;
  const int64_t Hq = c.d.num_q_heads, M = t.rows * G, stride = c.max_rows * Dp;
  const int64_t q_begin = QueryStartAt(c.qsl, n), q_len = QueryStartAt(c.qsl, n + 1) - q_begin;
  const int64_t kv_len = c.kv_lens[n];
  const int64_t kv_start = c.kv_starts ? c.kv_starts[n] : 0;

  // Row r of the block, head g of the group, is row r * G + g of Q, S and O.
  int64_t key_begin = kv_len, key_end = 0;
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t pos = kv_len - q_len + t.row_begin + r;
    int64_t lo = kv_start, hi = p.causal ? pos + 1 : kv_len;
    if (p.window_left >= 0) lo = std::max(lo, pos - p.window_left);
    if (hi < lo) hi = lo;
    if (lo < hi) {
      key_begin = std::min(key_begin, lo);
      key_end = std::max(key_end, hi);
    }
    for (int64_t g = 0; g < G; ++g) {
      sc.lo[r * G + g] = static_cast<int32_t>(lo);
      sc.hi[r * G + g] = static_cast<int32_t>(hi);
    }
  }
  for (int64_t i = 0; i < t.heads; ++i) {
    const int64_t h = t.head_begin + i;
    float *q = sc.q.get() + i * stride, *m = sc.m.get() + i * c.max_rows;
    float* l = sc.l.get() + i * c.max_rows;
    for (int64_t row = 0; row < M; ++row) {
      const int64_t token = q_begin + t.row_begin + row / G, head = h * G + row % G;
      float* qr = q + row * Dp;
      cpu::ConvertRow(p.q.data, p.q.dtype, (token * Hq + head) * D, D, qr);
      for (int64_t k = 0; k < D; ++k) qr[k] *= c.q_scale;
      // A sink is a logit that is always visible and carries no value.
      const bool sink = p.sinks.present();
      m[row] = sink ? cpu::LoadScalar(p.sinks.data, p.sinks.dtype, head) : -kInf;
      l[row] = sink ? 1.0f : 0.0f;
    }
    std::fill(sc.o.get() + i * stride, sc.o.get() + i * stride + M * Dp, 0.0f);
  }

  // Heads innermost: with the token-major layout they share the cache lines of a slot.
  for (int64_t j0 = key_begin; j0 < key_end; j0 += c.block_kv) {
    const int64_t nk = std::min(c.block_kv, key_end - j0);
    for (int64_t i = 0; i < t.heads; ++i) {
      AttendTile(c, n, t.head_begin + i, j0, nk, key_end, M, sc.q.get() + i * stride,
                 sc.o.get() + i * stride, sc.m.get() + i * c.max_rows,
                 sc.l.get() + i * c.max_rows, sc);
    }
  }

  for (int64_t i = 0; i < t.heads; ++i) {
    const float* o = sc.o.get() + i * stride;
    const float* l = sc.l.get() + i * c.max_rows;
    for (int64_t row = 0; row < M; ++row) {
      const int64_t token = q_begin + t.row_begin + row / G;
      const int64_t head = (t.head_begin + i) * G + row % G;
      // l is 0 for a row that saw nothing, NaN for one that saw a NaN.
      const float scale = l[row] == 0.0f ? 0.0f : c.v_scale / l[row];
      cpu::StoreRow(o + row * Dp, D, scale, p.out.data, p.out.dtype, (token * Hq + head) * D);
    }
  }
}

int NumThreads(int configured, int64_t tasks) {
#ifdef _OPENMP
  const int64_t n = configured > 0 ? configured : omp_get_max_threads();
#else
  const int64_t n = 1;
#endif
  return static_cast<int>(std::max<int64_t>(1, std::min(n, tasks)));
}

Status CheckConfig(const Config& cfg) {
  if (cfg.num_splits < 0 || cfg.block_kv < 1 || cfg.block_kv > 4096 || cfg.num_threads < 0) {
    return Status::InvalidArgument(
        "config: num_splits >= 0, block_kv in [1, 4096] and num_threads >= 0 required, got "
        "num_splits=" + std::to_string(cfg.num_splits) + " block_kv=" +
        std::to_string(cfg.block_kv) + " num_threads=" + std::to_string(cfg.num_threads));
  }
  return Status::Ok();
}

// Writes zeros over out rows [begin, end).
void ZeroRows(const TensorView& out, int64_t begin, int64_t end, int64_t row_elements) {
  if (end <= begin) return;
  const int64_t bytes = DTypeSize(out.dtype);
  std::memset(static_cast<char*>(out.data) + begin * row_elements * bytes, 0,
              static_cast<size_t>((end - begin) * row_elements * bytes));
}

}  // namespace

Status AttentionCpu(const Params& p, const Config& cfg) {
  EJK_ASSIGN_OR_RETURN(const Dims d, Validate(p));
  EJK_RETURN_IF_ERROR(CheckConfig(cfg));
  EJK_RETURN_IF_ERROR(ValidateMetadataValues(p, d));

  Context c;
  c.p = &p;
  c.d = d;
  c.group = d.num_q_heads / d.num_kv_heads;
  c.head_dim_padded = cpu::RoundUp(d.head_dim, kKeyGroup);
  c.rows_per_block = std::max<int64_t>(1, kTargetRows / c.group);
  c.max_rows = c.rows_per_block * c.group;
  c.block_kv = cpu::RoundUp(cfg.block_kv, kKeyGroup);
  c.kv_lens = p.kv_lens.ptr<int32_t>();
  c.tables = p.block_tables.ptr<int32_t>();
  c.qsl = QueryStartLoc(p.query_start_loc);  // null: one row per sequence
  c.kv_starts = p.kv_starts.present() ? p.kv_starts.ptr<int32_t>() : nullptr;
  // The key scale and the soft cap's 1 / cap fold into the queries.
  c.cap = p.logits_soft_cap;
  c.q_scale = p.softmax_scale * p.k_scale / (c.cap > 0.0f ? c.cap : 1.0f);
  c.v_scale = p.v_scale;

  const int64_t num_seqs = p.num_seqs.ptr<int32_t>()[0];
  const int64_t row_elements = d.num_q_heads * d.head_dim;
  ZeroRows(p.out, QueryStartAt(c.qsl, num_seqs), d.num_tokens, row_elements);

  // Query blocks of the present sequences; each becomes one task per group of kv heads.
  struct Block {
    int64_t seq, row_begin, rows, keys;
  };
  std::vector<Block> blocks;
  for (int64_t n = 0; n < num_seqs; ++n) {
    const int64_t q_len = QueryStartAt(c.qsl, n + 1) - QueryStartAt(c.qsl, n);
    for (int64_t r0 = 0; r0 < q_len; r0 += c.rows_per_block) {
      const int64_t rows = std::min(c.rows_per_block, q_len - r0);
      // Work grows with the keys the block's last row may see.
      blocks.push_back(Block{n, r0, rows, c.kv_lens[n] - q_len + r0 + rows});
    }
  }
  if (blocks.empty()) return Status::Ok();
  const int64_t Hkv = d.num_kv_heads, num_blocks = static_cast<int64_t>(blocks.size());
  const int max_threads = NumThreads(cfg.num_threads, num_blocks * Hkv);
  // Head-major pages hold one head's keys contiguously: one head per task. Token-major
  // pages interleave the heads per slot, so a task takes as many heads as parallelism allows.
  int64_t heads_per_task = 1;
  if (p.layout == KvLayout::kTokenMajor) {
    const int64_t groups = std::min<int64_t>(Hkv, (4 * max_threads + num_blocks - 1) / num_blocks);
    heads_per_task = (Hkv + groups - 1) / groups;
  }
  c.heads_per_task = heads_per_task;
  std::vector<Task> tasks;
  for (const Block& b : blocks) {
    for (int64_t h = 0; h < Hkv; h += heads_per_task) {
      const int64_t heads = std::min(heads_per_task, Hkv - h);
      tasks.push_back(Task{static_cast<int32_t>(b.seq), static_cast<int32_t>(h),
                           static_cast<int32_t>(heads), static_cast<int32_t>(b.row_begin),
                           static_cast<int32_t>(b.rows), heads * b.rows * (b.keys + 64)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });

  const int threads = NumThreads(cfg.num_threads, static_cast<int64_t>(tasks.size()));
  std::vector<Scratch> scratch;
  try {
    scratch.reserve(threads);
    for (int t = 0; t < threads; ++t) scratch.emplace_back(c);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("paged attention CPU: out of memory for scratch");
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < num_tasks; ++i) RunTask(c, tasks[i], scratch[cpu::ThreadIndex()]);
  return Status::Ok();
}

Status CacheUpdateCpu(const CacheUpdateParams& p) {
  EJK_ASSIGN_OR_RETURN(const Dims d, ValidateCacheUpdate(p));
  EJK_RETURN_IF_ERROR(ValidateCacheUpdateMetadataValues(p, d));
  const int32_t* kv_lens = p.kv_lens.ptr<int32_t>();
  const int32_t* tables = p.block_tables.ptr<int32_t>();
  const int32_t* qsl = QueryStartLoc(p.query_start_loc);  // null: one row per sequence
  const int64_t num_seqs = p.num_seqs.ptr<int32_t>()[0];
  const int64_t Hkv = d.num_kv_heads, D = d.head_dim, S = d.page_size;
  const int64_t M = d.max_pages_per_seq;

  // (sequence, destination key position) of every row that a present sequence owns.
  struct Row {
    int64_t token, seq, pos;
  };
  std::vector<Row> rows;
  for (int64_t n = 0; n < num_seqs; ++n) {
    const int64_t q_begin = QueryStartAt(qsl, n), q_len = QueryStartAt(qsl, n + 1) - q_begin;
    for (int64_t r = 0; r < q_len; ++r) rows.push_back(Row{q_begin + r, n, kv_lens[n] - q_len + r});
  }
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  const int threads = NumThreads(0, num_rows * Hkv / 64 + 1);

#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_rows * Hkv; ++i) {
      const Row& row = rows[i / Hkv];
      const int64_t h = i % Hkv;
      const int64_t page = tables[row.seq * M + row.pos / S], slot = row.pos % S;
      const int64_t dst = p.layout == KvLayout::kHeadMajor ? ((page * Hkv + h) * S + slot) * D
                                                           : ((page * S + slot) * Hkv + h) * D;
      const int64_t src = (row.token * Hkv + h) * D;
      const struct {
        const TensorView* in;
        const TensorView* cache;
        float scale;
      } parts[] = {{&p.new_keys, &p.key_cache, p.k_scale}, {&p.new_values, &p.value_cache, p.v_scale}};
      for (const auto& part : parts) {
        cpu::ConvertRow(part.in->data, part.in->dtype, src, D, buf.data());
        if (part.cache->dtype == DType::kF8E4M3) {
          uint8_t* out = part.cache->ptr<uint8_t>() + dst;
          for (int64_t k = 0; k < D; ++k) out[k] = FloatToF8E4M3(buf[k] / part.scale);
        } else {
          cpu::StoreRow(buf.data(), D, 1.0f, part.cache->data, part.cache->dtype, dst);
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace ejk::paged_attention
