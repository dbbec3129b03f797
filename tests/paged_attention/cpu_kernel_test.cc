// The CPU paged attention and KV-cache update against a float64 reference that gathers
// each sequence's keys page by page, plus the fp8 rounding, validation and the registry.
//
// Every case scatters its sequences over a random permutation of the pages, poisons what
// the kernel must not read (cache slots past kv_lens or before the first visible key with
// NaN, unused block_tables entries and metadata past num_seqs with out-of-range values,
// padding query rows with NaN) and fills the output with NaN before the run.
//
// Inputs are random; the seed comes from std::random_device and is printed with every
// failure. EJK_TEST_SEED=<n> reruns with a given seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "paged_attention/ffi_common.h"
#include "paged_attention/fp8.h"
#include "paged_attention/params.h"
#include "runtime/registry.h"
#include "runtime/tensor.h"

namespace ejk::paged_attention {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

uint32_t TestSeed() {
  if (const char* env = std::getenv("EJK_TEST_SEED")) return static_cast<uint32_t>(std::atoll(env));
  return std::random_device{}();
}

// Owning storage of one dtype; Set rounds to the dtype and Get returns the stored value.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    data_.assign(static_cast<size_t>(size() * DTypeSize(dtype_)), 0);
  }
  int64_t size() const {
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    return n;
  }
  DType dtype() const { return dtype_; }
  TensorView view() {
    return TensorView::Contiguous(data_.data(), dtype_, shape_.data(), static_cast<int>(shape_.size()));
  }
  void Set(int64_t i, double x) {
    unsigned char* p = data_.data() + i * DTypeSize(dtype_);
    switch (dtype_) {
      case DType::kF32: Store(p, static_cast<float>(x)); break;
      case DType::kF64: Store(p, x); break;
      case DType::kBF16: Store(p, FloatToBF16(static_cast<float>(x))); break;
      case DType::kF16: Store(p, FloatToF16(static_cast<float>(x))); break;
      case DType::kF8E4M3: Store(p, FloatToF8E4M3(static_cast<float>(x))); break;
      case DType::kI32: Store(p, static_cast<int32_t>(x)); break;
      default: ADD_FAILURE() << "unsupported dtype";
    }
  }
  double Get(int64_t i) const {
    const unsigned char* p = data_.data() + i * DTypeSize(dtype_);
    switch (dtype_) {
      case DType::kF32: return Load<float>(p);
      case DType::kF64: return Load<double>(p);
      case DType::kBF16: return BF16ToFloat(Load<uint16_t>(p));
      case DType::kF16: return F16ToFloat(Load<uint16_t>(p));
      case DType::kF8E4M3: return F8E4M3ToFloat(Load<uint8_t>(p));
      case DType::kI32: return Load<int32_t>(p);
      default: return 0.0;
    }
  }
  int32_t* i32() { return reinterpret_cast<int32_t*>(data_.data()); }
  const std::vector<unsigned char>& bytes() const { return data_; }

 private:
  template <typename T>
  static void Store(unsigned char* p, T x) { std::memcpy(p, &x, sizeof(T)); }
  template <typename T>
  static T Load(const unsigned char* p) {
    T x;
    std::memcpy(&x, p, sizeof(T));
    return x;
  }
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::vector<unsigned char> data_;
};

TensorView Reshape(const TensorView& t, std::initializer_list<int64_t> shape) {
  return TensorView::Contiguous(t.data, t.dtype, shape);
}

HostTensor I32(std::vector<int64_t> shape, const std::vector<int32_t>& values) {
  HostTensor t(DType::kI32, std::move(shape));
  for (size_t i = 0; i < values.size(); ++i) t.i32()[i] = values[i];
  return t;
}

// --- cases ----------------------------------------------------------------------------

struct Case {
  std::string name;
  // Per present sequence: query rows and keys (kv_len >= q_len).
  std::vector<int32_t> q_lens, kv_lens;
  std::vector<int32_t> kv_starts;  // empty: absent
  bool absent_qsl = false;         // query_start_loc left out (every q_lens entry is 1)
  int64_t extra_slots = 2;         // sequence slots past num_seqs (padding)
  int64_t extra_rows = 3;          // query rows past the last sequence (padding)
  int64_t extra_pages = 5;         // pages no sequence uses
  int64_t extra_table_cols = 2;    // block_tables columns past the longest sequence
  int64_t q_heads = 4, kv_heads = 2, head_dim = 64, page_size = 16;
  KvLayout layout = KvLayout::kHeadMajor;
  DType q_dtype = DType::kF32, cache_dtype = DType::kF32;
  bool causal = true;
  int64_t window_left = -1;
  float soft_cap = 0.0f;
  bool sinks = false;
  DType sinks_dtype = DType::kF32;
  float k_scale = 1.0f, v_scale = 1.0f;
  double input_scale = 1.0;  // larger values sharpen the softmax
  Config cfg{1, 32, 2};
};

// The cache position of key j (kv head h) of a sequence whose pages are `pages`.
int64_t CacheIndex(const Case& c, const std::vector<int32_t>& pages, int64_t h, int64_t j) {
  const int64_t page = pages[j / c.page_size], slot = j % c.page_size;
  return c.layout == KvLayout::kHeadMajor
             ? ((page * c.kv_heads + h) * c.page_size + slot) * c.head_dim
             : ((page * c.page_size + slot) * c.kv_heads + h) * c.head_dim;
}

// The first key any query of the sequence may see (what ValidateMetadataValues checks).
int64_t FirstKey(const Case& c, int64_t n) {
  const int64_t q_len = c.q_lens[n], kv_len = c.kv_lens[n];
  if (q_len == 0) return kv_len;
  int64_t first = c.kv_starts.empty() ? 0 : c.kv_starts[n];
  if (c.window_left >= 0) first = std::max(first, kv_len - q_len - c.window_left);
  return first;
}

struct Inputs {
  HostTensor q, k, v, kv_lens, block_tables, qsl, num_seqs, kv_starts, sinks, out;
  std::vector<std::vector<int32_t>> pages;  // per present sequence
  int64_t num_tokens = 0;

  Params params(const Case& c) {
    Params p;
    p.q = q.view();
    p.key_cache = k.view();
    p.value_cache = v.view();
    p.kv_lens = kv_lens.view();
    p.block_tables = block_tables.view();
    if (!c.absent_qsl) p.query_start_loc = qsl.view();
    p.num_seqs = num_seqs.view();
    if (!c.kv_starts.empty()) p.kv_starts = kv_starts.view();
    if (c.sinks) p.sinks = sinks.view();
    p.out = out.view();
    p.layout = c.layout;
    p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
    p.logits_soft_cap = c.soft_cap;
    p.window_left = c.window_left;
    p.causal = c.causal;
    p.k_scale = c.k_scale;
    p.v_scale = c.v_scale;
    return p;
  }
};

