// The CPU flash attention kernels against a plain float64 reference of semantics.h
// (materialised logits, analytic gradients), plus validation and determinism.
//
// Inputs are random; the seed comes from std::random_device and is printed with every
// failure. EJK_TEST_SEED=<n> reruns with a given seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flash_attention/cpu_common.h"
#include "flash_attention/params.h"
#include "flash_attention/semantics.h"
#include "runtime/tensor.h"

namespace ejk::flash_attention {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// --- host tensors ---------------------------------------------------------------------

// Owning storage of one dtype; Set rounds to the dtype and Get returns the stored value.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    data_.assign(static_cast<size_t>(size() * DTypeSize(dtype_)), 0);
  }
  bool empty() const { return shape_.empty(); }
  int64_t size() const {
    if (shape_.empty()) return 0;
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    return n;
  }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  TensorView view() {
    if (empty()) return TensorView{};
    return TensorView::Contiguous(data_.data(), dtype_, shape_.data(), static_cast<int>(shape_.size()));
  }
  void Set(int64_t i, double x) {
    unsigned char* p = data_.data() + i * DTypeSize(dtype_);
    switch (dtype_) {
      case DType::kF32: Store(p, static_cast<float>(x)); break;
      case DType::kF64: Store(p, x); break;
      case DType::kBF16: Store(p, FloatToBF16(static_cast<float>(x))); break;
      case DType::kF16: Store(p, FloatToF16(static_cast<float>(x))); break;
      case DType::kI32: Store(p, static_cast<int32_t>(x)); break;
      case DType::kU8:
      case DType::kBool: Store(p, static_cast<uint8_t>(x)); break;
      default: FAIL() << "unsupported dtype";
    }
  }
  double Get(int64_t i) const {
    const unsigned char* p = data_.data() + i * DTypeSize(dtype_);
    switch (dtype_) {
      case DType::kF32: return Load<float>(p);
      case DType::kF64: return Load<double>(p);
      case DType::kBF16: return BF16ToFloat(Load<uint16_t>(p));
      case DType::kF16: return F16ToFloat(Load<uint16_t>(p));
      case DType::kI32: return Load<int32_t>(p);
      case DType::kU8:
      case DType::kBool: return Load<uint8_t>(p);
      default: return 0.0;
    }
  }
  // Outputs start as NaN so that anything the kernel leaves unwritten shows.
  void Poison() {
    for (int64_t i = 0; i < size(); ++i) Set(i, std::numeric_limits<double>::quiet_NaN());
  }
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

// --- cases ----------------------------------------------------------------------------

// Bias / mask shapes: absent, [B, Hq], [1, Hq], [B, 1], [1, 1].
enum class Broadcast { kNone, kFull, kOneBatch, kOneHead, kOneBoth };

struct Case {
  std::string name;
  int64_t batch = 2, seqlen_q = 37, seqlen_k = 53, q_heads = 4, kv_heads = 2, head_dim = 64;
  DType dtype = DType::kF32;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  float soft_cap = 0.0f;
  float dropout = 0.0f;
  Broadcast bias = Broadcast::kNone;
  DType bias_dtype = DType::kF32;
  bool dbias_in_bias_dtype = false;  // a bf16/f16 [B, Hq] bias's gradient in its own dtype
  Broadcast mask = Broadcast::kNone;
  DType mask_dtype = DType::kBool;
  bool sinks = false;
  // Packed sequences (batch 1): per-sequence lengths; rows/keys past the sum are padding.
  std::vector<int32_t> seq_q, seq_k;
  bool segments = false;
  // Segment ids in order (documents): blocks of one id, blocks of other documents' ids.
  bool documents = false;
  bool dlse = false;
  bool float32_keys = false;  // dK and dV in f32, unrounded, from 16-bit inputs
  double input_scale = 1.0;  // larger values sharpen the softmax
  CpuConfig cfg{16, 32, 2};
};

struct Tensors {
  HostTensor q, k, v, bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, out, lse;
  HostTensor dout, dlse, dq, dk, dv, dbias, daux;
  uint32_t seed = 0;
  float scale = 1.0f;
};

std::vector<int64_t> BroadcastShape(Broadcast b, const Case& c) {
  const int64_t bb = (b == Broadcast::kOneBatch || b == Broadcast::kOneBoth) ? 1 : c.batch;
  const int64_t hb = (b == Broadcast::kOneHead || b == Broadcast::kOneBoth) ? 1 : c.q_heads;
  return {bb, hb, c.seqlen_q, c.seqlen_k};
}

uint32_t TestSeed() {
  if (const char* s = std::getenv("EJK_TEST_SEED")) return static_cast<uint32_t>(std::strtoul(s, nullptr, 10));
  return std::random_device{}();
}

Tensors MakeInputs(const Case& c, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform;
  Tensors t;
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, D = c.head_dim;
  auto fill = [&](HostTensor& x, double scale) {
    for (int64_t i = 0; i < x.size(); ++i) x.Set(i, scale * normal(rng));
  };
  t.q = HostTensor(c.dtype, {B, Sq, c.q_heads, D});
  t.k = HostTensor(c.dtype, {B, Sk, c.kv_heads, D});
  t.v = HostTensor(c.dtype, {B, Sk, c.kv_heads, D});
  fill(t.q, c.input_scale);
  fill(t.k, c.input_scale);
  fill(t.v, 1.0);
  if (c.bias != Broadcast::kNone) {
    t.bias = HostTensor(c.bias_dtype, BroadcastShape(c.bias, c));
    fill(t.bias, 1.0);
  }
  if (c.mask != Broadcast::kNone) {
    t.mask = HostTensor(c.mask_dtype, BroadcastShape(c.mask, c));
    for (int64_t i = 0; i < t.mask.size(); ++i) t.mask.Set(i, uniform(rng) < 0.75 ? 1 : 0);
    // Some rows see nothing at all through the mask.
    for (int64_t i = 0; i < t.mask.size(); i += Sk * 7) {
      for (int64_t j = 0; j < Sk; ++j) t.mask.Set(i + j, 0);
    }
  }
  if (c.sinks) {
    t.aux = HostTensor(DType::kF32, {c.q_heads});
    fill(t.aux, 1.5);
  }
  if (!c.seq_q.empty()) {
    const int64_t n = static_cast<int64_t>(c.seq_q.size());
    t.cu_q = HostTensor(DType::kI32, {n + 1});
    t.cu_k = HostTensor(DType::kI32, {n + 1});
    int64_t sum_q = 0, sum_k = 0;
    for (int64_t i = 0; i <= n; ++i) {
      t.cu_q.Set(i, static_cast<double>(sum_q));
      t.cu_k.Set(i, static_cast<double>(sum_k));
      if (i < n) {
        sum_q += c.seq_q[i];
        sum_k += c.seq_k[i];
      }
    }
  }
  if (c.segments) {
    t.seg_q = HostTensor(DType::kI32, {B, Sq});
    t.seg_kv = HostTensor(DType::kI32, {B, Sk});
    std::uniform_int_distribution<int> id(0, 2);
    for (int64_t i = 0; i < t.seg_q.size(); ++i) t.seg_q.Set(i, id(rng));
    for (int64_t i = 0; i < t.seg_kv.size(); ++i) t.seg_kv.Set(i, id(rng));
    if (c.documents) {
      // Document boundaries at random positions of each row; id 1 has queries but no keys.
      for (HostTensor* ids : {&t.seg_q, &t.seg_kv}) {
        const int64_t length = ids->size() / B;
        std::uniform_int_distribution<int64_t> cut(0, length);
        for (int64_t b = 0; b < B; ++b) {
          int64_t first = cut(rng), second = cut(rng);
          if (first > second) std::swap(first, second);
          for (int64_t i = 0; i < length; ++i) {
            ids->Set(b * length + i, i < first ? 0 : i < second ? (ids == &t.seg_q ? 1 : 2) : 2);
          }
        }
      }
    }
  }
  t.out = HostTensor(c.dtype, {B, Sq, c.q_heads, D});
  t.lse = HostTensor(DType::kF32, {B, c.q_heads, Sq});
  t.dout = HostTensor(c.dtype, {B, Sq, c.q_heads, D});
  fill(t.dout, 1.0);
  if (c.dlse) {
    t.dlse = HostTensor(DType::kF32, {B, c.q_heads, Sq});
    fill(t.dlse, 1.0);
  }
  t.dq = HostTensor(c.dtype, t.q.shape());
  t.dk = HostTensor(c.float32_keys ? DType::kF32 : c.dtype, t.k.shape());
  t.dv = HostTensor(c.float32_keys ? DType::kF32 : c.dtype, t.v.shape());
  if (!t.bias.empty()) t.dbias = HostTensor(c.dbias_in_bias_dtype ? c.bias_dtype : DType::kF32, t.bias.shape());
  if (!t.aux.empty()) t.daux = HostTensor(DType::kF32, {c.q_heads});
  t.seed = static_cast<uint32_t>(rng());
  t.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  return t;
}

