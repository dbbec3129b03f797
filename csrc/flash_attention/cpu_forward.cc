// CPU flash attention forward: online softmax over key tiles (FlashAttention-2), one task
// per (batch, query head, query block), f32 accumulation.
//
// A task keeps its query block transposed, Q^T [D][rows], so that both products run on
// the GEMM micro-kernel without transposing any key tile: S^T [keys][rows] = K Q^T and
// O^T [D][rows] += V^T P^T. Softmax statistics are then per column, i.e. vectors across
// query rows, and the row max / row sum are plain vector max / add over the key tile.
#include <cmath>

#include "flash_attention/cpu_common.h"
#include "flash_attention/params.h"
#include "flash_attention/semantics.h"

namespace ejk::flash_attention {
namespace {

using cpu::Accumulate;
using cpu::FloatBuffer;
using cpu::kInf;
using cpu::kLanes;
using cpu::VecF;
using cpu::VecI;
using cpu::VecU;

struct ForwardContext {
  const ForwardParams* p;
  Dims d;
  cpu::RowRanges rows;
  int64_t group, head_dim_padded, block_q, block_q_padded, block_k, num_q_blocks;
  float softmax_scale, cap, keep_scale;
  uint32_t dropout_threshold;
  bool dropout;
};

struct ForwardScratch {
  FloatBuffer qt, ot, st, kt, vt, row, m, l, alpha;
  std::vector<int32_t> lo, hi, seg;
  std::vector<uint32_t> row_key, key_begin;