Inputs MakeInputs(const Case& c, std::mt19937& rng) {
  Inputs in;
  const int64_t ns = static_cast<int64_t>(c.q_lens.size());
  const int64_t N = ns + c.extra_slots, S = c.page_size, D = c.head_dim;
  const int64_t Hq = c.q_heads, Hkv = c.kv_heads;
  int64_t pages_needed = 0, max_pages = 0;
  for (int64_t n = 0; n < ns; ++n) {
    const int64_t np = (c.kv_lens[n] + S - 1) / S;
    pages_needed += np;
    max_pages = std::max(max_pages, np);
  }
  const int64_t P = pages_needed + c.extra_pages, M = max_pages + c.extra_table_cols;
  in.num_tokens = std::accumulate(c.q_lens.begin(), c.q_lens.end(), int64_t{0}) + c.extra_rows;
  const int64_t T = in.num_tokens;
  std::uniform_real_distribution<double> uni(-1.0, 1.0);
  std::uniform_int_distribution<int32_t> garbage(0, 3);
  const int32_t garbage_values[] = {-1, INT_MIN, INT_MAX, static_cast<int32_t>(P)};

  // Pages: a random permutation dealt to the sequences in order.
  std::vector<int32_t> perm(P);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> tables(N * M), lens(N), qsl(N + 1), starts(N);
  for (auto& x : tables) x = garbage_values[garbage(rng)];
  for (auto& x : lens) x = garbage_values[garbage(rng)];
  for (auto& x : qsl) x = garbage_values[garbage(rng)];
  for (auto& x : starts) x = garbage_values[garbage(rng)];
  int64_t next_page = 0;
  qsl[0] = 0;
  in.pages.resize(ns);
  for (int64_t n = 0; n < ns; ++n) {
    const int64_t np = (c.kv_lens[n] + S - 1) / S;
    for (int64_t i = 0; i < np; ++i) in.pages[n].push_back(perm[next_page++]);
    // Entries of pages wholly before the first visible key are never read: poison them.
    const int64_t first_page = FirstKey(c, n) / S;
    for (int64_t i = 0; i < np; ++i) tables[n * M + i] = i < first_page ? -3 : in.pages[n][i];
    lens[n] = c.kv_lens[n];
    qsl[n + 1] = qsl[n] + c.q_lens[n];
    if (!c.kv_starts.empty()) starts[n] = c.kv_starts[n];
  }
  in.kv_lens = I32({N}, lens);
  in.block_tables = I32({N, M}, tables);
  in.qsl = I32({N + 1}, qsl);
  in.num_seqs = I32({1}, {static_cast<int32_t>(ns)});
  in.kv_starts = I32({N}, starts);

  const std::vector<int64_t> cache_shape =
      c.layout == KvLayout::kHeadMajor ? std::vector<int64_t>{P, Hkv, S, D}
                                       : std::vector<int64_t>{P, S, Hkv, D};
  in.k = HostTensor(c.cache_dtype, cache_shape);
  in.v = HostTensor(c.cache_dtype, cache_shape);
  // Every slot starts as NaN; the slots a sequence may read get data.
  for (int64_t i = 0; i < in.k.size(); ++i) {
    in.k.Set(i, kNaN);
    in.v.Set(i, kNaN);
  }
  // fp8 data spans the format's range (scaled by the dequantisation scales).
  const double cache_scale = c.cache_dtype == DType::kF8E4M3 ? 200.0 : 1.0;
  for (int64_t n = 0; n < ns; ++n) {
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t j = FirstKey(c, n); j < c.kv_lens[n]; ++j) {
        const int64_t base = CacheIndex(c, in.pages[n], h, j);
        for (int64_t d = 0; d < D; ++d) {
          in.k.Set(base + d, cache_scale * c.input_scale * uni(rng));
          in.v.Set(base + d, cache_scale * uni(rng));
        }
      }
    }
  }
  in.q = HostTensor(c.q_dtype, {T, Hq, D});
  const int64_t owned = qsl[ns] * Hq * D;
  for (int64_t i = 0; i < in.q.size(); ++i) in.q.Set(i, i < owned ? c.input_scale * uni(rng) : kNaN);
  in.sinks = HostTensor(c.sinks_dtype, {Hq});
  for (int64_t h = 0; h < Hq; ++h) in.sinks.Set(h, 2.0 * uni(rng));
  in.out = HostTensor(c.q_dtype, {T, Hq, D});
  for (int64_t i = 0; i < in.out.size(); ++i) in.out.Set(i, kNaN);
  return in;
}

// out [T, Hq, D] in float64 from the stored (rounded) inputs; padding rows stay 0.
std::vector<double> Reference(const Case& c, const Inputs& in) {
  const int64_t ns = static_cast<int64_t>(c.q_lens.size());
  const int64_t Hq = c.q_heads, D = c.head_dim, G = c.q_heads / c.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> out(in.num_tokens * Hq * D, 0.0);
  int64_t q_begin = 0;
  for (int64_t n = 0; n < ns; ++n) {
    const int64_t q_len = c.q_lens[n], kv_len = c.kv_lens[n];
    const int64_t kv_start = c.kv_starts.empty() ? 0 : c.kv_starts[n];
    for (int64_t r = 0; r < q_len; ++r) {
      const int64_t pos = kv_len - q_len + r, token = q_begin + r;
      for (int64_t hq = 0; hq < Hq; ++hq) {
        const int64_t h = hq / G;
        std::vector<double> logits;
        std::vector<int64_t> keys;
        for (int64_t j = kv_start; j < kv_len; ++j) {
          if (c.causal && j > pos) continue;
          if (c.window_left >= 0 && j < pos - c.window_left) continue;
          const int64_t base = CacheIndex(c, in.pages[n], h, j);
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) {
            dot += in.q.Get((token * Hq + hq) * D + d) * in.k.Get(base + d) * c.k_scale;
          }
          double logit = scale * dot;
          if (c.soft_cap > 0.0f) logit = c.soft_cap * std::tanh(logit / c.soft_cap);
          logits.push_back(logit);
          keys.push_back(j);
        }
        double mx = c.sinks ? in.sinks.Get(hq) : -std::numeric_limits<double>::infinity();
        for (double x : logits) mx = std::max(mx, x);
        if (logits.empty()) continue;  // no visible key: 0 (with or without a sink)
        double sum = c.sinks ? std::exp(in.sinks.Get(hq) - mx) : 0.0;
        for (double x : logits) sum += std::exp(x - mx);
        double* o = &out[(token * Hq + hq) * D];
        for (size_t i = 0; i < keys.size(); ++i) {
          const double w = std::exp(logits[i] - mx) / sum;
          const int64_t base = CacheIndex(c, in.pages[n], h, keys[i]);
          for (int64_t d = 0; d < D; ++d) o[d] += w * in.v.Get(base + d) * c.v_scale;
        }
      }
    }
    q_begin += q_len;
  }
  return out;
}

// Output rounding of the dtype (relative), doubled, plus the f32 accumulation error.
double Tolerance(DType dtype, double ref, double magnitude) {
  const double rel = dtype == DType::kBF16 ? std::ldexp(1.0, -8)
                     : dtype == DType::kF16 ? std::ldexp(1.0, -11) * 2
                                            : 0.0;
  return rel * std::fabs(ref) + 2e-5 * magnitude;
}