ForwardParams MakeForwardParams(const Case& c, Tensors& t) {
  ForwardParams p;
  p.q = t.q.view();
  p.k = t.k.view();
  p.v = t.v.view();
  p.bias = t.bias.view();
  p.mask = t.mask.view();
  p.softmax_aux = t.aux.view();
  p.cu_seqlens_q = t.cu_q.view();
  p.cu_seqlens_k = t.cu_k.view();
  p.q_segment_ids = t.seg_q.view();
  p.kv_segment_ids = t.seg_kv.view();
  p.softmax_scale = t.scale;
  p.causal = c.causal;
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.logits_soft_cap = c.soft_cap;
  p.dropout_prob = c.dropout;
  p.dropout_seed = t.seed;
  p.out = t.out.view();
  p.lse = t.lse.view();
  return p;
}

BackwardParams MakeBackwardParams(const Case& c, Tensors& t) {
  BackwardParams p;
  p.fwd = MakeForwardParams(c, t);
  p.dout = t.dout.view();
  p.dlse = t.dlse.view();
  p.dq = t.dq.view();
  p.dk = t.dk.view();
  p.dv = t.dv.view();
  p.dbias = t.dbias.view();
  p.dsoftmax_aux = t.daux.view();
  p.deterministic = true;
  return p;
}

// --- float64 reference ------------------------------------------------------------------

struct Reference {
  std::vector<double> out, lse, dq, dk, dv, dbias, daux;
};

// Everything about query row i of (b, h): its visible keys, their logits (and tanh of
// the capped part), and whether the row belongs to a sequence.
struct Row {
  bool real = true;
  int64_t key_begin = 0;  // the sequence's first key
  std::vector<int64_t> keys;
  std::vector<double> logit, tanh;
};

Row ReferenceRow(const Case& c, const Tensors& t, int64_t b, int64_t h, int64_t i) {
  const int64_t Sq = c.seqlen_q, Sk = c.seqlen_k, D = c.head_dim;
  const int64_t kvh = h / (c.q_heads / c.kv_heads);
  Row row;
  int64_t q_begin = 0, q_len = Sq, k_begin = 0, k_len = Sk;
  if (!c.seq_q.empty()) {
    row.real = false;
    for (size_t n = 0; n < c.seq_q.size(); ++n) {
      const int64_t qb = static_cast<int64_t>(t.cu_q.Get(n)), qe = static_cast<int64_t>(t.cu_q.Get(n + 1));
      if (i >= qb && i < qe) {
        row.real = true;
        q_begin = qb;
        q_len = qe - qb;
        k_begin = static_cast<int64_t>(t.cu_k.Get(n));
        k_len = static_cast<int64_t>(t.cu_k.Get(n + 1)) - k_begin;
      }
    }
    if (!row.real) return row;
  }
  row.key_begin = k_begin;
  for (int64_t lj = 0; lj < k_len; ++lj) {
    const int64_t j = k_begin + lj;
    if (!KeyVisible(i - q_begin, lj, k_len - q_len, c.causal, c.window_left, c.window_right)) continue;
    if (!t.mask.empty()) {
      const auto& s = t.mask.shape();
      const int64_t mb = s[0] == 1 ? 0 : b, mh = s[1] == 1 ? 0 : h;
      if (t.mask.Get(((mb * s[1] + mh) * Sq + i) * Sk + j) == 0) continue;
    }
    if (!t.seg_q.empty() && t.seg_q.Get(b * Sq + i) != t.seg_kv.Get(b * Sk + j)) continue;
    double dot = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      dot += t.q.Get(((b * Sq + i) * c.q_heads + h) * D + d) * t.k.Get(((b * Sk + j) * c.kv_heads + kvh) * D + d);
    }
    double x = static_cast<double>(t.scale) * dot, th = 0.0;
    if (c.soft_cap > 0.0f) {
      th = std::tanh(x / c.soft_cap);
      x = c.soft_cap * th;
    }
    if (!t.bias.empty()) {
      const auto& s = t.bias.shape();
      const int64_t bb = s[0] == 1 ? 0 : b, bh = s[1] == 1 ? 0 : h;
      x += t.bias.Get(((bb * s[1] + bh) * Sq + i) * Sk + j);
    }
    row.keys.push_back(j);
    row.logit.push_back(x);
    row.tanh.push_back(th);
  }
  return row;
}

