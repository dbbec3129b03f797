// CPU flash attention backward (FlashAttention-2: P recomputed from the saved lse).
//
// One task per (key block, group of (batch, kv head) pairs). For each pair it holds K and V
// of its key block (also transposed) and dK, dV accumulators, and visits the query blocks
// of every query head of the kv group in order: S = Q K^T, dP = dO V^T, dS, then
// dV += P~^T dO, dK += dS^T Q and dQ += dS K, so S is computed once (no second pass over
// the query blocks recomputes it for dQ).
//
// dQ rows receive one contribution per key block, from different tasks. To stay race-free
// and bit-identical for any thread count, a task adds into a query block only after the
// task of the previous key block (same pairs) has added its own: tasks publish how many
// (pair, query block) steps they have finished, and are handed out in increasing order, so
// the lowest running task never waits. Key blocks are the slow index of the task order,
// which keeps a task's predecessor far ahead.
//
// dbias is written by the task that owns its key block; where the bias broadcasts over
// batch or heads, one task takes all the (batch, kv head) pairs that sum into it.
#include <atomic>
#include <cmath>
#include <memory>
#include <thread>

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

struct alignas(64) Progress {
  std::atomic<int64_t> steps{0};
};

void WaitUntil(const Progress& p, int64_t steps) {
  for (int spins = 0; p.steps.load(std::memory_order_acquire) < steps; ++spins) {
    if (spins < 256) {
#if defined(__x86_64__) || defined(__i386__)
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

struct BackwardContext {
  const BackwardParams* bp;
  const ForwardParams* p;
  Dims d;
  cpu::RowRanges rows;
  std::vector<int32_t> block_lo, block_hi;  // per query block: the union of its rows' ranges
  int64_t group, head_dim_padded, block_q, block_k, block_k_padded, num_q_blocks, num_k_blocks;
  int64_t batches_per_task, kv_heads_per_task, num_pair_groups, steps_per_task;
  float softmax_scale, cap, keep_scale;
  VecF logit_scale;  // folded into K^T: softmax_scale, divided by cap when capping
  uint32_t dropout_threshold;
  bool dropout, rows_in_place;
  const float* delta;  // [B, Hq, Sq]: rowsum(dout * out) - dlse
  float* dq_acc;       // [B, Hq, Sq, head_dim_padded], unscaled
  Progress* progress;
};

struct BackwardScratch {
  FloatBuffer kt, kT, vT, dk, dv, q, dout, s, dp, tanh, row, row2;
  std::vector<int32_t> seg;

  explicit BackwardScratch(const BackwardContext& c)
      : kt(c.block_k * c.head_dim_padded),
        kT(c.head_dim_padded * c.block_k_padded),
        vT(c.head_dim_padded * c.block_k_padded),
        dk(c.block_k * c.head_dim_padded),
        dv(c.block_k * c.head_dim_padded),
        q(c.block_q * c.head_dim_padded),
        dout(c.block_q * c.head_dim_padded),
        s(c.block_q * c.block_k_padded),
        dp(c.block_q * c.block_k_padded),
        tanh(c.cap > 0.0f ? c.block_q * c.block_k_padded : 0),
        row(std::max(c.block_k_padded, c.head_dim_padded)),
        row2(std::max(c.block_k_padded, c.head_dim_padded)),
        seg(c.block_k) {}
};

// Where the next TileGradients call's query and dout rows start (prefetched meanwhile).
struct NextRows {
  int64_t row = 0, rows = 0, head = 0;
};

// Rows [i_first, i_first + nr) of head h against keys [j0, j0 + nk): leaves the dropped P
// in s.s and dS (gradient wrt the pre-cap logit, without the softmax scale) in s.dp, adds
// dS wrt the biased logit into dbias, and accumulates dV and dK.
void TileGradients(const BackwardContext& c, BackwardScratch& s, int64_t b, int64_t h,
                   int64_t i_first, int64_t nr, int64_t j0, int64_t nk, const NextRows& next) {
  const BackwardParams& bp = *c.bp;
  const ForwardParams& p = *c.p;
  const Dims& d = c.d;
  const int64_t D = d.head_dim, Sq = d.seqlen_q, Sk = d.seqlen_k, Hq = d.num_q_heads;
  const int64_t Dp = c.head_dim_padded, BKp = c.block_k_padded;
  const int64_t nvk = BKp / kLanes, nvd = Dp / kLanes;
  const int64_t row_offset = ((b * Sq + i_first) * Hq + h) * D;
  // f32 rows whose length is a whole number of vectors are read in place.
  const float *q = s.q.get(), *dout = s.dout.get();
  int64_t ld = Dp;
  if (c.rows_in_place) {
    q = p.q.ptr<float>() + row_offset;
    dout = bp.dout.ptr<float>() + row_offset;
    ld = Hq * D;
  } else {
    cpu::LoadRows(p.q, row_offset, Hq * D, nr, D, s.q.get(), Dp);
    cpu::LoadRows(bp.dout, row_offset, Hq * D, nr, D, s.dout.get(), Dp);
  }
  // This call's dQ rows (read by the dQ product that follows it) and the next call's query
  // and dout rows are prefetched during the products here.
  cpu::Prefetcher prefetch;
  prefetch.Add(c.dq_acc + ((b * Hq + h) * Sq + i_first) * Dp, nr, Dp * sizeof(float), D * sizeof(float));
  const int64_t elem = DTypeSize(p.q.dtype);
  const int64_t next_offset = ((b * Sq + next.row) * Hq + next.head) * D * elem;
  if (next.rows > 0) {
    prefetch.Add(static_cast<const char*>(p.q.data) + next_offset, next.rows, Hq * D * elem, D * elem);
    prefetch.Add(static_cast<const char*>(bp.dout.data) + next_offset, next.rows, Hq * D * elem, D * elem);
  }
  prefetch.Spread(2 * cpu::MicroTileCount(nr, nvk) + 2 * cpu::MicroTileCount(nk, nvd));
  cpu::Gemm<Accumulate::kOverwrite>(nr, nvk, D, q, ld, 1, s.kT.get(), BKp, s.s.get(), BKp, nullptr, &prefetch);
  cpu::Gemm<Accumulate::kOverwrite>(nr, nvk, D, dout, ld, 1, s.vT.get(), BKp, s.dp.get(), BKp, nullptr, &prefetch);

  const float* lse = p.lse.ptr<float>() + (b * Hq + h) * Sq;
  const float* delta = c.delta + (b * Hq + h) * Sq;
  const bool segments = p.q_segment_ids.present();
  const bool dbias = bp.dbias.present();
  int64_t bias_row0 = 0;
  if (p.bias.present()) {
    const int64_t bb = p.bias.dim(0) != 1 ? b : 0, bh = p.bias.dim(1) != 1 ? h : 0;
    bias_row0 = (bb * p.bias.dim(1) + bh) * Sq;
  }
  const uint8_t* mask = nullptr;
  if (p.mask.present()) {
    const int64_t mb = p.mask.dim(0) != 1 ? b : 0, mh = p.mask.dim(1) != 1 ? h : 0;
    mask = p.mask.ptr<uint8_t>() + (mb * p.mask.dim(1) + mh) * Sq * Sk;
  }
  const VecF cap = cpu::Splat(c.cap);
  const VecI iota = cpu::Iota();

  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = i_first + r;
    float* srow = s.s.get() + r * BKp;
    float* dsrow = s.dp.get() + r * BKp;
    float* trow = c.cap > 0.0f ? s.tanh.get() + r * BKp : nullptr;
    const int64_t lo = std::max<int64_t>(c.rows.lo[i], j0);
    const int64_t hi = std::min<int64_t>(c.rows.hi[i], j0 + nk);
    // lse = -inf: the row saw nothing, P = 0 (exp against +inf, as the forward defines it).
    if (lo >= hi || lse[i] == -kInf) {
      std::fill(srow, srow + BKp, 0.0f);
      std::fill(dsrow, dsrow + BKp, 0.0f);
      continue;
    }
    // K^T carries the softmax scale (and 1 / cap), so srow already holds the scaled logits.
    if (trow) {
      for (int64_t v = 0; v < nvk; ++v) {
        const VecF t = cpu::Tanh(cpu::LoadF(srow + v * kLanes));
        cpu::StoreF(trow + v * kLanes, t);
        cpu::StoreF(srow + v * kLanes, cap * t);
      }
    }
    if (p.bias.present()) {
      cpu::AddRow(p.bias.data, p.bias.dtype, (bias_row0 + i) * Sk + j0, nk, srow, s.row.get());
    }
    if (mask) {
      const uint8_t* mask_row = mask + i * Sk + j0;
      for (int64_t j = 0; j < nk; ++j) srow[j] = mask_row[j] ? srow[j] : -kInf;
    }
    if (segments) {
      const int32_t seg_q = p.q_segment_ids.ptr<int32_t>()[b * Sq + i];
      for (int64_t j = 0; j < nk; ++j) srow[j] = s.seg[j] == seg_q ? srow[j] : -kInf;
    }

    const VecF row_lse = cpu::Splat(lse[i]), row_delta = cpu::Splat(delta[i]);
    const VecI lo_v = cpu::SplatI(static_cast<int32_t>(lo)), hi_v = cpu::SplatI(static_cast<int32_t>(hi));
    const VecU row_key = cpu::SplatU(
        c.dropout ? DropoutRowKey(p.dropout_seed,
                                  DropoutBatchHead(p.dropout_origin, static_cast<uint32_t>(Hq), static_cast<uint32_t>(b),
                                                   static_cast<uint32_t>(h)),
                                  static_cast<uint32_t>(i))
                  : 0u);
    const VecU row_key_begin = cpu::SplatU(c.rows.key_begin[i]);
    // Columns past nk hold finite junk that no product reads, so only rows whose range
    // ends inside the tile need the range test.
    const bool partial = lo > j0 || hi < j0 + nk;
    for (int64_t v = 0; v < nvk; ++v) {
      const VecI key = iota + static_cast<int32_t>(j0 + v * kLanes);
      VecF pv = cpu::Exp(cpu::LoadF(srow + v * kLanes) - row_lse);
      if (partial) pv = cpu::Select((key >= lo_v) & (key < hi_v), pv, VecF{});
      VecF dpv = cpu::LoadF(dsrow + v * kLanes);
      VecF kept = pv;
      if (c.dropout) {
        const VecU draw = DropoutDraw(row_key, reinterpret_cast<VecU>(key) - row_key_begin);
        const VecF z = cpu::Select(draw >= cpu::SplatU(c.dropout_threshold),
                                   cpu::Splat(c.keep_scale), VecF{});
        kept = pv * z;
        dpv = dpv * z;
      }
      cpu::StoreF(srow + v * kLanes, kept);
      cpu::StoreF(dsrow + v * kLanes, pv * (dpv - row_delta));
    }
    if (dbias && bp.dbias.dtype == DType::kF32) {
      float* dbias_row = bp.dbias.ptr<float>() + (bias_row0 + i) * Sk + j0;
#pragma omp simd
      for (int64_t j = 0; j < nk; ++j) dbias_row[j] += dsrow[j];
    } else if (dbias) {  // bf16/f16: this is the element's only write (BiasGradSummed is false)
      cpu::StoreRow(dsrow, nk, 1.0f, bp.dbias.data, bp.dbias.dtype, (bias_row0 + i) * Sk + j0);
    }
    if (trow) {
      for (int64_t v = 0; v < nvk; ++v) {
        const VecF t = cpu::LoadF(trow + v * kLanes);
        cpu::StoreF(dsrow + v * kLanes, cpu::LoadF(dsrow + v * kLanes) * (cpu::Splat(1.0f) - t * t));
      }
    }
  }

  // dV += P~^T dO and dK += dS^T Q: A(j, r) is column j of the row-major [rows][keys] tile.
  cpu::Gemm<Accumulate::kAdd>(nk, nvd, nr, s.s.get(), 1, BKp, dout, ld, s.dv.get(), Dp, nullptr, &prefetch);
  cpu::Gemm<Accumulate::kAdd>(nk, nvd, nr, s.dp.get(), 1, BKp, q, ld, s.dk.get(), Dp, nullptr, &prefetch);
}

void BackwardTask(const BackwardContext& c, int64_t task, BackwardScratch& s) {
  const BackwardParams& bp = *c.bp;
  const ForwardParams& p = *c.p;
  const Dims& d = c.d;
  const int64_t D = d.head_dim, Sq = d.seqlen_q, Sk = d.seqlen_k, Hq = d.num_q_heads;
  const int64_t Hkv = d.num_kv_heads, Dp = c.head_dim_padded, BKp = c.block_k_padded;
  const int64_t nvd = Dp / kLanes;
  const int64_t kb = task / c.num_pair_groups, pair_group = task % c.num_pair_groups;
  const int64_t j0 = kb * c.block_k, nk = std::min(c.block_k, Sk - j0);
  const int64_t kv_head_groups = Hkv / c.kv_heads_per_task;
  const int64_t b_first = pair_group / kv_head_groups * c.batches_per_task;
  const int64_t kvh_first = pair_group % kv_head_groups * c.kv_heads_per_task;
  const Progress* previous = kb > 0 ? &c.progress[task - c.num_pair_groups] : nullptr;
  Progress& mine = c.progress[task];

  for (int64_t pb = 0; pb < c.batches_per_task; ++pb) {
    for (int64_t ph = 0; ph < c.kv_heads_per_task; ++ph) {
      const int64_t b = b_first + pb, kvh = kvh_first + ph;
      const int64_t pair = pb * c.kv_heads_per_task + ph;
      const int64_t kv_offset = ((b * Sk + j0) * Hkv + kvh) * D;
      bool loaded = false;
      const bool segments = p.kv_segment_ids.present();
      const cpu::IdRange key_ids = segments ? cpu::IdRangeOf(p.kv_segment_ids.ptr<int32_t>() + b * Sk + j0, nk)
                                            : cpu::IdRange{};
      for (int64_t qb = 0; qb < c.num_q_blocks; ++qb) {
        if (c.block_lo[qb] >= j0 + nk || c.block_hi[qb] <= j0) continue;
        const int64_t i0 = qb * c.block_q, i1 = std::min(i0 + c.block_q, Sq);
        int64_t first = i1, last = i0;
        for (int64_t i = i0; i < i1; ++i) {
          if (c.rows.lo[i] < c.rows.hi[i] && c.rows.lo[i] < j0 + nk && c.rows.hi[i] > j0) {
            first = std::min(first, i);
            last = i + 1;
          }
        }
        if (first >= last) continue;
        // With segment ids, a query block that shares no id with the keys is skipped.
        if (segments && key_ids.Misses(cpu::IdRangeOf(p.q_segment_ids.ptr<int32_t>() + b * Sq + first, last - first))) {
          continue;
        }
        if (!loaded) {
          cpu::LoadRows(p.k, kv_offset, Hkv * D, nk, D, s.kt.get(), Dp);
          cpu::LoadRowsTransposed(p.k, kv_offset, Hkv * D, nk, D, s.kT.get(), BKp, s.row.get());
          for (int64_t k = 0; k < D * BKp; k += kLanes) {
            cpu::StoreF(s.kT.get() + k, cpu::LoadF(s.kT.get() + k) * c.logit_scale);
          }
          cpu::LoadRowsTransposed(p.v, kv_offset, Hkv * D, nk, D, s.vT.get(), BKp, s.row.get());
          std::fill(s.dk.get(), s.dk.get() + nk * Dp, 0.0f);
          std::fill(s.dv.get(), s.dv.get() + nk * Dp, 0.0f);
          if (p.kv_segment_ids.present()) {
            std::copy_n(p.kv_segment_ids.ptr<int32_t>() + b * Sk + j0, nk, s.seg.data());
          }
          loaded = true;
        }
        const int64_t step = pair * c.num_q_blocks + qb;
        for (int64_t g = 0; g < c.group; ++g) {
          const int64_t h = kvh * c.group + g;
          NextRows next;
          if (g + 1 < c.group) {
            next = {first, last - first, h + 1};
          } else if (i1 < Sq) {
            next = {i1, std::min(c.block_q, Sq - i1), kvh * c.group};
          }
          TileGradients(c, s, b, h, first, last - first, j0, nk, next);
          if (g == 0 && previous) WaitUntil(*previous, step + 1);
          cpu::Gemm<Accumulate::kAdd>(last - first, nvd, nk, s.dp.get(), BKp, 1, s.kt.get(), Dp,
                                      c.dq_acc + ((b * Hq + h) * Sq + first) * Dp, Dp);
        }
        mine.steps.store(step + 1, std::memory_order_release);
      }
      if (!loaded) {
        std::fill(s.dk.get(), s.dk.get() + nk * Dp, 0.0f);
        std::fill(s.dv.get(), s.dv.get() + nk * Dp, 0.0f);
      }
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t offset = ((b * Sk + j0 + j) * Hkv + kvh) * D;
        cpu::StoreRow(s.dk.get() + j * Dp, D, c.softmax_scale, bp.dk.data, bp.dk.dtype, offset);
        cpu::StoreRow(s.dv.get() + j * Dp, D, 1.0f, bp.dv.data, bp.dv.dtype, offset);
      }
    }
  }
  if (previous) WaitUntil(*previous, c.steps_per_task);
  mine.steps.store(c.steps_per_task, std::memory_order_release);
}

}  // namespace