void RunCase(const Case& c, uint32_t seed) {
  SCOPED_TRACE("case " + c.name + ", seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  Inputs in = MakeInputs(c, rng);
  Params p = in.params(c);
  const Status s = AttentionCpu(p, c.cfg);
  ASSERT_TRUE(s.ok()) << s.ToString();
  const std::vector<double> ref = Reference(c, in);
  double magnitude = std::fabs(c.v_scale) * (c.cache_dtype == DType::kF8E4M3 ? 200.0 : 1.0);
  int64_t owned = 0;
  for (int32_t x : c.q_lens) owned += x;
  owned *= c.q_heads * c.head_dim;
  int failures = 0;
  for (int64_t i = 0; i < in.out.size() && failures < 5; ++i) {
    const double got = in.out.Get(i);
    if (i >= owned) {
      if (got != 0.0) {
        ADD_FAILURE() << "padding out[" << i << "] = " << got << ", want 0";
        ++failures;
      }
      continue;
    }
    const double tol = Tolerance(c.q_dtype, ref[i], magnitude);
    if (!(std::fabs(got - ref[i]) <= tol)) {
      const int64_t D = c.head_dim, Hq = c.q_heads;
      ADD_FAILURE() << "out[token " << i / (Hq * D) << ", head " << (i / D) % Hq << ", d "
                    << i % D << "] = " << got << ", reference " << ref[i] << " (tolerance "
                    << tol << ")";
      ++failures;
    }
  }
}

class PagedAttentionCpuTest : public ::testing::Test {
 protected:
  uint32_t seed_ = TestSeed();
};

TEST_F(PagedAttentionCpuTest, DecodeBatch) {
  Case c;
  c.name = "decode";
  c.q_lens.assign(9, 1);
  c.kv_lens = {1, 17, 64, 65, 200, 33, 5, 128, 99};
  c.q_heads = 8;
  c.kv_heads = 2;
  RunCase(c, seed_);
}

// An absent query_start_loc: sequence n owns row n, rows from num_seqs on are padding.
TEST_F(PagedAttentionCpuTest, DecodeWithoutQueryStartLoc) {
  for (KvLayout layout : {KvLayout::kHeadMajor, KvLayout::kTokenMajor}) {
    Case c;
    c.name = layout == KvLayout::kHeadMajor ? "no qsl head-major" : "no qsl token-major";
    c.layout = layout;
    c.absent_qsl = true;
    c.q_lens.assign(7, 1);
    c.kv_lens = {1, 40, 64, 100, 3, 17, 250};
    c.kv_starts = {0, 5, 0, 99, 3, 0, 31};
    c.window_left = 90;
    c.sinks = true;
    c.q_heads = 6;
    c.kv_heads = 2;
    RunCase(c, seed_);
  }
}

// An int32[0] view is absent too, and gives what an explicit [0, 1, ..., N] gives.
TEST_F(PagedAttentionCpuTest, EmptyQueryStartLocMatchesArange) {
  Case c;
  c.q_lens.assign(5, 1);
  c.kv_lens = {9, 70, 1, 33, 128};
  c.extra_slots = 4;  // N = 9 > T = 7
  c.extra_rows = 2;
  std::mt19937 rng(seed_);
  Inputs in = MakeInputs(c, rng);
  Params p = in.params(c);
  ASSERT_TRUE(AttentionCpu(p, c.cfg).ok());
  const std::vector<unsigned char> want = in.out.bytes();
  p.query_start_loc = TensorView::Contiguous(in.qsl.view().data, DType::kI32, {0});
  for (int64_t i = 0; i < in.out.size(); ++i) in.out.Set(i, kNaN);
  const Status s = AttentionCpu(p, c.cfg);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(in.out.bytes() == want) << "seed " << seed_;
}

TEST_F(PagedAttentionCpuTest, PrefillAndDecodeMixed) {
  for (KvLayout layout : {KvLayout::kHeadMajor, KvLayout::kTokenMajor}) {
    Case c;
    c.name = layout == KvLayout::kHeadMajor ? "mixed head-major" : "mixed token-major";
    c.layout = layout;
    // Empty sequences (no queries, and no queries nor keys), single keys, chunked prefill
    // over a cached prefix, a full prefill spanning several query blocks.
    c.q_lens = {1, 0, 37, 1, 0, 130, 5, 1};
    c.kv_lens = {1, 20, 50, 77, 0, 130, 5, 300};
    c.page_size = 24;
    RunCase(c, seed_);
  }
}

TEST_F(PagedAttentionCpuTest, PageSizes) {
  for (int32_t page_size : {8, 12, 16, 40, 64, 128}) {
    Case c;
    c.name = "page size " + std::to_string(page_size);
    c.page_size = page_size;
    c.q_lens = {1, 3, 20, 1};
    c.kv_lens = {page_size * 3 + 1, page_size - 1, 150, page_size};
    c.layout = page_size % 16 == 0 ? KvLayout::kHeadMajor : KvLayout::kTokenMajor;
    RunCase(c, seed_);
  }
}

TEST_F(PagedAttentionCpuTest, GroupSizesAndHeadDims) {
  const struct {
    int64_t q_heads, kv_heads, head_dim;
  } shapes[] = {{3, 3, 64}, {6, 2, 72}, {8, 1, 128}, {14, 2, 40}, {70, 1, 32}, {4, 4, 256},
                {2, 1, 8},  {16, 2, 96}};
  for (const auto& sh : shapes) {
    Case c;
    c.name = "Hq " + std::to_string(sh.q_heads) + " Hkv " + std::to_string(sh.kv_heads) + " D " +
             std::to_string(sh.head_dim);
    c.q_heads = sh.q_heads;
    c.kv_heads = sh.kv_heads;
    c.head_dim = sh.head_dim;
    c.q_lens = {1, 9, 1};
    c.kv_lens = {70, 41, 3};
    RunCase(c, seed_);
  }
}

TEST_F(PagedAttentionCpuTest, Dtypes) {
  const struct {
    DType q, cache;
  } dtypes[] = {{DType::kBF16, DType::kBF16}, {DType::kF16, DType::kF16},
                {DType::kBF16, DType::kF32},  {DType::kF32, DType::kBF16},
                {DType::kF16, DType::kF8E4M3}, {DType::kBF16, DType::kF8E4M3}};
  for (const auto& dt : dtypes) {
    for (KvLayout layout : {KvLayout::kHeadMajor, KvLayout::kTokenMajor}) {
      Case c;
      c.name = std::string(DTypeName(dt.q)) + " q, " + DTypeName(dt.cache) + " cache, layout " +
               std::to_string(static_cast<int>(layout));
      c.q_dtype = dt.q;
      c.cache_dtype = dt.cache;
      c.layout = layout;
      c.q_lens = {1, 17, 2};
      c.kv_lens = {90, 40, 2};
      if (dt.cache == DType::kF8E4M3) {
        c.k_scale = 1.0f / 256.0f;
        c.v_scale = 1.0f / 160.0f;
      }
      RunCase(c, seed_);
    }
  }
}

TEST_F(PagedAttentionCpuTest, SoftCapAndSharpLogits) {
  for (float cap : {0.0f, 5.0f, 30.0f}) {
    Case c;
    c.name = "soft cap " + std::to_string(cap);
    c.soft_cap = cap;
    c.input_scale = 4.0;  // logits in the tens: the running max changes between tiles
    c.q_lens = {1, 33};
    c.kv_lens = {150, 100};
    RunCase(c, seed_);
  }
}

TEST_F(PagedAttentionCpuTest, Sinks) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF64}) {
    Case c;
    c.name = std::string("sinks ") + DTypeName(dtype);
    c.sinks = true;
    c.sinks_dtype = dtype;
    c.q_lens = {1, 6, 0};
    c.kv_lens = {30, 6, 4};
    c.kv_starts = {0, 6, 2};  // the second sequence sees no key: out 0 despite the sink
    c.q_dtype = dtype == DType::kBF16 ? DType::kBF16 : DType::kF32;
    RunCase(c, seed_);
  }
}