// Forward outputs and, when `given_out` is set (the backward's `out` input), gradients of
// sum(out * dout) + sum(lse * dlse).
Reference ComputeReference(const Case& c, const Tensors& t, const HostTensor* given_out) {
  const int64_t B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, Hq = c.q_heads, D = c.head_dim;
  const int64_t Hkv = c.kv_heads;
  Reference r;
  r.out.assign(B * Sq * Hq * D, 0.0);
  r.lse.assign(B * Hq * Sq, -kInf);
  r.dq.assign(B * Sq * Hq * D, 0.0);
  r.dk.assign(B * Sk * Hkv * D, 0.0);
  r.dv.assign(B * Sk * Hkv * D, 0.0);
  r.dbias.assign(t.bias.empty() ? 0 : t.bias.size(), 0.0);
  r.daux.assign(t.aux.empty() ? 0 : Hq, 0.0);
  const uint32_t threshold = DropoutThreshold(c.dropout);
  const double keep_scale = 1.0 / (1.0 - static_cast<double>(c.dropout));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t kvh = h / (Hq / Hkv);
      const uint32_t batch_head = static_cast<uint32_t>(b * Hq + h);
      for (int64_t i = 0; i < Sq; ++i) {
        const Row row = ReferenceRow(c, t, b, h, i);
        const bool sink = !t.aux.empty() && row.real;
        const double aux = sink ? t.aux.Get(h) : 0.0;
        double m = sink ? aux : -kInf;
        for (double x : row.logit) m = std::max(m, x);
        if (m == -kInf) continue;
        double sum = sink ? std::exp(aux - m) : 0.0;
        for (double x : row.logit) sum += std::exp(x - m);
        const double lse = m + std::log(sum);
        r.lse[(b * Hq + h) * Sq + i] = lse;
        const uint32_t row_key = DropoutRowKey(t.seed, batch_head, static_cast<uint32_t>(i));
        std::vector<double> p(row.keys.size()), z(row.keys.size(), 1.0);
        const int64_t qo = ((b * Sq + i) * Hq + h) * D;
        for (size_t n = 0; n < row.keys.size(); ++n) {
          p[n] = std::exp(row.logit[n] - lse);
          if (c.dropout > 0.0f) {
            z[n] = DropoutKeep(row_key, static_cast<uint32_t>(row.keys[n] - row.key_begin), threshold) ? keep_scale
                                                                                                     : 0.0;
          }
          const int64_t ko = ((b * Sk + row.keys[n]) * Hkv + kvh) * D;
          for (int64_t d = 0; d < D; ++d) r.out[qo + d] += p[n] * z[n] * t.v.Get(ko + d);
        }
        if (!given_out) continue;

        double delta = t.dlse.empty() ? 0.0 : -t.dlse.Get((b * Hq + h) * Sq + i);
        for (int64_t d = 0; d < D; ++d) delta += t.dout.Get(qo + d) * given_out->Get(qo + d);
        if (sink) r.daux[h] -= std::exp(aux - lse) * delta;
        for (size_t n = 0; n < row.keys.size(); ++n) {
          const int64_t j = row.keys[n], ko = ((b * Sk + j) * Hkv + kvh) * D;
          double dp = 0.0;
          for (int64_t d = 0; d < D; ++d) dp += t.dout.Get(qo + d) * t.v.Get(ko + d);
          const double ds = p[n] * (z[n] * dp - delta);
          if (!t.bias.empty()) {
            const auto& s = t.bias.shape();
            const int64_t bb = s[0] == 1 ? 0 : b, bh = s[1] == 1 ? 0 : h;
            r.dbias[((bb * s[1] + bh) * Sq + i) * Sk + j] += ds;
          }
          const double dpre = ds * (c.soft_cap > 0.0f ? 1.0 - row.tanh[n] * row.tanh[n] : 1.0) * t.scale;
          for (int64_t d = 0; d < D; ++d) {
            r.dq[qo + d] += dpre * t.k.Get(ko + d);
            r.dk[ko + d] += dpre * t.q.Get(qo + d);
            r.dv[ko + d] += p[n] * z[n] * t.dout.Get(qo + d);
          }
        }
      }
    }
  }
  return r;
}

// --- comparison -----------------------------------------------------------------------

struct Tolerance {
  double rel;  // of each element
  double abs;  // of the tensor's largest reference magnitude
};

// The kernel computes in f32 from exactly converted inputs and rounds outputs once, so
// 16-bit outputs may be off by the dtype's unit roundoff (2^-8, 2^-11) on top of the f32
// arithmetic.
Tolerance ToleranceFor(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {1.0 / 256 + 2e-4, 2e-5};
    case DType::kF16: return {1.0 / 2048 + 2e-4, 2e-5};
    default: return {1e-4, 2e-5};
  }
}

void ExpectClose(const char* what, const HostTensor& got, const std::vector<double>& want, Tolerance tol) {
  ASSERT_EQ(static_cast<size_t>(got.size()), want.size()) << what;
  double scale = 0.0;
  for (double w : want) {
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  }
  int failures = 0;
  double worst = 0.0;
  for (size_t n = 0; n < want.size(); ++n) {
    const double g = got.Get(static_cast<int64_t>(n)), w = want[n];
    if (std::isinf(w)) {
      if (g != w) {
        ADD_FAILURE() << what << "[" << n << "]: got " << g << ", want " << w;
        if (++failures > 5) return;
      }
      continue;
    }
    const double err = std::abs(g - w), bound = tol.rel * std::abs(w) + tol.abs * scale;
    worst = std::max(worst, err / std::max(bound, 1e-300));
    if (!(err <= bound)) {
      ADD_FAILURE() << what << "[" << n << "]: got " << g << ", want " << w << " (error " << err
                    << ", bound " << bound << ")";
      if (++failures > 5) return;
    }
  }
  if (std::getenv("EJK_TEST_VERBOSE")) std::printf("  %-12s worst error / bound = %.3g\n", what, worst);
}

// --- running cases ----------------------------------------------------------------------

void RunCase(const Case& c) {
  const uint32_t seed = TestSeed();
  SCOPED_TRACE(c.name + ": seed " + std::to_string(seed) + " (rerun with EJK_TEST_SEED=" +
               std::to_string(seed) + ")");
  std::mt19937 rng(seed);
  Tensors t = MakeInputs(c, rng);

  t.out.Poison();
  t.lse.Poison();
  const ForwardParams fp = MakeForwardParams(c, t);
  const Status fs = ForwardCpu(fp, c.cfg);
  ASSERT_TRUE(fs.ok()) << fs.ToString();

  BackwardParams bp = MakeBackwardParams(c, t);
  t.dq.Poison();
  t.dk.Poison();
  t.dv.Poison();
  if (!t.dbias.empty()) t.dbias.Poison();
  if (!t.daux.empty()) t.daux.Poison();
  const Status bs = BackwardCpu(bp, c.cfg);
  ASSERT_TRUE(bs.ok()) << bs.ToString();

  const Reference ref = ComputeReference(c, t, &t.out);
  const Tolerance tol = ToleranceFor(c.dtype), f32 = ToleranceFor(DType::kF32);
  ExpectClose("out", t.out, ref.out, tol);
  ExpectClose("lse", t.lse, ref.lse, f32);
  ExpectClose("dq", t.dq, ref.dq, tol);
  ExpectClose("dk", t.dk, ref.dk, ToleranceFor(t.dk.dtype()));
  ExpectClose("dv", t.dv, ref.dv, ToleranceFor(t.dv.dtype()));
  if (!t.dbias.empty()) ExpectClose("dbias", t.dbias, ref.dbias, ToleranceFor(t.dbias.dtype()));
  if (!t.daux.empty()) ExpectClose("dsoftmax_aux", t.daux, ref.daux, f32);
}