Status BackwardCpu(const BackwardParams& bp, const CpuConfig& cfg) {
  EJK_ASSIGN_OR_RETURN(const Dims d, ValidateBackward(bp));
  const ForwardParams& p = bp.fwd;
  EJK_RETURN_IF_ERROR(ValidateCuSeqlensValues(p, d));
  EJK_RETURN_IF_ERROR(cpu::CheckConfig(cfg));
  const int64_t B = d.batch, Sq = d.seqlen_q, Sk = d.seqlen_k, Hq = d.num_q_heads;
  const int64_t Hkv = d.num_kv_heads, D = d.head_dim;

  BackwardContext c;
  c.bp = &bp;
  c.p = &p;
  c.d = d;
  c.group = Hq / Hkv;
  c.head_dim_padded = cpu::RoundUp(D, kLanes);
  c.block_q = std::min<int64_t>(cfg.block_q, std::max<int64_t>(Sq, 1));
  c.block_k = std::min<int64_t>(cfg.block_k, std::max<int64_t>(Sk, 1));
  c.block_k_padded = cpu::RoundUp(c.block_k, kLanes);
  c.num_q_blocks = (Sq + c.block_q - 1) / c.block_q;
  c.num_k_blocks = (Sk + c.block_k - 1) / c.block_k;
  const bool dbias = bp.dbias.present();
  c.batches_per_task = dbias && p.bias.dim(0) == 1 ? B : 1;
  c.kv_heads_per_task = dbias && p.bias.dim(1) == 1 ? Hkv : 1;
  c.num_pair_groups = (B / std::max<int64_t>(c.batches_per_task, 1)) * (Hkv / c.kv_heads_per_task);
  c.steps_per_task = c.batches_per_task * c.kv_heads_per_task * c.num_q_blocks;
  c.softmax_scale = p.softmax_scale;
  c.cap = p.logits_soft_cap;
  c.logit_scale = cpu::Splat(c.cap > 0.0f ? c.softmax_scale / c.cap : c.softmax_scale);
  c.dropout = p.dropout_prob > 0.0f;
  c.keep_scale = c.dropout ? 1.0f / (1.0f - p.dropout_prob) : 1.0f;
  c.dropout_threshold = DropoutThreshold(p.dropout_prob);
  c.rows_in_place = p.q.dtype == DType::kF32 && D % kLanes == 0;

  const int64_t num_rows = B * Hq * Sq;
  const int64_t num_tasks = c.num_k_blocks * c.num_pair_groups;
  const int threads = cpu::NumThreads(cfg, std::max<int64_t>({num_tasks, Hq, B * Hq}));
  std::vector<BackwardScratch> scratch;
  FloatBuffer delta, dq_acc;
  std::unique_ptr<Progress[]> progress;
  try {
    c.rows = cpu::ComputeRowRanges(p, d);
    c.block_lo.assign(c.num_q_blocks, static_cast<int32_t>(Sk));
    c.block_hi.assign(c.num_q_blocks, 0);
    for (int64_t i = 0; i < Sq; ++i) {
      if (c.rows.lo[i] >= c.rows.hi[i]) continue;
      const int64_t qb = i / c.block_q;
      c.block_lo[qb] = std::min(c.block_lo[qb], c.rows.lo[i]);
      c.block_hi[qb] = std::max(c.block_hi[qb], c.rows.hi[i]);
    }
    delta = FloatBuffer(num_rows);
    dq_acc = FloatBuffer(num_rows * c.head_dim_padded);
    progress.reset(new Progress[std::max<int64_t>(num_tasks, 1)]);
    scratch.reserve(threads);
    for (int t = 0; t < threads; ++t) scratch.emplace_back(c);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("flash attention CPU backward: out of memory for scratch");
  }
  c.delta = delta.get();
  c.dq_acc = dq_acc.get();
  c.progress = progress.get();

  // delta_i = rowsum(dout_i * out_i) - dlse_i, and the zeroed accumulators.
  const float* dlse = bp.dlse.present() ? bp.dlse.ptr<float>() : nullptr;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t bh = 0; bh < B * Hq; ++bh) {
    BackwardScratch& s = scratch[cpu::ThreadIndex()];
    const int64_t b = bh / Hq, h = bh % Hq;
    for (int64_t i = 0; i < Sq; ++i) {
      const int64_t offset = ((b * Sq + i) * Hq + h) * D;
      cpu::ConvertRow(bp.dout.data, bp.dout.dtype, offset, D, s.row.get());
      cpu::ConvertRow(p.out.data, p.out.dtype, offset, D, s.row2.get());
      float sum = 0.0f;
      for (int64_t k = 0; k < D; ++k) sum += s.row.get()[k] * s.row2.get()[k];
      delta.get()[bh * Sq + i] = sum - (dlse ? dlse[bh * Sq + i] : 0.0f);
    }
    std::fill(c.dq_acc + bh * Sq * c.head_dim_padded, c.dq_acc + (bh + 1) * Sq * c.head_dim_padded, 0.0f);
  }
  if (dbias) {
    uint8_t* db = static_cast<uint8_t*>(bp.dbias.data);
    const int64_t n = static_cast<int64_t>(bp.dbias.SizeBytes());
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) db[i] = 0;
  }
  // d/d aux_h of lse_i is exp(aux_h - lse_i); out_i's normaliser moves with it.
  if (bp.dsoftmax_aux.present()) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t h = 0; h < Hq; ++h) {
      const double aux = cpu::LoadScalar(p.softmax_aux.data, p.softmax_aux.dtype, h);
      double sum = 0.0;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < Sq; ++i) {
          const float lse = p.lse.ptr<float>()[(b * Hq + h) * Sq + i];
          if (!c.rows.real[i] || lse == -kInf) continue;
          sum += std::exp(aux - lse) * c.delta[(b * Hq + h) * Sq + i];
        }
      }
      bp.dsoftmax_aux.ptr<float>()[h] = static_cast<float>(-sum);
    }
  }

  // Tasks must start in index order (see the top of the file), hence an explicit counter
  // rather than an OpenMP schedule.
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    BackwardScratch& s = scratch[cpu::ThreadIndex()];
    for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) BackwardTask(c, t, s);
  }

#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t bh = 0; bh < B * Hq; ++bh) {
    const int64_t b = bh / Hq, h = bh % Hq;
    for (int64_t i = 0; i < Sq; ++i) {
      cpu::StoreRow(c.dq_acc + (bh * Sq + i) * c.head_dim_padded, D, c.softmax_scale, bp.dq.data,
                    bp.dq.dtype, ((b * Sq + i) * Hq + h) * D);
    }
  }
  return Status::Ok();
}

}  // namespace ejk::flash_attention