TEST_F(PagedAttentionCpuTest, SlidingWindow) {
  for (int64_t window : {0, 1, 7, 16, 63, 500}) {
    Case c;
    c.name = "window " + std::to_string(window);
    c.window_left = window;
    c.q_lens = {1, 40, 3};
    c.kv_lens = {200, 120, 3};
    c.page_size = 8;
    RunCase(c, seed_);
  }
}

TEST_F(PagedAttentionCpuTest, KvStarts) {
  Case c;
  c.name = "kv_starts";
  c.q_lens = {1, 10, 4, 1};
  c.kv_lens = {100, 50, 4, 33};
  c.kv_starts = {37, 0, 4, 33};  // the last two see nothing
  c.page_size = 16;
  RunCase(c, seed_);
}

TEST_F(PagedAttentionCpuTest, NonCausal) {
  Case c;
  c.name = "non-causal";
  c.causal = false;
  c.q_lens = {12, 1, 5};
  c.kv_lens = {40, 9, 5};
  c.window_left = 20;
  RunCase(c, seed_);
}

TEST_F(PagedAttentionCpuTest, AllFeaturesTogether) {
  for (KvLayout layout : {KvLayout::kHeadMajor, KvLayout::kTokenMajor}) {
    Case c;
    c.name = "all features";
    c.layout = layout;
    c.q_heads = 12;
    c.kv_heads = 4;
    c.head_dim = 80;
    c.q_dtype = DType::kBF16;
    c.cache_dtype = DType::kF8E4M3;
    c.k_scale = 0.004f;
    c.v_scale = 0.01f;
    c.soft_cap = 20.0f;
    c.sinks = true;
    c.window_left = 45;
    c.q_lens = {1, 70, 3, 1};
    c.kv_lens = {300, 90, 77, 1};
    c.kv_starts = {100, 5, 0, 0};
    c.page_size = 32;
    RunCase(c, seed_);
  }
}

TEST_F(PagedAttentionCpuTest, Configs) {
  for (int block_kv : {1, 16, 17, 64, 256, 4096}) {
    for (int threads : {0, 1, 3}) {
      Case c;
      c.name = "block_kv " + std::to_string(block_kv) + " threads " + std::to_string(threads);
      c.cfg = Config{0, block_kv, threads};
      c.q_lens = {1, 21, 1};
      c.kv_lens = {333, 21, 64};
      RunCase(c, seed_);
    }
  }
}

TEST_F(PagedAttentionCpuTest, NoSequences) {
  Case c;
  c.name = "num_seqs 0";
  c.extra_rows = 7;
  c.extra_slots = 3;
  RunCase(c, seed_);
}

TEST_F(PagedAttentionCpuTest, NanInVisibleKeyPropagates) {
  Case c;
  c.q_lens = {1};
  c.kv_lens = {40};
  std::mt19937 rng(seed_);
  Inputs in = MakeInputs(c, rng);
  in.k.Set(CacheIndex(c, in.pages[0], 0, 17) + 3, kNaN);
  Params p = in.params(c);
  ASSERT_TRUE(AttentionCpu(p, c.cfg).ok());
  const int64_t D = c.head_dim;
  EXPECT_TRUE(std::isnan(in.out.Get(0)));          // head 0 reads kv head 0
  EXPECT_FALSE(std::isnan(in.out.Get(2 * D + 1)));  // head 2 reads kv head 1
}

// --- fp8 ------------------------------------------------------------------------------

// The e4m3fn value nearest to x (ties to the even code), saturating at +-448, by search.
uint8_t NearestF8(float x) {
  if (std::isnan(x)) return 0x7f;
  const double ax = std::min(std::fabs(static_cast<double>(x)), 448.0);
  int best = 0;
  for (int code = 1; code < 0x7f; ++code) {
    const double d = std::fabs(F8E4M3ToFloat(static_cast<uint8_t>(code)) - ax);
    const double best_d = std::fabs(F8E4M3ToFloat(static_cast<uint8_t>(best)) - ax);
    if (d < best_d || (d == best_d && (code & 1) == 0)) best = code;
  }
  return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | best);
}

TEST(PagedFp8Test, RoundTripsEveryCode) {
  for (int code = 0; code < 256; ++code) {
    const float f = F8E4M3ToFloat(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_EQ(FloatToF8E4M3(f) & 0x7f, 0x7f);
      continue;
    }
    EXPECT_EQ(FloatToF8E4M3(f), code) << "code " << code << " value " << f;
  }
}

TEST(PagedFp8Test, RoundsToNearestEvenAndSaturates) {
  // Midpoints between neighbouring codes, and points just off them.
  for (int code = 0; code < 0x7e; ++code) {
    const float a = F8E4M3ToFloat(static_cast<uint8_t>(code));
    const float b = F8E4M3ToFloat(static_cast<uint8_t>(code + 1));
    const float mid = 0.5f * (a + b);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      EXPECT_EQ(FloatToF8E4M3(x), NearestF8(x)) << "x " << x;
      EXPECT_EQ(FloatToF8E4M3(-x), NearestF8(-x)) << "x " << -x;
    }
  }
  std::mt19937 rng(TestSeed());
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::exp2(exponent(rng)) * (i % 2 ? -1.0f : 1.0f);
    ASSERT_EQ(FloatToF8E4M3(x), NearestF8(x)) << "x " << x;
  }
  EXPECT_EQ(FloatToF8E4M3(464.0f), 0x7e);  // the midpoint to 480 (no such code) saturates
  EXPECT_EQ(FloatToF8E4M3(1e30f), 0x7e);
  EXPECT_EQ(FloatToF8E4M3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -10)), 0x00);          // half the smallest: even
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(3.0f, -10)), 0x02);          // 1.5 steps: to 2
  EXPECT_EQ(FloatToF8E4M3(1e-40f), 0x00);                         // f32 subnormal
  EXPECT_EQ(FloatToF8E4M3(-0.0f), 0x80);
}

// --- cache update ---------------------------------------------------------------------