Case Named(std::string name, Case c) {
  c.name = std::move(name);
  return c;
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  const auto add = [&](const std::string& name, const auto& edit) {
    Case c;
    edit(c);
    cases.push_back(Named(name, c));
  };
  const auto packed = [](Case& c) {
    // An empty query sequence, one of length 1, one whose keys are empty, uneven
    // query/key lengths, and padding rows and keys at the end.
    c.batch = 1;
    c.seq_q = {23, 0, 1, 40, 6, 17};
    c.seq_k = {31, 9, 1, 35, 0, 20};
    c.seqlen_q = 23 + 0 + 1 + 40 + 6 + 17 + 5;
    c.seqlen_k = 31 + 9 + 1 + 35 + 0 + 20 + 3;
  };
  // Shapes: head dims, GQA ratios 1/2/4, Sq != Sk, odd sizes spanning several tiles.
  add("Basic", [](Case&) {});
  add("HeadDim128Mha", [](Case& c) { c.batch = 1; c.seqlen_q = 100; c.seqlen_k = 77; c.q_heads = 3; c.kv_heads = 3; c.head_dim = 128; });
  add("HeadDim256Gqa4", [](Case& c) { c.seqlen_q = 19; c.seqlen_k = 23; c.q_heads = 8; c.kv_heads = 2; c.head_dim = 256; });
  add("Gqa4DefaultBlocks", [](Case& c) { c.batch = 1; c.seqlen_q = 129; c.seqlen_k = 257; c.q_heads = 4; c.kv_heads = 1; c.cfg = CpuConfig{}; });
  add("HeadDim72", [](Case& c) { c.head_dim = 72; c.q_heads = 2; c.kv_heads = 1; });
  add("HeadDim8", [](Case& c) { c.head_dim = 8; c.seqlen_q = 61; });
  add("OddBlocks", [](Case& c) { c.cfg = CpuConfig{13, 29, 3}; c.causal = true; });
  add("UnitBlocks", [](Case& c) { c.seqlen_q = 9; c.seqlen_k = 11; c.cfg = CpuConfig{1, 1, 2}; c.causal = true; c.bias = Broadcast::kFull; });
  add("BlocksLargerThanSequence", [](Case& c) { c.seqlen_q = 7; c.seqlen_k = 5; c.cfg = CpuConfig{256, 512, 2}; });
  add("NoKeys", [](Case& c) { c.seqlen_k = 0; c.sinks = true; c.dlse = true; });
  add("NoQueries", [](Case& c) { c.seqlen_q = 0; c.bias = Broadcast::kOneHead; });
  add("SharpSoftmax", [](Case& c) { c.input_scale = 3.0; });
  // Each feature alone.
  add("Causal", [](Case& c) { c.causal = true; });
  add("CausalMoreQueriesThanKeys", [](Case& c) { c.causal = true; c.seqlen_q = 70; c.seqlen_k = 41; });
  add("WindowLeft", [](Case& c) { c.window_left = 9; });
  add("WindowRight", [](Case& c) { c.window_right = 4; });
  add("LongWindowDefaultBlocks", [](Case& c) {
    c.batch = 1; c.seqlen_q = 700; c.seqlen_k = 650; c.q_heads = 2; c.kv_heads = 1; c.causal = true;
    c.window_left = 90; c.cfg = CpuConfig{};
  });
  add("WindowBoth", [](Case& c) { c.window_left = 20; c.window_right = 0; c.seqlen_q = 90; c.seqlen_k = 90; });
  add("SoftCap", [](Case& c) { c.soft_cap = 2.5f; c.input_scale = 2.0; });
  add("Sinks", [](Case& c) { c.sinks = true; });
  add("BiasFull", [](Case& c) { c.bias = Broadcast::kFull; });
  add("BiasOneBatch", [](Case& c) { c.bias = Broadcast::kOneBatch; });
  add("BiasOneHead", [](Case& c) { c.bias = Broadcast::kOneHead; });
  add("BiasOneBoth", [](Case& c) { c.bias = Broadcast::kOneBoth; });
  add("BiasBf16", [](Case& c) { c.bias = Broadcast::kOneHead; c.bias_dtype = DType::kBF16; });
  add("BiasF16", [](Case& c) { c.bias = Broadcast::kFull; c.bias_dtype = DType::kF16; });
  add("BiasF64", [](Case& c) { c.bias = Broadcast::kOneBatch; c.bias_dtype = DType::kF64; });
  add("DbiasBf16", [](Case& c) {
    c.bias = Broadcast::kFull; c.bias_dtype = DType::kBF16; c.dbias_in_bias_dtype = true; c.causal = true;
  });
  add("DbiasF16", [](Case& c) {
    c.dtype = DType::kF16; c.bias = Broadcast::kFull; c.bias_dtype = DType::kF16; c.dbias_in_bias_dtype = true;
    c.mask = Broadcast::kOneHead;
  });
  add("MaskFull", [](Case& c) { c.mask = Broadcast::kFull; });
  add("MaskOneBoth", [](Case& c) { c.mask = Broadcast::kOneBoth; });
  add("MaskOneHeadU8", [](Case& c) { c.mask = Broadcast::kOneHead; c.mask_dtype = DType::kU8; });
  add("Packed", packed);
  add("PackedCausal", [&](Case& c) { packed(c); c.causal = true; });
  add("SegmentIds", [](Case& c) { c.segments = true; });
  add("SegmentDocuments", [](Case& c) {
    c.segments = c.documents = true; c.seqlen_q = 130; c.seqlen_k = 150; c.causal = true; c.kv_heads = 1;
  });
  add("Dropout", [](Case& c) { c.dropout = 0.3f; });
  add("Dlse", [](Case& c) { c.dlse = true; });
  // Combined.
  add("AllPacked", [&](Case& c) {
    packed(c);
    c.q_heads = 4; c.kv_heads = 2; c.causal = true; c.window_left = 12; c.window_right = 3;
    c.soft_cap = 3.0f; c.dropout = 0.2f; c.bias = Broadcast::kOneBatch; c.mask = Broadcast::kOneHead;
    c.sinks = true; c.dlse = true; c.cfg = CpuConfig{8, 16, 2};
  });
  add("AllSegments", [](Case& c) {
    c.batch = 3; c.q_heads = 6; c.kv_heads = 2; c.seqlen_q = 45; c.seqlen_k = 66; c.causal = true;
    c.window_left = 30; c.soft_cap = 4.0f; c.dropout = 0.1f; c.bias = Broadcast::kOneBoth;
    c.mask = Broadcast::kFull; c.sinks = true; c.segments = true; c.dlse = true;
  });
  // 16-bit inputs: the reference sees the same rounded values.
  add("Bf16", [](Case& c) { c.dtype = DType::kBF16; c.causal = true; });
  add("F16", [](Case& c) { c.dtype = DType::kF16; c.head_dim = 128; c.q_heads = 2; c.kv_heads = 2; });
  // dK and dV as f32 parts of a sum: within f32's tolerance of the reference, not bf16's.
  add("Bf16Float32Keys", [](Case& c) {
    c.dtype = DType::kBF16; c.float32_keys = true; c.causal = true; c.sinks = true; c.dlse = true;
  });
  add("Bf16AllPacked", [&](Case& c) {
    packed(c);
    c.dtype = DType::kBF16; c.head_dim = 40; c.causal = true; c.window_left = 10; c.soft_cap = 3.0f;
    c.dropout = 0.25f; c.bias = Broadcast::kFull; c.mask = Broadcast::kOneBatch; c.sinks = true; c.dlse = true;
  });
  add("F16AllSegments", [](Case& c) {
    c.dtype = DType::kF16; c.window_right = 5; c.soft_cap = 2.0f; c.dropout = 0.4f;
    c.bias = Broadcast::kOneHead; c.sinks = true; c.segments = true;
  });
  return cases;
}