  explicit ForwardScratch(const ForwardContext& c)
      : qt(c.head_dim_padded * c.block_q_padded),
        ot(c.head_dim_padded * c.block_q_padded),
        st(c.block_k * c.block_q_padded),
        kt(c.block_k * c.head_dim_padded),
        vt(c.block_k * c.head_dim_padded),
        row(std::max(c.block_k, c.head_dim_padded)),
        m(c.block_q_padded),
        l(c.block_q_padded),
        alpha(c.block_q_padded),
        lo(c.block_q_padded),
        hi(c.block_q_padded),
        seg(c.block_q_padded),
        row_key(c.block_q_padded),
        key_begin(c.block_q_padded) {}
};

// x -> cap * tanh(x) (n a multiple of kLanes; the 1 / cap is folded into Q^T).
void SoftCap(float* x, int64_t n, float cap) {
  const VecF c = cpu::Splat(cap);
  for (int64_t i = 0; i < n; i += kLanes) cpu::StoreF(x + i, c * cpu::Tanh(cpu::LoadF(x + i)));
}

void ForwardBlock(const ForwardContext& c, int64_t b, int64_t h, int64_t i0, ForwardScratch& s) {
  const ForwardParams& p = *c.p;
  const Dims& d = c.d;
  const int64_t D = d.head_dim, Sq = d.seqlen_q, Sk = d.seqlen_k;
  const int64_t Hq = d.num_q_heads, Hkv = d.num_kv_heads, kvh = h / c.group;
  const int64_t Dp = c.head_dim_padded, BQp = c.block_q_padded, nvr = BQp / kLanes;
  const int64_t nr = std::min(c.block_q, Sq - i0);
  float *qt = s.qt.get(), *ot = s.ot.get(), *st = s.st.get(), *kt = s.kt.get(), *vt = s.vt.get();
  float *m = s.m.get(), *l = s.l.get(), *alpha = s.alpha.get(), *row = s.row.get();

  // Per row: visible key range and the softmax state, where a sink starts as a visible
  // logit that carries no value. Rows r >= nr are padding of the vectors and see nothing.
  const bool sink = p.softmax_aux.present();
  const float aux = sink ? cpu::LoadScalar(p.softmax_aux.data, p.softmax_aux.dtype, h) : 0.0f;
  int64_t key_begin = Sk, key_end = 0, lo_max = 0, hi_min = Sk;
  for (int64_t r = 0; r < BQp; ++r) {
    const bool in = r < nr;
    const int32_t lo = in ? c.rows.lo[i0 + r] : 0, hi = in ? c.rows.hi[i0 + r] : 0;
    s.lo[r] = lo;
    s.hi[r] = hi;
    if (in) {
      lo_max = std::max<int64_t>(lo_max, lo);
      hi_min = std::min<int64_t>(hi_min, hi);
    }
    if (lo < hi) {
      key_begin = std::min<int64_t>(key_begin, lo);
      key_end = std::max<int64_t>(key_end, hi);
    }
    const bool has_sink = sink && in && c.rows.real[i0 + r];
    m[r] = has_sink ? aux : -kInf;
    l[r] = has_sink ? 1.0f : 0.0f;
    s.row_key[r] = DropoutRowKey(
        p.dropout_seed,
        DropoutBatchHead(p.dropout_origin, static_cast<uint32_t>(Hq), static_cast<uint32_t>(b), static_cast<uint32_t>(h)),
        static_cast<uint32_t>(i0 + r));
    s.key_begin[r] = in ? c.rows.key_begin[i0 + r] : 0u;
  }
  const bool segments = p.q_segment_ids.present();
  const int32_t* kv_seg = segments ? p.kv_segment_ids.ptr<int32_t>() + b * Sk : nullptr;
  cpu::IdRange row_ids{};
  if (segments) {
    for (int64_t r = 0; r < BQp; ++r) s.seg[r] = r < nr ? p.q_segment_ids.ptr<int32_t>()[b * Sq + i0 + r] : 0;
    row_ids = cpu::IdRangeOf(s.seg.data(), nr);
  }

  // The softmax scale (and 1 / cap) goes into Q^T once instead of into every logit.
  cpu::LoadRowsTransposed(p.q, ((b * Sq + i0) * Hq + h) * D, Hq * D, nr, D, qt, BQp, row);
  const VecF q_scale = cpu::Splat(c.cap > 0.0f ? c.softmax_scale / c.cap : c.softmax_scale);
  for (int64_t k = 0; k < D * BQp; k += kLanes) cpu::StoreF(qt + k, cpu::LoadF(qt + k) * q_scale);
  std::fill(ot, ot + D * BQp, 0.0f);

  const int64_t bias_b = p.bias.present() && p.bias.dim(0) != 1 ? b : 0;
  const int64_t bias_h = p.bias.present() && p.bias.dim(1) != 1 ? h : 0;
  const int64_t mask_b = p.mask.present() && p.mask.dim(0) != 1 ? b : 0;
  const int64_t mask_h = p.mask.present() && p.mask.dim(1) != 1 ? h : 0;

  // f32 keys and values are read in place (they are only ever broadcast operands); other
  // dtypes are converted tile by tile. The next tile's rows are prefetched meanwhile.
  const bool in_place = p.k.dtype == DType::kF32;
  const int64_t kv_stride = Hkv * D, kv_bytes = DTypeSize(p.k.dtype);
  const char* k_rows = static_cast<const char*>(p.k.data) + ((b * Sk) * Hkv + kvh) * D * kv_bytes;
  const char* v_rows = static_cast<const char*>(p.v.data) + ((b * Sk) * Hkv + kvh) * D * kv_bytes;
  const auto key_rows = [&](int64_t j, int64_t rows, int64_t steps) {
    cpu::Prefetcher f;
    f.Add(k_rows + j * kv_stride * kv_bytes, rows, kv_stride * kv_bytes, D * kv_bytes);
    f.Add(v_rows + j * kv_stride * kv_bytes, rows, kv_stride * kv_bytes, D * kv_bytes);
    f.Spread(steps);
    return f;
  };
  key_rows(key_begin, std::min(c.block_k, key_end - key_begin), 1).Step();
  for (int64_t j0 = key_begin; j0 < key_end; j0 += c.block_k) {
    const int64_t nk = std::min(c.block_k, key_end - j0);
    // With segment ids, a key tile that shares no id with the rows is skipped, and one whose
    // keys and rows hold one id needs no id test.
    bool test_ids = segments;
    if (segments) {
      const cpu::IdRange key_ids = cpu::IdRangeOf(kv_seg + j0, nk);
      if (key_ids.Misses(row_ids)) continue;
      test_ids = !key_ids.SameSingleId(row_ids);
    }
    cpu::Prefetcher next = key_rows(j0 + nk, std::min(c.block_k, key_end - j0 - nk),
                                    cpu::MicroTileCount(nk, nvr) + cpu::MicroTileCount(D, nvr));
    const int64_t kv_offset = ((b * Sk + j0) * Hkv + kvh) * D;
    const float *keys = kt, *values = vt;
    int64_t ld = Dp;
    if (in_place) {
      keys = p.k.ptr<float>() + kv_offset;
      values = p.v.ptr<float>() + kv_offset;
      ld = kv_stride;
    } else {
      cpu::LoadRows(p.k, kv_offset, kv_stride, nk, D, kt, Dp);
      cpu::LoadRows(p.v, kv_offset, kv_stride, nk, D, vt, Dp);
    }

    cpu::Gemm<Accumulate::kOverwrite>(nk, nvr, D, keys, ld, 1, qt, BQp, st, BQp, nullptr, &next);
    if (c.cap > 0.0f) SoftCap(st, nk * BQp, c.cap);
    if (p.bias.present()) {
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t offset = ((bias_b * p.bias.dim(1) + bias_h) * Sq + i0 + r) * Sk + j0;
        cpu::ConvertRow(p.bias.data, p.bias.dtype, offset, nk, row);
        for (int64_t j = 0; j < nk; ++j) st[j * BQp + r] += row[j];
      }
    }
    if (p.mask.present()) {
      for (int64_t r = 0; r < nr; ++r) {
        const uint8_t* mask_row = p.mask.ptr<uint8_t>() +
                                  ((mask_b * p.mask.dim(1) + mask_h) * Sq + i0 + r) * Sk + j0;
        for (int64_t j = 0; j < nk; ++j) {
          if (!mask_row[j]) st[j * BQp + r] = -kInf;
        }
      }
    }

    // Only tiles that cross some row's causal/window/sequence edge need the range test.
    const bool positional = !(lo_max <= j0 && hi_min >= j0 + nk);
    for (int64_t v = 0; v < nvr; ++v) {
      float* col = st + v * kLanes;
      const VecF m_old = cpu::LoadF(m + v * kLanes);
      VecF m_new = m_old;
      if (positional || test_ids) {
        const VecI lo = cpu::LoadI(s.lo.data() + v * kLanes), hi = cpu::LoadI(s.hi.data() + v * kLanes);
        const VecI seg = cpu::LoadI(s.seg.data() + v * kLanes);
        for (int64_t j = 0; j < nk; ++j) {
          const VecI key = cpu::SplatI(static_cast<int32_t>(j0 + j));
          VecI visible = (key >= lo) & (key < hi);
          if (test_ids) visible &= seg == cpu::SplatI(kv_seg[j0 + j]);
          const VecF x = cpu::Select(visible, cpu::LoadF(col + j * BQp), cpu::Splat(-kInf));
          cpu::StoreF(col + j * BQp, x);
          m_new = cpu::Max(m_new, x);
        }
      } else {
        for (int64_t j = 0; j < nk; ++j) m_new = cpu::Max(m_new, cpu::LoadF(col + j * BQp));
      }
      // A row that has seen nothing keeps max -inf; exp against 0 then gives exact zeros.
      const VecF ref = cpu::Select(m_new == cpu::Splat(-kInf), VecF{}, m_new);
      const VecF a = cpu::Exp(m_old - ref);
      VecF sum{};
      if (c.dropout) {
        const VecU row_key = cpu::LoadU(s.row_key.data() + v * kLanes);
        const VecU row_key_begin = cpu::LoadU(s.key_begin.data() + v * kLanes);
        const VecU threshold = cpu::SplatU(c.dropout_threshold);
        for (int64_t j = 0; j < nk; ++j) {
          const VecF e = cpu::Exp(cpu::LoadF(col + j * BQp) - ref);
          sum += e;
          const VecU draw = DropoutDraw(row_key, cpu::SplatU(static_cast<uint32_t>(j0 + j)) - row_key_begin);
          cpu::StoreF(col + j * BQp, cpu::Select(draw >= threshold, e, VecF{}));
        }
      } else {
        for (int64_t j = 0; j < nk; ++j) {
          const VecF e = cpu::Exp(cpu::LoadF(col + j * BQp) - ref);
          sum += e;
          cpu::StoreF(col + j * BQp, e);
        }
      }
      cpu::StoreF(l + v * kLanes, cpu::Fma(a, cpu::LoadF(l + v * kLanes), sum));
      cpu::StoreF(m + v * kLanes, m_new);
      cpu::StoreF(alpha + v * kLanes, a);
    }
    // O^T = O^T diag(alpha) + V^T P^T, with V^T read from the V tile by broadcasts.
    cpu::Gemm<Accumulate::kScaleAdd>(D, nvr, nk, values, 1, ld, st, BQp, ot, BQp, alpha, &next);
  }

  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = i0 + r;
    const float inv = l[r] > 0.0f ? c.keep_scale / l[r] : 0.0f;
    for (int64_t k = 0; k < D; ++k) row[k] = ot[k * BQp + r];
    cpu::StoreRow(row, D, inv, p.out.data, p.out.dtype, ((b * Sq + i) * Hq + h) * D);
    p.lse.ptr<float>()[(b * Hq + h) * Sq + i] = l[r] > 0.0f ? m[r] + std::log(l[r]) : -kInf;
  }
}

}  // namespace