struct UpdateCase {
  std::string name;
  std::vector<int32_t> q_lens, kv_lens;  // kv_lens include the new rows
  int64_t kv_heads = 2, head_dim = 40, page_size = 16;
  KvLayout layout = KvLayout::kHeadMajor;
  DType new_dtype = DType::kF32, cache_dtype = DType::kBF16;
  float k_scale = 1.0f, v_scale = 1.0f;
  bool absent_qsl = false;  // query_start_loc left out (every q_lens entry is 1)
};

void RunUpdate(const UpdateCase& c, uint32_t seed) {
  SCOPED_TRACE("case " + c.name + ", seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uni(-1.0, 1.0);
  const int64_t ns = static_cast<int64_t>(c.q_lens.size()), N = ns + 2;
  const int64_t S = c.page_size, Hkv = c.kv_heads, D = c.head_dim;
  int64_t P = 3, M = 1, T = 2;  // spare pages, a spare table column and padding rows
  for (int64_t n = 0; n < ns; ++n) {
    P += (c.kv_lens[n] + S - 1) / S;
    M = std::max<int64_t>(M, (c.kv_lens[n] + S - 1) / S + 1);
    T += c.q_lens[n];
  }
  std::vector<int32_t> perm(P), tables(N * M, -1), lens(N, INT_MIN), qsl(N + 1, INT_MAX);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  qsl[0] = 0;
  int64_t next = 0;
  Case layout_case;  // CacheIndex's view of the geometry
  layout_case.kv_heads = Hkv;
  layout_case.head_dim = D;
  layout_case.page_size = S;
  layout_case.layout = c.layout;
  std::vector<std::vector<int32_t>> pages(ns);
  for (int64_t n = 0; n < ns; ++n) {
    const int64_t np = (c.kv_lens[n] + S - 1) / S;
    const int64_t first_written = (c.kv_lens[n] - c.q_lens[n]) / S;
    for (int64_t i = 0; i < np; ++i) {
      pages[n].push_back(perm[next++]);
      tables[n * M + i] = i < first_written ? -9 : pages[n][i];  // never written: poison
    }
    lens[n] = c.kv_lens[n];
    qsl[n + 1] = qsl[n] + c.q_lens[n];
  }
  HostTensor kv_lens = I32({N}, lens), block_tables = I32({N, M}, tables);
  HostTensor query_start_loc = I32({N + 1}, qsl), num_seqs = I32({1}, {static_cast<int32_t>(ns)});
  const std::vector<int64_t> shape = c.layout == KvLayout::kHeadMajor
                                         ? std::vector<int64_t>{P, Hkv, S, D}
                                         : std::vector<int64_t>{P, S, Hkv, D};
  HostTensor k(c.cache_dtype, shape), v(c.cache_dtype, shape);
  for (int64_t i = 0; i < k.size(); ++i) {
    k.Set(i, uni(rng));
    v.Set(i, uni(rng));
  }
  const std::vector<unsigned char> k_before = k.bytes(), v_before = v.bytes();
  HostTensor new_k(c.new_dtype, {T, Hkv, D}), new_v(c.new_dtype, {T, Hkv, D});
  const double range = c.cache_dtype == DType::kF8E4M3 ? 2.0 : 1.0;
  for (int64_t i = 0; i < new_k.size(); ++i) {
    new_k.Set(i, range * uni(rng));
    new_v.Set(i, range * uni(rng));
  }
  CacheUpdateParams p;
  p.new_keys = new_k.view();
  p.new_values = new_v.view();
  p.key_cache = k.view();
  p.value_cache = v.view();
  p.kv_lens = kv_lens.view();
  p.block_tables = block_tables.view();
  if (!c.absent_qsl) p.query_start_loc = query_start_loc.view();
  p.num_seqs = num_seqs.view();
  p.layout = c.layout;
  p.k_scale = c.k_scale;
  p.v_scale = c.v_scale;
  const Status s = CacheUpdateCpu(p);
  ASSERT_TRUE(s.ok()) << s.ToString();

  // Expected: the old bytes, with each new row rounded (or quantised) into its slot.
  HostTensor k_want(c.cache_dtype, shape), v_want(c.cache_dtype, shape);
  std::memcpy(const_cast<unsigned char*>(k_want.bytes().data()), k_before.data(), k_before.size());
  std::memcpy(const_cast<unsigned char*>(v_want.bytes().data()), v_before.data(), v_before.size());
  const bool fp8 = c.cache_dtype == DType::kF8E4M3;
  for (int64_t n = 0; n < ns; ++n) {
    for (int64_t r = 0; r < c.q_lens[n]; ++r) {
      const int64_t pos = c.kv_lens[n] - c.q_lens[n] + r, token = qsl[n] + r;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t dst = CacheIndex(layout_case, pages[n], h, pos);
        for (int64_t d = 0; d < D; ++d) {
          const float kx = static_cast<float>(new_k.Get((token * Hkv + h) * D + d));
          const float vx = static_cast<float>(new_v.Get((token * Hkv + h) * D + d));
          k_want.Set(dst + d, fp8 ? kx / c.k_scale : kx);
          v_want.Set(dst + d, fp8 ? vx / c.v_scale : vx);
        }
      }
    }
  }
  EXPECT_TRUE(k.bytes() == k_want.bytes()) << "key_cache differs";
  EXPECT_TRUE(v.bytes() == v_want.bytes()) << "value_cache differs";
}

TEST(PagedKvCacheUpdateTest, LayoutsAndDtypes) {
  const uint32_t seed = TestSeed();
  const struct {
    DType new_dtype, cache_dtype;
    float k_scale, v_scale;
  } dtypes[] = {{DType::kF32, DType::kF32, 1, 1},      {DType::kF32, DType::kBF16, 1, 1},
                {DType::kBF16, DType::kF16, 1, 1},     {DType::kF64, DType::kBF16, 1, 1},
                {DType::kF32, DType::kF8E4M3, 0.01f, 0.03f}, {DType::kBF16, DType::kF8E4M3, 1, 1},
                {DType::kF16, DType::kF8E4M3, 3.0f, 0.7f}};
  for (const auto& dt : dtypes) {
    for (KvLayout layout : {KvLayout::kHeadMajor, KvLayout::kTokenMajor}) {
      UpdateCase c;
      c.name = std::string(DTypeName(dt.new_dtype)) + " -> " + DTypeName(dt.cache_dtype);
      c.new_dtype = dt.new_dtype;
      c.cache_dtype = dt.cache_dtype;
      c.k_scale = dt.k_scale;
      c.v_scale = dt.v_scale;
      c.layout = layout;
      // Decode steps, a prefill crossing pages, an empty step, a step filling a page.
      c.q_lens = {1, 37, 0, 16, 1};
      c.kv_lens = {18, 37, 5, 32, 1};
      RunUpdate(c, seed);
    }
  }
}

TEST(PagedKvCacheUpdateTest, PageSizes) {
  for (int64_t page_size : {8, 13, 64, 128}) {
    UpdateCase c;
    c.name = "page size " + std::to_string(page_size);
    c.page_size = page_size;
    c.q_lens = {3, 1, 50};
    c.kv_lens = {200, 1, 60};
    RunUpdate(c, TestSeed());
  }
}