class FlashAttentionCpu : public testing::TestWithParam<Case> {};

TEST_P(FlashAttentionCpu, MatchesReference) { RunCase(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, FlashAttentionCpu, testing::ValuesIn(Cases()),
                         [](const testing::TestParamInfo<Case>& info) { return info.param.name; });

// The reference's analytic gradients against central differences of its own forward.
TEST(FlashAttentionCpuReference, GradientsMatchFiniteDifferences) {
  Case c;
  c.name = "finite differences";
  c.batch = 1; c.seqlen_q = 5; c.seqlen_k = 7; c.q_heads = 2; c.kv_heads = 1; c.head_dim = 4;
  c.causal = true; c.window_left = 4; c.soft_cap = 1.5f; c.dropout = 0.3f; c.sinks = true;
  c.bias = Broadcast::kOneHead; c.dlse = true; c.dtype = DType::kF64;
  std::mt19937 rng(TestSeed());
  Tensors t = MakeInputs(c, rng);
  const auto loss = [&] {
    const Reference r = ComputeReference(c, t, nullptr);
    double l = 0.0;
    for (size_t n = 0; n < r.out.size(); ++n) l += r.out[n] * t.dout.Get(static_cast<int64_t>(n));
    for (size_t n = 0; n < r.lse.size(); ++n) {
      if (std::isfinite(r.lse[n])) l += r.lse[n] * t.dlse.Get(static_cast<int64_t>(n));
    }
    return l;
  };
  HostTensor exact_out(DType::kF64, t.out.shape());
  const Reference fwd = ComputeReference(c, t, nullptr);
  for (size_t n = 0; n < fwd.out.size(); ++n) exact_out.Set(static_cast<int64_t>(n), fwd.out[n]);
  const Reference grad = ComputeReference(c, t, &exact_out);
  const auto check = [&](const char* what, HostTensor& x, const std::vector<double>& g) {
    for (int64_t n = 0; n < x.size(); ++n) {
      // Bias and sinks are stored in f32: divide by the step actually stored.
      const double x0 = x.Get(n);
      x.Set(n, x0 + 1e-5);
      const double x_up = x.Get(n), up = loss();
      x.Set(n, x0 - 1e-5);
      const double x_down = x.Get(n), down = loss();
      x.Set(n, x0);
      EXPECT_NEAR(g[n], (up - down) / (x_up - x_down), 1e-6) << what << "[" << n << "]";
    }
  };
  check("q", t.q, grad.dq);
  check("k", t.k, grad.dk);
  check("v", t.v, grad.dv);
  check("bias", t.bias, grad.dbias);
  check("softmax_aux", t.aux, grad.daux);
}

// The backward is bit-identical for any thread count, dbias broadcasts and GQA included.
TEST(FlashAttentionCpuDeterminism, BackwardIndependentOfThreads) {
  Case with_bias;
  with_bias.batch = 2; with_bias.seqlen_q = 150; with_bias.seqlen_k = 230; with_bias.q_heads = 4;
  with_bias.kv_heads = 2; with_bias.causal = true; with_bias.dropout = 0.1f;
  with_bias.bias = Broadcast::kOneBoth; with_bias.sinks = true; with_bias.dlse = true;
  Case without_bias = with_bias;  // more, independent tasks: one per (batch, kv head, key block)
  without_bias.bias = Broadcast::kNone;
  without_bias.window_left = 70;
  const uint32_t seed = TestSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const Case& c : {with_bias, without_bias}) {
    std::mt19937 rng(seed);
    Tensors t = MakeInputs(c, rng);
    ASSERT_TRUE(ForwardCpu(MakeForwardParams(c, t), c.cfg).ok());
    std::vector<std::vector<unsigned char>> first;
    for (int threads : {1, 2, 3, 8}) {
      CpuConfig cfg = c.cfg;
      cfg.num_threads = threads;
      for (HostTensor* x : {&t.dq, &t.dk, &t.dv, &t.dbias, &t.daux}) x->Poison();
      const Status s = BackwardCpu(MakeBackwardParams(c, t), cfg);
      ASSERT_TRUE(s.ok()) << s.ToString();
      const std::vector<std::vector<unsigned char>> now = {t.dq.bytes(), t.dk.bytes(), t.dv.bytes(),
                                                           t.dbias.bytes(), t.daux.bytes()};
      if (first.empty()) {
        first = now;
        continue;
      }
      const char* names[] = {"dq", "dk", "dv", "dbias", "dsoftmax_aux"};
      for (size_t n = 0; n < now.size(); ++n) {
        EXPECT_TRUE(now[n] == first[n]) << names[n] << " differs with " << threads << " threads";
      }
    }
  }
}

// The dropout hash's forms agree (the kernels' pair of keys 8 apart from one hash, against
// the threshold in the top 16 bits, and the vector draw of the CPU kernel); the draws are 16
// bits, kept at rate 1 - p.
TEST(FlashAttentionDropoutHash, FormsAgreeAndKeepRate) {
  std::mt19937 rng(1234);
  for (float p : {0.1f, 0.5f, 0.93f}) {
    const uint32_t threshold = DropoutThreshold(p), shifted = threshold << 16;
    int64_t kept = 0, total = 0;
    for (int row = 0; row < 64; ++row) {
      const uint32_t row_key = DropoutRowKey(static_cast<uint32_t>(rng()), static_cast<uint32_t>(row), rng() % 4096);
      const uint32_t base = static_cast<uint32_t>(rng() % 100000) * 16;
      for (uint32_t key = base; key < base + 256; ++key) {
        const bool keep = DropoutKeep(row_key, key, threshold);
        EXPECT_LE(DropoutDraw(row_key, key), 0xffffu);
        if (key % 16 < 8) {
          bool pair_keep, pair_keep_plus_8;
          DropoutKeepPair(row_key, key, shifted, pair_keep, pair_keep_plus_8);
          EXPECT_EQ(pair_keep, keep) << key;
          EXPECT_EQ(pair_keep_plus_8, DropoutKeep(row_key, key + 8, threshold)) << key;
        }
        const cpu::VecU draws = DropoutDraw(cpu::SplatU(row_key), cpu::SplatU(key));
        EXPECT_EQ(draws[cpu::kLanes - 1], DropoutDraw(row_key, key)) << key;
        kept += keep;
        ++total;
      }
    }
    EXPECT_NEAR(static_cast<double>(kept) / total, 1.0 - p, 0.01) << p;
  }
}

