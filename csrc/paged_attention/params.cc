#include "paged_attention/params.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "runtime/format.h"

namespace ejk::paged_attention {
namespace {

Status Invalid(const std::string& message) { return Status::InvalidArgument(message); }

std::string Str(int64_t x) { return std::to_string(x); }

// "float32|bfloat16"
std::string DTypes(std::initializer_list<DType> dtypes) {
  std::string s;
  for (DType d : dtypes) s += std::string(s.empty() ? "" : "|") + DTypeName(d);
  return s;
}

// Optional operands are absent as default (rank 0) views; a view of too high a rank has
// rank -1, counts as given, and is rejected by its rank check.
bool Given(const TensorView& t) { return t.rank != 0; }

constexpr int64_t kAny = -1;

// Checks dtype, rank, every dimension given as >= 0 (kAny: any non-negative size),
// contiguity and data. `expected()` describes the wanted shape for the message, e.g.
// "int32[N, M] with N = 4 (kv_lens)"; it runs only on failure, since validation runs on the
// host before every launch.
template <typename Describe>
Status Expect(const TensorView& t, const char* name, std::initializer_list<DType> dtypes,
              std::initializer_list<int64_t> dims, Describe expected) {
  bool ok = t.rank == static_cast<int>(dims.size()) &&
            std::find(dtypes.begin(), dtypes.end(), t.dtype) != dtypes.end();
  int i = 0;
  for (int64_t x : dims) {
    if (!ok) break;
    ok = t.shape[i] >= 0 && (x == kAny || t.shape[i] == x);
    ++i;
  }
  if (!ok) return Invalid(std::string(name) + ": expected " + expected() + ", got " + t.ToString());
  return CheckTensor(t, name, t.rank, {t.dtype});
}

constexpr std::initializer_list<DType> kQueryDTypes = {DType::kF32, DType::kBF16, DType::kF16};
constexpr std::initializer_list<DType> kCacheDTypes = {DType::kF32, DType::kBF16, DType::kF16,
                                                       DType::kF8E4M3};
constexpr std::initializer_list<DType> kFloatDTypes = {DType::kF32, DType::kBF16, DType::kF16,
                                                       DType::kF64};

const char* LayoutName(KvLayout layout) {
  return layout == KvLayout::kHeadMajor ? "[P, Hkv, S, D] (head-major)"
                                        : "[P, S, Hkv, D] (token-major)";
}

Status CheckLayout(KvLayout layout) {
  if (layout != KvLayout::kHeadMajor && layout != KvLayout::kTokenMajor) {
    return Invalid("kv_layout must be 0 (head-major [P, Hkv, S, D]) or 1 (token-major "
                   "[P, S, Hkv, D]), got " + Str(static_cast<int64_t>(layout)));
  }
  return Status::Ok();
}

struct CacheDims {
  int64_t num_pages, num_kv_heads, page_size, head_dim;
};

// key_cache and value_cache: rank 4, one dtype, one shape, positive heads/page/head_dim.
StatusOr<CacheDims> CheckCaches(const TensorView& k, const TensorView& v, KvLayout layout) {
  const auto want = [layout] { return DTypes(kCacheDTypes) + LayoutName(layout); };
  EJK_RETURN_IF_ERROR(Expect(k, "key_cache", kCacheDTypes, {kAny, kAny, kAny, kAny}, want));
  const bool head_major = layout == KvLayout::kHeadMajor;
  CacheDims c{k.dim(0), head_major ? k.dim(1) : k.dim(2), head_major ? k.dim(2) : k.dim(1),
              k.dim(3)};
  if (c.num_kv_heads == 0 || c.page_size == 0 || c.head_dim == 0) {
    return Invalid("key_cache: expected " + want() + " with Hkv, S and D positive, got " +
                   k.ToString());
  }
  EJK_RETURN_IF_ERROR(Expect(v, "value_cache", {k.dtype}, {k.dim(0), k.dim(1), k.dim(2), k.dim(3)},
                             [&k] { return k.ToString() + " (like key_cache)"; }));
  return c;
}

// kv_lens [N], block_tables [N, M], query_start_loc [N + 1] or absent ([0]), num_seqs [1],
// all int32.
Status CheckMetadata(const TensorView& kv_lens, const TensorView& block_tables,
                     const TensorView& query_start_loc, const TensorView& num_seqs) {
  EJK_RETURN_IF_ERROR(
      Expect(kv_lens, "kv_lens", {DType::kI32}, {kAny}, [] { return std::string("int32[N]"); }));
  const int64_t N = kv_lens.dim(0);
  const auto n_is = [N] { return " with N = " + Str(N) + " (kv_lens)"; };
  EJK_RETURN_IF_ERROR(Expect(block_tables, "block_tables", {DType::kI32}, {N, kAny},
                             [&] { return "int32[N, M]" + n_is(); }));
  const bool empty = query_start_loc.rank == 1 && query_start_loc.shape[0] == 0;
  if (Given(query_start_loc)) {
    EJK_RETURN_IF_ERROR(Expect(query_start_loc, "query_start_loc", {DType::kI32},
                               {empty ? 0 : N + 1},
                               [&] {
                                 return "int32[N + 1]" + n_is() +
                                        ", or int32[0] (absent: one query row per sequence)";
                               }));
  }
  EJK_RETURN_IF_ERROR(
      Expect(num_seqs, "num_seqs", {DType::kI32}, {1}, [] { return std::string("int32[1]"); }));
  return Status::Ok();
}

// What one present sequence's metadata says, after its values are checked.
struct Sequence {
  int64_t q_begin, q_len, kv_len, kv_start;
};

// The value checks shared by attention and the cache update: num_seqs, query_start_loc,
// kv_lens (and kv_starts) of every present sequence, and the page ids of the key positions
// [first, kv_len) that `first_key` names for each sequence (those the operation touches).
template <typename FirstKey>
Status CheckValues(const TensorView& kv_lens, const TensorView& block_tables,
                   const TensorView& query_start_loc, const TensorView& num_seqs,
                   const TensorView& kv_starts, const TensorView& key_cache, const Dims& d,
                   FirstKey first_key) {
  const int32_t* lens = kv_lens.ptr<int32_t>();
  const int32_t* tables = block_tables.ptr<int32_t>();
  const int32_t* qsl = QueryStartLoc(query_start_loc);
  const int32_t* starts = kv_starts.present() ? kv_starts.ptr<int32_t>() : nullptr;
  const int64_t ns = num_seqs.ptr<int32_t>()[0];
  const int64_t N = d.max_seqs, M = d.max_pages_per_seq, S = d.page_size;
  if (ns < 0 || ns > N) {
    return Invalid("num_seqs: " + Str(ns) + " must be in [0, N = " + Str(N) + "] (kv_lens " +
                   kv_lens.ToString() + ")");
  }
  if (qsl == nullptr && ns > d.num_tokens) {
    return Invalid("num_seqs: " + Str(ns) + " exceeds the number of query rows T = " +
                   Str(d.num_tokens) +
                   "; query_start_loc is absent, so each sequence owns one row");
  }
  if (qsl != nullptr && qsl[0] != 0) {
    return Invalid("query_start_loc[0] must be 0, got " + Str(qsl[0]));
  }
  for (int64_t n = 0; n < ns; ++n) {
    const std::string seq = "sequence " + Str(n);
    const int64_t q_begin = QueryStartAt(qsl, n), q_end = QueryStartAt(qsl, n + 1);
    if (q_end < q_begin) {
      return Invalid("query_start_loc must be non-decreasing: query_start_loc[" + Str(n + 1) +
                     "] = " + Str(q_end) + " < query_start_loc[" + Str(n) + "] = " +
                     Str(q_begin));
    }
    if (q_end > d.num_tokens) {
      return Invalid("query_start_loc[" + Str(n + 1) + "] = " + Str(q_end) +
                     " exceeds the number of query rows T = " + Str(d.num_tokens));
    }
    const int64_t q_len = q_end - q_begin, kv_len = lens[n];
    if (kv_len < q_len) {
      const std::string rows = qsl == nullptr ? "query_start_loc absent: row " + Str(n)
                                              : "query_start_loc[" + Str(n) + ".." + Str(n + 1) +
                                                    "] = " + Str(q_begin) + ".." + Str(q_end);
      return Invalid("kv_lens[" + Str(n) + "] = " + Str(kv_len) + " is below the " + Str(q_len) +
                     " query rows of " + seq + " (" + rows + ")");
    }
    if (kv_len > M * S) {
      return Invalid("kv_lens[" + Str(n) + "] = " + Str(kv_len) + " exceeds the " + Str(M) +
                     " pages of " + Str(S) + " slots a block_tables row holds (" +
                     Str(M * S) + ")");
    }
    const int64_t kv_start = starts ? starts[n] : 0;
    if (kv_start < 0 || kv_start > kv_len) {
      return Invalid("kv_starts[" + Str(n) + "] = " + Str(kv_start) + " must be in [0, kv_lens[" +
                     Str(n) + "] = " + Str(kv_len) + "]");
    }
    const int64_t first = first_key(Sequence{q_begin, q_len, kv_len, kv_start});
    if (first >= kv_len) continue;
    for (int64_t page = first / S; page * S < kv_len; ++page) {
      const int64_t id = tables[n * M + page];
      if (id < 0 || id >= d.num_pages) {
        return Invalid("block_tables[" + Str(n) + ", " + Str(page) + "] = " + Str(id) +
                       " is not a page of key_cache " + key_cache.ToString() + " (P = " +
                       Str(d.num_pages) + "); " + seq + " reads key positions up to kv_lens[" +
                       Str(n) + "] = " + Str(kv_len));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

StatusOr<Dims> Validate(const Params& p) {
  EJK_RETURN_IF_ERROR(CheckLayout(p.layout));
  EJK_RETURN_IF_ERROR(Expect(p.q, "q", kQueryDTypes, {kAny, kAny, kAny},
                             [] { return DTypes(kQueryDTypes) + "[T, Hq, D]"; }));
  const int64_t T = p.q.dim(0), Hq = p.q.dim(1), D = p.q.dim(2);
  if (Hq == 0 || D == 0) {
    return Invalid("q: expected [T, Hq, D] with Hq and D positive, got " + p.q.ToString());
  }
  if (T > std::numeric_limits<int32_t>::max()) {
    return Invalid("q: T must fit int32 (query_start_loc), got " + p.q.ToString());
  }
  EJK_ASSIGN_OR_RETURN(const CacheDims c, CheckCaches(p.key_cache, p.value_cache, p.layout));
  const auto qk = [&p] {
    return "; q " + p.q.ToString() + ", key_cache " + p.key_cache.ToString();
  };
  if (c.head_dim != D) {
    return Invalid("key_cache: head_dim D = " + Str(c.head_dim) + " must equal q's D = " + Str(D) +
                   qk());
  }
  if (Hq % c.num_kv_heads != 0) {
    return Invalid("key_cache: Hkv = " + Str(c.num_kv_heads) + " must divide q's Hq = " + Str(Hq) +
                   qk());
  }
  EJK_RETURN_IF_ERROR(CheckMetadata(p.kv_lens, p.block_tables, p.query_start_loc, p.num_seqs));
  const int64_t N = p.kv_lens.dim(0);
  if (Given(p.kv_starts)) {
    EJK_RETURN_IF_ERROR(Expect(p.kv_starts, "kv_starts", {DType::kI32}, {N},
                               [N] { return "int32[N] with N = " + Str(N) + " (kv_lens)"; }));
  }
  if (Given(p.sinks)) {
    EJK_RETURN_IF_ERROR(Expect(p.sinks, "sinks", kFloatDTypes, {Hq},
                               [Hq] {
                                 return DTypes(kFloatDTypes) + "[Hq] with Hq = " + Str(Hq) + " (q)";
                               }));
  }
  EJK_RETURN_IF_ERROR(Expect(p.out, "out", {p.q.dtype}, {T, Hq, D},
                             [&p] { return p.q.ToString() + " (like q)"; }));
  if (!std::isfinite(p.softmax_scale)) {
    return Invalid("softmax_scale must be finite, got " + FormatFloat(p.softmax_scale));
  }
  if (!std::isfinite(p.logits_soft_cap) || p.logits_soft_cap < 0.0f) {
    return Invalid("logits_soft_cap must be finite and >= 0 (0: off), got " +
                   FormatFloat(p.logits_soft_cap));
  }
  if (!std::isfinite(p.k_scale) || !std::isfinite(p.v_scale)) {
    return Invalid("k_scale and v_scale must be finite, got k_scale=" + FormatFloat(p.k_scale) +
                   " v_scale=" + FormatFloat(p.v_scale));
  }
  return Dims{T, Hq, c.num_kv_heads, D, c.num_pages, c.page_size, N, p.block_tables.dim(1)};
}

Status ValidateMetadataValues(const Params& p, const Dims& dims) {
  // The keys any query of the sequence may see start at kv_start, and with a window at
  // the first query's position minus window_left; pages wholly before that are not read.
  const int64_t window = p.window_left;
  return CheckValues(p.kv_lens, p.block_tables, p.query_start_loc, p.num_seqs, p.kv_starts,
                     p.key_cache, dims, [window](const Sequence& s) -> int64_t {
                       if (s.q_len == 0) return s.kv_len;  // no query: nothing is read
                       int64_t first = s.kv_start;
                       if (window >= 0) first = std::max(first, s.kv_len - s.q_len - window);
                       return first;
                     });
}

StatusOr<Dims> ValidateCacheUpdate(const CacheUpdateParams& p) {
  EJK_RETURN_IF_ERROR(CheckLayout(p.layout));
  EJK_ASSIGN_OR_RETURN(const CacheDims c, CheckCaches(p.key_cache, p.value_cache, p.layout));
  const int64_t Hkv = c.num_kv_heads, D = c.head_dim;
  const auto want = [&] {
    return DTypes(kFloatDTypes) + "[T, Hkv, D] with Hkv = " + Str(Hkv) + ", D = " + Str(D) +
           " (key_cache " + p.key_cache.ToString() + ")";
  };
  EJK_RETURN_IF_ERROR(Expect(p.new_keys, "new_keys", kFloatDTypes, {kAny, Hkv, D}, want));
  const int64_t T = p.new_keys.dim(0);
  if (T > std::numeric_limits<int32_t>::max()) {
    return Invalid("new_keys: T must fit int32 (query_start_loc), got " + p.new_keys.ToString());
  }
  EJK_RETURN_IF_ERROR(Expect(p.new_values, "new_values", kFloatDTypes, {T, Hkv, D},
                             [&] { return want() + " and T = " + Str(T) + " (new_keys)"; }));
  EJK_RETURN_IF_ERROR(CheckMetadata(p.kv_lens, p.block_tables, p.query_start_loc, p.num_seqs));
  if (!std::isfinite(p.k_scale) || !std::isfinite(p.v_scale) || p.k_scale == 0.0f ||
      p.v_scale == 0.0f) {
    return Invalid("k_scale and v_scale must be finite and nonzero, got k_scale=" +
                   FormatFloat(p.k_scale) + " v_scale=" + FormatFloat(p.v_scale));
  }
  return Dims{T, Hkv, Hkv, D, c.num_pages, c.page_size, p.kv_lens.dim(0), p.block_tables.dim(1)};
}

Status ValidateCacheUpdateMetadataValues(const CacheUpdateParams& p, const Dims& dims) {
  // The new rows go to the last q_len key positions.
  return CheckValues(p.kv_lens, p.block_tables, p.query_start_loc, p.num_seqs, TensorView{},
                     p.key_cache, dims,
                     [](const Sequence& s) -> int64_t { return s.kv_len - s.q_len; });
}

}  // namespace ejk::paged_attention