TEST(PagedKvCacheUpdateTest, WithoutQueryStartLoc) {
  for (KvLayout layout : {KvLayout::kHeadMajor, KvLayout::kTokenMajor}) {
    UpdateCase c;
    c.name = "no qsl";
    c.layout = layout;
    c.absent_qsl = true;
    c.q_lens.assign(5, 1);
    c.kv_lens = {1, 16, 17, 40, 3};
    RunUpdate(c, TestSeed());
  }
}

// --- validation -----------------------------------------------------------------------

// A small valid problem whose pieces the tests break one at a time.
struct Valid {
  Case c;
  Inputs in;
  Params p;
  Valid() {
    c.q_lens = {2, 1};
    c.kv_lens = {20, 9};
    c.extra_slots = 2;
    c.extra_rows = 1;
    c.extra_table_cols = 0;  // M = 2 pages of 16
    std::mt19937 rng(1);
    in = MakeInputs(c, rng);
    p = in.params(c);
  }
};

void ExpectError(const Params& p, const std::string& needle, const Config& cfg = Config{1, 32, 1}) {
  const Status s = AttentionCpu(p, cfg);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(needle), std::string::npos)
      << "message: " << s.message() << "\nwanted: " << needle;
}

TEST(PagedAttentionValidationTest, ValidProblemPasses) {
  Valid v;
  const Status s = AttentionCpu(v.p, Config{1, 32, 1});
  EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST(PagedAttentionValidationTest, Shapes) {
  // Dims of the valid problem: T = 4, Hq = 4, D = 64, N = 4, M = 2, P = 8, Hkv = 2, S = 16.
  float dummy[1024] = {};
  {
    Valid v;
    v.p.q = TensorView::Contiguous(dummy, DType::kF32, {4, 4});
    ExpectError(v.p, "q: expected float32|bfloat16|float16[T, Hq, D], got float32[4,4]");
  }
  {
    Valid v;
    v.p.q.dtype = DType::kF64;
    ExpectError(v.p, "q: expected float32|bfloat16|float16[T, Hq, D], got float64[4,4,64]");
  }
  {
    Valid v;
    v.p.q.shape[2] = 0;
    ExpectError(v.p, "q: expected [T, Hq, D] with Hq and D positive");
  }
  {
    Valid v;
    v.p.key_cache.dtype = DType::kI32;
    ExpectError(v.p, "key_cache: expected float32|bfloat16|float16|float8_e4m3fn[P, Hkv, S, D] "
                     "(head-major), got int32[8,2,16,64]");
  }
  {
    Valid v;
    v.p.key_cache.shape[2] = 0;
    ExpectError(v.p, "key_cache: expected float32|bfloat16|float16|float8_e4m3fn[P, Hkv, S, D] "
                     "(head-major) with Hkv, S and D positive, got float32[8,2,0,64]");
  }
  {
    Valid v;
    v.p.key_cache = Reshape(v.p.key_cache, {16, 16, 64});
    ExpectError(v.p, "key_cache: expected float32|bfloat16|float16|float8_e4m3fn[P, Hkv, S, D] "
                     "(head-major), got float32[16,16,64]");
  }
  {
    Valid v;  // no data is read before the size check fails
    v.p.q = TensorView::Contiguous(dummy, DType::kF32, {int64_t{1} << 31, 1, 1});
    ExpectError(v.p, "q: T must fit int32 (query_start_loc), got float32[2147483648,1,1]");
  }
  {
    Valid v;
    v.p.value_cache.dtype = DType::kBF16;
    ExpectError(v.p, "value_cache: expected float32[8,2,16,64] (like key_cache), got bfloat16");
  }
  {
    Valid v;
    v.p.value_cache.shape[0] = 7;
    ExpectError(v.p, "value_cache: expected float32[8,2,16,64] (like key_cache), got float32[7,2,16,64]");
  }
  {
    Valid v;
    v.p.q = Reshape(v.p.q, {4, 4, 32});
    v.p.out = Reshape(v.p.out, {4, 4, 32});
    ExpectError(v.p, "key_cache: head_dim D = 64 must equal q's D = 32");
  }
  {
    Valid v;
    v.p.q = Reshape(v.p.q, {4, 3, 64});
    v.p.out = Reshape(v.p.out, {4, 3, 64});
    ExpectError(v.p, "key_cache: Hkv = 2 must divide q's Hq = 3");
  }
  {
    Valid v;
    v.p.kv_lens.dtype = DType::kI64;
    ExpectError(v.p, "kv_lens: expected int32[N], got int64[4]");
  }
  {
    Valid v;
    v.p.block_tables.shape[0] = 3;
    ExpectError(v.p, "block_tables: expected int32[N, M] with N = 4 (kv_lens), got int32[3,2]");
  }
  {
    Valid v;
    v.p.query_start_loc.shape[0] = 4;
    ExpectError(v.p, "query_start_loc: expected int32[N + 1] with N = 4 (kv_lens), or int32[0] "
                     "(absent: one query row per sequence), got int32[4]");
  }
  {
    Valid v;
    v.p.query_start_loc.dtype = DType::kF32;
    v.p.query_start_loc.shape[0] = 0;
    ExpectError(v.p, "query_start_loc: expected int32[N + 1] with N = 4 (kv_lens), or int32[0] "
                     "(absent: one query row per sequence), got float32[0]");
  }
  {
    Valid v;
    v.p.query_start_loc = Reshape(v.p.query_start_loc, {5, 1});
    ExpectError(v.p, "query_start_loc: expected int32[N + 1]");
  }
  {
    Valid v;
    v.p.num_seqs.shape[0] = 2;
    ExpectError(v.p, "num_seqs: expected int32[1], got int32[2]");
  }
  {
    Valid v;
    v.p.kv_starts = v.in.kv_starts.view();
    v.p.kv_starts.shape[0] = 5;
    ExpectError(v.p, "kv_starts: expected int32[N] with N = 4 (kv_lens), got int32[5]");
  }
  {
    Valid v;
    v.p.sinks = TensorView::Contiguous(dummy, DType::kF32, {3});
    ExpectError(v.p, "sinks: expected float32|bfloat16|float16|float64[Hq] with Hq = 4 (q), got float32[3]");
  }
  {
    Valid v;
    v.p.sinks = TensorView::Contiguous(dummy, DType::kI32, {4});
    ExpectError(v.p, "sinks: expected");
  }
  {
    Valid v;
    v.p.out.dtype = DType::kBF16;
    ExpectError(v.p, "out: expected float32[4,4,64] (like q), got bfloat16[4,4,64]");
  }
  {
    Valid v;
    v.p.out.shape[0] = 3;
    ExpectError(v.p, "out: expected float32[4,4,64] (like q), got float32[3,4,64]");
  }
  {
    Valid v;
    v.p.out.data = nullptr;
    ExpectError(v.p, "out has no data");
  }
}

TEST(PagedAttentionValidationTest, Attributes) {
  {
    Valid v;
    v.p.layout = static_cast<KvLayout>(2);
    ExpectError(v.p, "kv_layout must be 0 (head-major [P, Hkv, S, D]) or 1");
  }
  {
    Valid v;
    v.p.layout = KvLayout::kTokenMajor;  // [8,2,16,64] read as S = 2, Hkv = 16: 16 !| 4
    ExpectError(v.p, "key_cache: Hkv = 16 must divide q's Hq = 4");
  }
  {
    Valid v;
    v.p.softmax_scale = std::numeric_limits<float>::infinity();
    ExpectError(v.p, "softmax_scale must be finite, got inf");
  }
  {
    Valid v;
    v.p.logits_soft_cap = -1.0f;
    ExpectError(v.p, "logits_soft_cap must be finite and >= 0 (0: off), got -1");
  }
  {
    Valid v;
    v.p.logits_soft_cap = std::numeric_limits<float>::quiet_NaN();
    ExpectError(v.p, "logits_soft_cap must be finite");
  }
  {
    Valid v;
    v.p.k_scale = std::numeric_limits<float>::quiet_NaN();
    ExpectError(v.p, "k_scale and v_scale must be finite, got k_scale=nan v_scale=1");
  }
  {
    Valid v;
    ExpectError(v.p, "config: num_splits >= 0, block_kv in [1, 4096] and num_threads >= 0",
                Config{1, 0, 1});
    ExpectError(v.p, "block_kv=5000", Config{1, 5000, 1});
    ExpectError(v.p, "num_threads=-1", Config{1, 32, -1});
    ExpectError(v.p, "num_splits=-2", Config{-2, 32, 1});
  }
}

TEST(PagedAttentionValidationTest, MetadataValues) {
  // Valid: N = 4, M = 2, S = 16, P = 8, T = 4; sequences (q 2, kv 20) and (q 1, kv 9).
  const auto with = [](auto edit, const std::string& needle) {
    Valid v;
    edit(v);
    ExpectError(v.p, needle);
  };
  with([](Valid& v) { v.in.num_seqs.i32()[0] = -1; },
       "num_seqs: -1 must be in [0, N = 4] (kv_lens int32[4])");
  with([](Valid& v) { v.in.num_seqs.i32()[0] = 5; }, "num_seqs: 5 must be in [0, N = 4]");
  with([](Valid& v) { v.in.qsl.i32()[0] = 1; }, "query_start_loc[0] must be 0, got 1");
  with([](Valid& v) { v.in.qsl.i32()[1] = 4; v.in.qsl.i32()[2] = 3; },
       "query_start_loc must be non-decreasing: query_start_loc[2] = 3 < query_start_loc[1] = 4");
  with([](Valid& v) { v.in.qsl.i32()[2] = 5; },
       "query_start_loc[2] = 5 exceeds the number of query rows T = 4");
  with([](Valid& v) { v.in.kv_lens.i32()[1] = 0; },
       "kv_lens[1] = 0 is below the 1 query rows of sequence 1 (query_start_loc[1..2] = 2..3)");
  with([](Valid& v) { v.in.kv_lens.i32()[0] = 33; },
       "kv_lens[0] = 33 exceeds the 2 pages of 16 slots a block_tables row holds (32)");
  with([](Valid& v) { v.in.block_tables.i32()[1] = 8; },
       "block_tables[0, 1] = 8 is not a page of key_cache float32[8,2,16,64] (P = 8); sequence 0 "
       "reads key positions up to kv_lens[0] = 20");
  with([](Valid& v) { v.in.block_tables.i32()[2] = -1; }, "block_tables[1, 0] = -1 is not a page");
  with(
      [](Valid& v) {
        v.p.kv_starts = v.in.kv_starts.view();
        v.in.kv_starts.i32()[0] = 0;
        v.in.kv_starts.i32()[1] = 10;
      },
      "kv_starts[1] = 10 must be in [0, kv_lens[1] = 9]");
  with(
      [](Valid& v) {
        v.p.kv_starts = v.in.kv_starts.view();
        v.in.kv_starts.i32()[0] = -2;
      },
      "kv_starts[0] = -2 must be in [0, kv_lens[0] = 20]");
}

TEST(PagedAttentionValidationTest, AbsentQueryStartLoc) {
  // Valid: N = 4, T = 4, num_seqs = 2; without query_start_loc sequence n owns row n.
  for (int empty_view = 0; empty_view < 2; ++empty_view) {
    SCOPED_TRACE(empty_view ? "int32[0]" : "default view");
    const auto absent = [&](Valid& v) {
      v.p.query_start_loc = empty_view ? TensorView::Contiguous(v.in.qsl.view().data, DType::kI32, {0})
                                       : TensorView{};
    };
    {
      Valid v;
      absent(v);
      const Status s = AttentionCpu(v.p, Config{1, 32, 1});
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    {
      Valid v;
      absent(v);
      v.in.num_seqs.i32()[0] = 4;  // num_seqs == T: every row is a sequence's
      for (int n = 2; n < 4; ++n) {
        v.in.kv_lens.i32()[n] = 1;
        v.in.block_tables.i32()[n * 2] = 0;
      }
      const Status s = AttentionCpu(v.p, Config{1, 32, 1});
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    {
      Valid v;
      absent(v);
      v.p.q.shape[0] = v.p.out.shape[0] = 1;
      ExpectError(v.p, "num_seqs: 2 exceeds the number of query rows T = 1; query_start_loc is "
                       "absent, so each sequence owns one row");
    }
    {
      Valid v;
      absent(v);
      v.in.kv_lens.i32()[1] = 0;
      ExpectError(v.p, "kv_lens[1] = 0 is below the 1 query rows of sequence 1 (query_start_loc "
                       "absent: row 1)");
    }
  }
}

TEST(PagedAttentionValidationTest, UnreadPagesMayHoldAnything) {
  // Pages wholly before kv_starts or the window, and those of sequences without queries,
  // are not read, so their block_tables entries are not checked.
  Valid v;
  v.p.kv_starts = v.in.kv_starts.view();
  v.in.kv_starts.i32()[0] = 16;
  v.in.kv_starts.i32()[1] = 0;
  v.in.block_tables.i32()[0] = -5;
  EXPECT_TRUE(AttentionCpu(v.p, Config{1, 32, 1}).ok());
  v.p.kv_starts = TensorView{};
  v.p.window_left = 2;  // the first query (position 18) sees keys from 16 on
  EXPECT_TRUE(AttentionCpu(v.p, Config{1, 32, 1}).ok());
  v.p.window_left = 3;
  ExpectError(v.p, "block_tables[0, 0] = -5 is not a page");
}

TEST(PagedKvCacheUpdateTest, Validation) {
  float dummy[4096] = {};
  int32_t lens[2] = {3, INT_MIN}, tables[4] = {0, -1, 5, 5}, qsl[3] = {0, 2, -7}, ns[1] = {1};
  const auto make = [&]() {
    CacheUpdateParams p;
    p.new_keys = TensorView::Contiguous(dummy, DType::kF32, {3, 2, 8});
    p.new_values = TensorView::Contiguous(dummy, DType::kBF16, {3, 2, 8});
    p.key_cache = TensorView::Contiguous(dummy, DType::kF8E4M3, {2, 2, 4, 8});
    p.value_cache = TensorView::Contiguous(dummy + 1024, DType::kF8E4M3, {2, 2, 4, 8});
    p.kv_lens = TensorView::Contiguous(lens, DType::kI32, {2});
    p.block_tables = TensorView::Contiguous(tables, DType::kI32, {2, 2});
    p.query_start_loc = TensorView::Contiguous(qsl, DType::kI32, {3});
    p.num_seqs = TensorView::Contiguous(ns, DType::kI32, {1});
    return p;
  };
  const auto expect = [](const CacheUpdateParams& p, const std::string& needle) {
    const Status s = CacheUpdateCpu(p);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  {
    CacheUpdateParams p = make();
    EXPECT_TRUE(CacheUpdateCpu(p).ok());
  }
  {
    CacheUpdateParams p = make();
    p.new_keys.shape[1] = 1;
    expect(p, "new_keys: expected float32|bfloat16|float16|float64[T, Hkv, D] with Hkv = 2, D = 8 "
              "(key_cache float8_e4m3fn[2,2,4,8]), got float32[3,1,8]");
  }
  {
    CacheUpdateParams p = make();
    p.new_values.shape[0] = 2;
    expect(p, "new_values: expected");
    expect(p, "and T = 3 (new_keys), got bfloat16[2,2,8]");
  }
  {
    CacheUpdateParams p = make();
    p.new_values.dtype = DType::kI32;
    expect(p, "new_values: expected");
  }
  {
    CacheUpdateParams p = make();
    p.value_cache.dtype = DType::kF16;
    expect(p, "value_cache: expected float8_e4m3fn[2,2,4,8] (like key_cache), got float16");
  }
  {
    CacheUpdateParams p = make();
    p.layout = static_cast<KvLayout>(-1);
    expect(p, "kv_layout must be 0");
  }
  {
    CacheUpdateParams p = make();
    p.k_scale = 0.0f;
    expect(p, "k_scale and v_scale must be finite and nonzero, got k_scale=0 v_scale=1");
  }
  {
    CacheUpdateParams p = make();
    p.block_tables.shape[1] = 3;
    p.block_tables.shape[0] = 1;
    expect(p, "block_tables: expected int32[N, M] with N = 2 (kv_lens), got int32[1,3]");
  }
  {
    CacheUpdateParams p = make();
    lens[0] = 1;
    expect(p, "kv_lens[0] = 1 is below the 2 query rows of sequence 0");
    lens[0] = 9;
    expect(p, "kv_lens[0] = 9 exceeds the 2 pages of 4 slots a block_tables row holds (8)");
    lens[0] = 5;  // rows go to positions 3 and 4: page 1, whose id is -1
    expect(p, "block_tables[0, 1] = -1 is not a page of key_cache float8_e4m3fn[2,2,4,8] (P = 2)");
    lens[0] = 3;
    ns[0] = 3;
    expect(p, "num_seqs: 3 must be in [0, N = 2]");
    ns[0] = 1;
  }
  {
    CacheUpdateParams p = make();  // absent: sequence 0 owns row 0 only
    p.query_start_loc = TensorView{};
    EXPECT_TRUE(CacheUpdateCpu(p).ok());
    p.new_keys.shape[0] = p.new_values.shape[0] = 0;  // T = 0 < num_seqs
    expect(p, "num_seqs: 1 exceeds the number of query rows T = 0");
    p = make();
    p.query_start_loc.shape[0] = 2;
    expect(p, "query_start_loc: expected int32[N + 1] with N = 2 (kv_lens), or int32[0]");
  }
}

// --- FFI layout and registry ----------------------------------------------------------

TEST(PagedAttentionRegistryTest, CpuEntry) {
  StatusOr<KernelEntry> e = Registry::Global().Lookup("paged_attention", Platform::kCpu, Backend::kCpu);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->name, "paged_attention_cpu");
  EXPECT_EQ(e->priority, 100);
  EXPECT_EQ(e->op_version, kOpVersion);
  EXPECT_EQ(e->features, AllFeatures());
  ASSERT_EQ(e->ffi_targets.size(), 2u);
  EXPECT_EQ(e->ffi_targets[0].target, "ejkernel_paged_attention_cpu");
  EXPECT_EQ(e->ffi_targets[0].symbol, "EjkPagedAttentionCpu");
  EXPECT_EQ(e->ffi_targets[1].target, "ejkernel_paged_kv_cache_update_cpu");
  EXPECT_EQ(e->ffi_targets[1].symbol, "EjkPagedKvCacheUpdateCpu");
  const ::ejk::Config cfg = e->heuristic(nlohmann::json{{"head_dim", 128}});
  EXPECT_EQ(cfg.at("num_splits"), 1);
  EXPECT_EQ(cfg.at("num_threads"), 0);
  EXPECT_GE(cfg.at("block_kv").get<int>(), 16);
  for (const ::ejk::Config& c : e->candidates(nlohmann::json{{"head_dim", 64}})) {
    EXPECT_TRUE(c.contains("num_splits") && c.contains("block_kv") && c.contains("num_threads"));
  }
}

TEST(PagedAttentionRegistryTest, ConfigFromAttrs) {
  StatusOr<Config> cfg = ConfigFromAttrs(2, 64, 3);
  ASSERT_TRUE(cfg.ok());
  EXPECT_EQ(cfg->num_splits, 2);
  EXPECT_EQ(cfg->block_kv, 64);
  EXPECT_EQ(cfg->num_threads, 3);
  EXPECT_FALSE(ConfigFromAttrs(-1, 64, 0).ok());
  EXPECT_FALSE(ConfigFromAttrs(0, 0, 0).ok());
  EXPECT_FALSE(ConfigFromAttrs(0, int64_t{1} << 40, 0).ok());
  EXPECT_EQ(kHasKvStarts, 1);
  EXPECT_EQ(kHasSinks, 2);
}

// A zero-element query_start_loc operand is absent: a default view with a null pointer, which
// is what the CUDA kernels receive; a real one is viewed as is.
TEST(PagedAttentionRegistryTest, QueryStartLocOperand) {
  int32_t data[5] = {0, 1, 2, 3, 4};
  int64_t empty_dims[1] = {0}, dims[1] = {5};
  XLA_FFI_Buffer empty{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_S32, data, 1, empty_dims};
  StatusOr<TensorView> absent = QueryStartLocOf(xla::ffi::AnyBuffer(&empty));
  ASSERT_TRUE(absent.ok()) << absent.status().ToString();
  EXPECT_FALSE(absent->present());
  EXPECT_EQ(absent->ptr<int32_t>(), nullptr);
  EXPECT_EQ(QueryStartLoc(*absent), nullptr);
  EXPECT_EQ(QueryStartAt(QueryStartLoc(*absent), 3), 3);
  XLA_FFI_Buffer real{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_S32, data, 1, dims};
  StatusOr<TensorView> given = QueryStartLocOf(xla::ffi::AnyBuffer(&real));
  ASSERT_TRUE(given.ok()) << given.status().ToString();
  EXPECT_EQ(given->ToString(), "int32[5]");
  EXPECT_EQ(QueryStartLoc(*given), data);
}

}  // namespace
}  // namespace ejk::paged_attention