// A call on part of a larger one (one device's batch rows and heads of a call split over
// devices) given its origin in the seed operand draws the larger call's masks: batch row 1
// and q heads 2-3 (kv head 1) of a [2, S, 4 (2), D] call match that call bit for bit, forward
// and backward; without the origin they do not. The seed operand's checks: one or four
// 32-bit words, and a part's heads inside the call's.
TEST(FlashAttentionCpuDropoutOrigin, PartDrawsTheWholeCallsMasks) {
  Case whole;
  whole.batch = 2; whole.seqlen_q = 70; whole.seqlen_k = 90; whole.q_heads = 4; whole.kv_heads = 2;
  whole.causal = true; whole.dropout = 0.3f;
  Case part = whole;
  part.batch = 1; part.q_heads = 2; part.kv_heads = 1;
  const uint32_t seed = TestSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  Tensors w = MakeInputs(whole, rng);
  Tensors t = MakeInputs(part, rng);
  t.seed = w.seed;
  const int64_t D = whole.head_dim, b = 1, h0 = 2, kvh0 = 1;
  // [B, S, H, D] tensors: the part's (0, s, h, d) is the whole's (b, s, first + h, d).
  const auto slice = [&](const HostTensor& from, HostTensor& to, int64_t first) {
    const int64_t S = to.shape()[1], H = to.shape()[2], from_h = from.shape()[2];
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) to.Set((s * H + h) * D + d, from.Get(((b * S + s) * from_h + first + h) * D + d));
  };
  slice(w.q, t.q, h0);
  slice(w.k, t.k, kvh0);
  slice(w.v, t.v, kvh0);
  slice(w.dout, t.dout, h0);
  ASSERT_TRUE(ForwardCpu(MakeForwardParams(whole, w), whole.cfg).ok());
  ASSERT_TRUE(BackwardCpu(MakeBackwardParams(whole, w), whole.cfg).ok());
  HostTensor want_out(part.dtype, t.q.shape()), want_dq(part.dtype, t.q.shape()), want_dk(part.dtype, t.k.shape());
  slice(w.out, want_out, h0);
  slice(w.dq, want_dq, h0);
  slice(w.dk, want_dk, kvh0);

  const uint32_t origin[3] = {static_cast<uint32_t>(b), static_cast<uint32_t>(h0), static_cast<uint32_t>(whole.q_heads)};
  for (const bool with_origin : {true, false}) {
    for (HostTensor* x : {&t.out, &t.lse, &t.dq, &t.dk, &t.dv}) x->Poison();
    ForwardParams fp = MakeForwardParams(part, t);
    fp.dropout_origin = with_origin ? origin : nullptr;
    ASSERT_TRUE(ForwardCpu(fp, part.cfg).ok());
    BackwardParams bp = MakeBackwardParams(part, t);
    bp.fwd.dropout_origin = fp.dropout_origin;
    ASSERT_TRUE(BackwardCpu(bp, part.cfg).ok());
    EXPECT_EQ(t.out.bytes() == want_out.bytes(), with_origin) << "out";
    EXPECT_EQ(t.dq.bytes() == want_dq.bytes(), with_origin) << "dq";
    EXPECT_EQ(t.dk.bytes() == want_dk.bytes(), with_origin) << "dk";
  }
  EXPECT_TRUE(CheckDropoutSeedOperand(1, true).ok());
  EXPECT_TRUE(CheckDropoutSeedOperand(kDropoutSeedWithOrigin, true).ok());
  EXPECT_FALSE(CheckDropoutSeedOperand(2, true).ok());
  EXPECT_FALSE(CheckDropoutSeedOperand(1, false).ok());
  EXPECT_TRUE(CheckDropoutOrigin(origin, part.q_heads).ok());
  const uint32_t past_the_end[3] = {0, 3, 4}, more_than_all[3] = {0, 0, 1};
  EXPECT_FALSE(CheckDropoutOrigin(past_the_end, part.q_heads).ok());
  EXPECT_FALSE(CheckDropoutOrigin(more_than_all, part.q_heads).ok());
}

// The kernels' vector exp and tanh, in units in the last place of the f32 result.
TEST(FlashAttentionCpuMath, ExpAndTanhAccuracy) {
  using cpu::kLanes;
  const auto ulps = [](float got, double want) {
    return std::abs(got - want) / std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);
  };
  double worst_exp = 0.0, worst_tanh = 0.0;
  for (double x0 = -86.0; x0 < 88.0; x0 += 0.0013 * kLanes) {
    cpu::VecF x;
    for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(std::min(x0 + 0.0013 * i, 88.0));
    const cpu::VecF e = cpu::Exp(x);
    for (int i = 0; i < kLanes; ++i) {
      const double want = std::exp(static_cast<double>(x[i]));
      if (want >= 1.2e-38) worst_exp = std::max(worst_exp, ulps(e[i], want));
    }
  }
  for (double x0 = -12.0; x0 < 12.0; x0 += 0.00007 * kLanes) {
    cpu::VecF x;
    for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(x0 + 0.00007 * i);
    const cpu::VecF t = cpu::Tanh(x);
    for (int i = 0; i < kLanes; ++i) {
      const double want = std::tanh(static_cast<double>(x[i]));
      if (want != 0.0) worst_tanh = std::max(worst_tanh, ulps(t[i], want));
    }
  }
  EXPECT_LE(worst_exp, 1.5);
  EXPECT_LE(worst_tanh, 3.0);
  const cpu::VecF special = cpu::Exp(cpu::Splat(-std::numeric_limits<float>::infinity()));
  EXPECT_EQ(special[0], 0.0f);
  EXPECT_EQ(cpu::Exp(cpu::Splat(0.0f))[0], 1.0f);
  EXPECT_EQ(cpu::Tanh(cpu::Splat(1e30f))[0], 1.0f);
  EXPECT_EQ(cpu::Tanh(cpu::Splat(-1e30f))[0], -1.0f);
}

// --- validation -----------------------------------------------------------------------