Status ForwardCpu(const ForwardParams& p, const CpuConfig& cfg) {
  EJK_ASSIGN_OR_RETURN(const Dims d, ValidateForward(p));
  EJK_RETURN_IF_ERROR(ValidateCuSeqlensValues(p, d));
  EJK_RETURN_IF_ERROR(cpu::CheckConfig(cfg));

  ForwardContext c;
  c.p = &p;
  c.d = d;
  c.group = d.num_q_heads / d.num_kv_heads;
  c.head_dim_padded = cpu::RoundUp(d.head_dim, kLanes);
  c.block_q = std::min<int64_t>(cfg.block_q, std::max<int64_t>(d.seqlen_q, 1));
  c.block_q_padded = cpu::RoundUp(c.block_q, kLanes);
  c.block_k = std::min<int64_t>(cfg.block_k, std::max<int64_t>(d.seqlen_k, 1));
  c.num_q_blocks = (d.seqlen_q + c.block_q - 1) / c.block_q;
  c.softmax_scale = p.softmax_scale;
  c.cap = p.logits_soft_cap;
  c.dropout = p.dropout_prob > 0.0f;
  c.keep_scale = c.dropout ? 1.0f / (1.0f - p.dropout_prob) : 1.0f;
  c.dropout_threshold = DropoutThreshold(p.dropout_prob);

  const int64_t num_tasks = d.batch * d.num_q_heads * c.num_q_blocks;
  if (num_tasks == 0) return Status::Ok();
  const int threads = cpu::NumThreads(cfg, num_tasks);
  std::vector<ForwardScratch> scratch;
  try {
    c.rows = cpu::ComputeRowRanges(p, d);
    scratch.reserve(threads);
    for (int t = 0; t < threads; ++t) scratch.emplace_back(c);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("flash attention CPU forward: out of memory for scratch");
  }

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t t = 0; t < num_tasks; ++t) {
    // Later query blocks see more keys under a causal mask: hand them out first.
    const int64_t qb = c.num_q_blocks - 1 - t % c.num_q_blocks;
    const int64_t bh = t / c.num_q_blocks;
    ForwardBlock(c, bh / d.num_q_heads, bh % d.num_q_heads, qb * c.block_q,
                 scratch[cpu::ThreadIndex()]);
  }
  return Status::Ok();
}

}  // namespace ejk::flash_attention