class FlashAttentionCpuValidation : public testing::Test {
 protected:
  void SetUp() override {
    c_.name = "validation";
    c_.batch = 2; c_.seqlen_q = 16; c_.seqlen_k = 24; c_.q_heads = 8; c_.kv_heads = 2; c_.head_dim = 32;
    c_.bias = Broadcast::kOneHead; c_.mask = Broadcast::kFull; c_.sinks = true; c_.dlse = true;
    std::mt19937 rng(1);
    t_ = MakeInputs(c_, rng);
  }
  ForwardParams Fwd() { return MakeForwardParams(c_, t_); }
  BackwardParams Bwd() { return MakeBackwardParams(c_, t_); }

  // Forward and backward both reject p with InvalidArgument naming `name`.
  void ExpectRejected(const ForwardParams& p, const std::string& name) {
    const Status s = ForwardCpu(p, c_.cfg);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(name), std::string::npos) << "message: " << s.message();
    BackwardParams b = Bwd();
    b.fwd = p;
    const Status bs = BackwardCpu(b, c_.cfg);
    EXPECT_EQ(bs.code(), StatusCode::kInvalidArgument) << bs.ToString();
    EXPECT_NE(bs.message().find(name), std::string::npos) << "message: " << bs.message();
  }
  void ExpectBackwardRejected(const BackwardParams& p, const std::string& name) {
    const Status s = BackwardCpu(p, c_.cfg);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(name), std::string::npos) << "message: " << s.message();
  }

  Case c_;
  Tensors t_;
  std::vector<int32_t> ints_ = std::vector<int32_t>(4096, 0);
  std::vector<float> floats_ = std::vector<float>(1 << 16, 0.0f);
};

TEST_F(FlashAttentionCpuValidation, ValidInputsPass) {
  EXPECT_TRUE(ForwardCpu(Fwd(), c_.cfg).ok());
  EXPECT_TRUE(BackwardCpu(Bwd(), c_.cfg).ok());
}

TEST_F(FlashAttentionCpuValidation, QueryKeyValue) {
  ForwardParams p = Fwd();
  p.q.rank = 3;
  ExpectRejected(p, "query");
  p = Fwd();
  p.q.dtype = DType::kF64;
  ExpectRejected(p, "query");
  p = Fwd();
  p.q.data = nullptr;
  ExpectRejected(p, "query");
  p = Fwd();
  std::swap(p.q.strides[1], p.q.strides[2]);
  ExpectRejected(p, "query");
  p = Fwd();
  p.k.dtype = DType::kBF16;
  ExpectRejected(p, "key");
  p = Fwd();
  p.v.dtype = DType::kF16;
  ExpectRejected(p, "value");
  p = Fwd();
  p.k = TensorView::Contiguous(floats_.data(), DType::kF32, {3, 24, 2, 32});
  ExpectRejected(p, "key: batch (3)");
  p = Fwd();
  p.k = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 24, 2, 16});
  ExpectRejected(p, "key: head_dim (16)");
  p = Fwd();
  p.v = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 23, 2, 32});
  ExpectRejected(p, "value");
  p = Fwd();
  p.k = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 24, 3, 32});
  p.v = p.k;
  ExpectRejected(p, "key: num_kv_heads (3) must divide num_q_heads (8); query float32[2,16,8,32], key float32[2,24,3,32]");
  p = Fwd();
  p.q = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 16, 8, 0});
  p.k = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 24, 2, 0});
  p.v = p.k;
  ExpectRejected(p, "head_dim");
}

TEST_F(FlashAttentionCpuValidation, BiasMaskSinks) {
  ForwardParams p = Fwd();
  p.bias = TensorView::Contiguous(floats_.data(), DType::kF32, {3, 1, 16, 24});
  ExpectRejected(p, "bias float32[3,1,16,24] must broadcast to [batch=2, num_q_heads=8, seq_len_q=16, seq_len_k=24]");
  p = Fwd();
  p.bias = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 8, 16, 25});
  ExpectRejected(p, "bias");
  p = Fwd();
  p.bias = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 4, 16, 24});
  ExpectRejected(p, "bias");
  p = Fwd();
  p.bias.dtype = DType::kI32;
  ExpectRejected(p, "bias");
  p = Fwd();
  const int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  p.bias = TensorView::Contiguous(floats_.data(), DType::kF32, nine, 9);
  ExpectRejected(p, "bias");
  p = Fwd();
  p.mask.dtype = DType::kF32;
  ExpectRejected(p, "attention_mask");
  p = Fwd();
  p.mask = TensorView::Contiguous(floats_.data(), DType::kBool, {2, 8, 15, 24});
  ExpectRejected(p, "attention_mask");
  p = Fwd();
  p.softmax_aux = TensorView::Contiguous(floats_.data(), DType::kF32, {9});
  ExpectRejected(p, "softmax_aux");
  p = Fwd();
  p.softmax_aux.dtype = DType::kI32;
  ExpectRejected(p, "softmax_aux");
}

TEST_F(FlashAttentionCpuValidation, PackedSequencesAndSegments) {
  ForwardParams p = Fwd();
  // Packed sequences need batch 1.
  p.cu_seqlens_q = TensorView::Contiguous(ints_.data(), DType::kI32, {3});
  p.cu_seqlens_k = TensorView::Contiguous(ints_.data(), DType::kI32, {3});
  ExpectRejected(p, "cum_seqlens_q");
  c_.batch = 1;
  c_.bias = Broadcast::kNone;
  c_.mask = Broadcast::kNone;
  std::mt19937 rng(2);
  t_ = MakeInputs(c_, rng);
  const auto packed = [&] {
    ForwardParams q = Fwd();
    q.cu_seqlens_q = TensorView::Contiguous(ints_.data(), DType::kI32, {3});
    q.cu_seqlens_k = TensorView::Contiguous(ints_.data() + 8, DType::kI32, {3});
    return q;
  };
  EXPECT_TRUE(ForwardCpu(packed(), c_.cfg).ok());
  p = packed();
  p.cu_seqlens_k = TensorView{};
  ExpectRejected(p, "cum_seqlens_q and cum_seqlens_k must be given together");
  p = packed();
  p.cu_seqlens_q.dtype = DType::kI64;
  ExpectRejected(p, "cum_seqlens_q");
  p = packed();
  p.cu_seqlens_q.shape[0] = 1;
  p.cu_seqlens_k.shape[0] = 1;
  ExpectRejected(p, "cum_seqlens_q");
  p = packed();
  p.cu_seqlens_k.shape[0] = 4;
  ExpectRejected(p, "cum_seqlens_k");
  p = packed();
  p.q_segment_ids = TensorView::Contiguous(ints_.data(), DType::kI32, {1, 16});
  p.kv_segment_ids = TensorView::Contiguous(ints_.data(), DType::kI32, {1, 24});
  ExpectRejected(p, "segment_ids");

  const auto segmented = [&] {
    ForwardParams q = Fwd();
    q.q_segment_ids = TensorView::Contiguous(ints_.data(), DType::kI32, {1, 16});
    q.kv_segment_ids = TensorView::Contiguous(ints_.data(), DType::kI32, {1, 24});
    return q;
  };
  EXPECT_TRUE(ForwardCpu(segmented(), c_.cfg).ok());
  p = segmented();
  p.kv_segment_ids = TensorView{};
  ExpectRejected(p, "q_segment_ids and kv_segment_ids must be given together");
  p = segmented();
  p.kv_segment_ids = TensorView::Contiguous(ints_.data(), DType::kI32, {1, 23});
  ExpectRejected(p, "kv_segment_ids");
  p = segmented();
  p.q_segment_ids.dtype = DType::kU32;
  ExpectRejected(p, "q_segment_ids");
}

TEST_F(FlashAttentionCpuValidation, CuSeqlensValues) {
  c_.batch = 1;
  c_.bias = Broadcast::kNone;
  c_.mask = Broadcast::kNone;
  std::mt19937 rng(3);
  t_ = MakeInputs(c_, rng);
  std::vector<int32_t> cu_q = {0, 5, 16}, cu_k = {0, 10, 24};
  ForwardParams p = Fwd();
  p.cu_seqlens_q = TensorView::Contiguous(cu_q.data(), DType::kI32, {3});
  p.cu_seqlens_k = TensorView::Contiguous(cu_k.data(), DType::kI32, {3});
  EXPECT_TRUE(ForwardCpu(p, c_.cfg).ok());
  cu_q = {1, 5, 16};
  ExpectRejected(p, "cum_seqlens_q[0]");
  cu_q = {0, 5, 16};
  cu_k = {0, 10, 9};
  ExpectRejected(p, "cum_seqlens_k[2]=9 < cum_seqlens_k[1]=10");
  cu_k = {0, 10, 25};
  ExpectRejected(p, "cum_seqlens_k[2]=25 exceeds the packed length 24");
  cu_k = {0, 10, 24};
  cu_q = {0, 17, 17};
  ExpectRejected(p, "cum_seqlens_q[2]=17 exceeds");
}

TEST_F(FlashAttentionCpuValidation, Attributes) {
  ForwardParams p = Fwd();
  p.window_left = -2;
  ExpectRejected(p, "sliding_window");
  p = Fwd();
  p.window_right = -5;
  ExpectRejected(p, "sliding_window");
  for (float cap : {-1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    p = Fwd();
    p.logits_soft_cap = cap;
    ExpectRejected(p, "logits_soft_cap");
  }
  for (float prob : {1.0f, -0.1f, std::numeric_limits<float>::quiet_NaN()}) {
    p = Fwd();
    p.dropout_prob = prob;
    ExpectRejected(p, "dropout_prob");
  }
  for (float scale : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    p = Fwd();
    p.softmax_scale = scale;
    ExpectRejected(p, "softmax_scale");
  }
  p = Fwd();
  EXPECT_EQ(ForwardCpu(p, CpuConfig{0, 32, 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ForwardCpu(p, CpuConfig{16, 32, -1}).message().find("config"), std::string::npos);
  EXPECT_EQ(BackwardCpu(Bwd(), CpuConfig{16, 0, 1}).code(), StatusCode::kInvalidArgument);
}

TEST_F(FlashAttentionCpuValidation, Outputs) {
  ForwardParams p = Fwd();
  p.out.dtype = DType::kBF16;
  ExpectRejected(p, "out");
  p = Fwd();
  p.out.shape[2] = 4;
  ExpectRejected(p, "out");
  p = Fwd();
  p.lse.dtype = DType::kF16;
  ExpectRejected(p, "lse");
  p = Fwd();
  p.lse = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 16, 8});
  ExpectRejected(p, "lse must have shape [2,8,16]");
}

TEST_F(FlashAttentionCpuValidation, BackwardOperands) {
  BackwardParams p = Bwd();
  p.dout.shape[1] = 15;
  ExpectBackwardRejected(p, "dout");
  p = Bwd();
  p.dout.dtype = DType::kBF16;
  ExpectBackwardRejected(p, "dout");
  p = Bwd();
  p.dlse.dtype = DType::kF64;
  ExpectBackwardRejected(p, "dlse");
  p = Bwd();
  p.dq.shape[3] = 16;
  ExpectBackwardRejected(p, "dq");
  p = Bwd();
  p.dk = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 24, 8, 32});
  ExpectBackwardRejected(p, "dk must have shape [2,24,2,32]");
  p = Bwd();
  p.dv.dtype = DType::kF16;
  ExpectBackwardRejected(p, "dv");
  // 16-bit inputs may have f32 dK and dV, both or neither.
  p = Bwd();
  for (TensorView* t : {&p.fwd.q, &p.fwd.k, &p.fwd.v, &p.fwd.out, &p.dout, &p.dq}) t->dtype = DType::kBF16;
  EXPECT_TRUE(ValidateBackward(p).ok()) << ValidateBackward(p).status().ToString();
  p.dv.dtype = DType::kBF16;
  ExpectBackwardRejected(p, "dv: dtype (bfloat16) must equal dk's (float32)");
  p.dk.dtype = DType::kBF16;
  EXPECT_TRUE(ValidateBackward(p).ok()) << ValidateBackward(p).status().ToString();
  p.dk.dtype = DType::kF16;
  ExpectBackwardRejected(p, "dk");
  p = Bwd();
  p.dbias.dtype = DType::kBF16;
  ExpectBackwardRejected(p, "dbias");
  p = Bwd();
  p.dbias = TensorView::Contiguous(floats_.data(), DType::kF32, {2, 8, 16, 24});
  ExpectBackwardRejected(p, "dbias");
  // A bf16 bias's gradient may be bf16 where no two (batch, head) pairs share an element.
  p = Bwd();
  p.fwd.bias.dtype = DType::kBF16;
  p.dbias.dtype = DType::kBF16;
  ExpectBackwardRejected(p, "broadcasts over the batch or the heads");
  p.fwd.bias = TensorView::Contiguous(floats_.data(), DType::kBF16, {2, 8, 16, 24});
  p.dbias = TensorView::Contiguous(floats_.data() + 8192, DType::kBF16, {2, 8, 16, 24});
  EXPECT_TRUE(ValidateBackward(p).ok()) << ValidateBackward(p).status().ToString();
  p.dbias.dtype = DType::kF16;
  ExpectBackwardRejected(p, "dbias");
  p = Bwd();
  p.fwd.bias = TensorView{};
  ExpectBackwardRejected(p, "dbias");
  p = Bwd();
  p.dsoftmax_aux = TensorView::Contiguous(floats_.data(), DType::kF32, {4});
  ExpectBackwardRejected(p, "dsoftmax_aux");
  p = Bwd();
  p.fwd.softmax_aux = TensorView{};
  ExpectBackwardRejected(p, "dsoftmax_aux");
}

}  // namespace
}  // namespace ejk::flash_attention
