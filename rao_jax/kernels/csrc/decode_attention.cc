// Attention of a few new queries per row over the KV cache slots that row holds, float32 or
// bfloat16, for rao_jax/kernels/decode.py and paged.py: one XLA FFI handler, run over XLA's
// intra-op pool (parallel_for.h), one task per (row, kv head).
//
// Why a kernel: XLA's attention against the cache reads every slot of the cache's length
// bucket for every row and masks the ones past the row's length; the engine's rows hold a
// fraction of the bucket (the held-out evaluation's rows: at most 925 positions, mean 703, in
// buckets of 1,024 and 2,048). Here row b reads slots [0, start[b] + T) and nothing else.
//
// The cache is a pool of N pages of P slots in the model's cache layouts
// (rao_jax/model/transformer.py init_cache with N pages as its rows and P as its length), read
// in place: keys [N, K, h, P] (each (page, head) an h x P row-major matrix, so the scores are
// axpys over contiguous runs of P), values [N, K, P, h]; queries [B, T, H, h] with H = K * g
// (query head hd belongs to kv head hd / g). Row b's slot j lives in page pages[b, j / P] at
// offset j % P; query t of row b sees slots j <= start[b] + t. A contiguous cache of rows of S
// slots is the pool with P = S and one page per row (pages [B, 1] = the rows read).
// The arithmetic follows XLA's (rao_jax.kernels.attention.cached_attention)
// so greedy decoding picks the same tokens: q scaled by h^-1/2 and rounded to the cache's
// dtype, scores in float32, softmax as exp(s - max) / sum, probabilities rounded to the cache's
// dtype before the product with the values, accumulated in float32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float Bf16ToF32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as XLA converts float32 to bfloat16 (the kernel never meets NaN).
inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// Element access for the two cache dtypes: float32 as is, bfloat16 widened on load.
struct F32Io {
  using T = float;
  static float Load(const float* p, int64_t i) { return p[i]; }
  static void Store(float* p, int64_t i, float x) { p[i] = x; }
  static float Round(float x) { return x; }
};
struct Bf16Io {
  using T = uint16_t;
  static float Load(const uint16_t* p, int64_t i) { return Bf16ToF32(p[i]); }
  static void Store(uint16_t* p, int64_t i, float x) { p[i] = F32ToBf16(x); }
  static float Round(float x) { return Bf16ToF32(F32ToBf16(x)); }
};

struct Dims {
  int64_t B, T, H, h, N, K, P, W;   // W: pages per row in the page table
};

ffi::Error CheckDims(ffi::AnyBuffer& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
                     ffi::Buffer<ffi::S32>& pages, ffi::Buffer<ffi::S32>& start,
                     ffi::Result<ffi::AnyBuffer>& out, Dims* d) {
  auto dq = q.dimensions(), dk = k.dimensions(), dv = v.dimensions(), dp = pages.dimensions();
  if (dq.size() != 4 || dk.size() != 4 || dv.size() != 4 || dp.size() != 2) {
    return ffi::Error::InvalidArgument("rao_decode_attention: q, k and v must be 4-D, the page "
                                       "table 2-D");
  }
  *d = {dq[0], dq[1], dq[2], dq[3], dk[0], dk[1], dk[3], dp[1]};
  bool ok = d->K > 0 && d->H % d->K == 0 && dk[2] == d->h && dv[0] == d->N && dv[1] == d->K &&
            dv[2] == d->P && dv[3] == d->h && d->P > 0 && d->W > 0;
  ok = ok && dp[0] == d->B && start.element_count() == d->B;
  ok = ok && out->element_count() == q.element_count();
  ok = ok && q.element_type() == k.element_type() && k.element_type() == v.element_type() &&
       out->element_type() == q.element_type();
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "rao_decode_attention: expected q [B, T, H, h], k [N, K, h, P], v [N, K, P, h], "
        "pages [B, W] and start [B] (int32), one dtype, K | H");
  }
  return ffi::Error::Success();
}

thread_local std::vector<float> tls_scores, tls_q, tls_acc;

float* Scratch(std::vector<float>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// Slots row b's task reads: the last query sees start + T - 1; slots past the page table were
// never written (the caller keeps start + T <= W P; a longer row is cut there as XLA's mask
// does).
inline int64_t LiveSlots(const Dims& d, const int32_t* start, int64_t b) {
  return std::min<int64_t>(d.W * d.P, start[b] + d.T);
}

template <typename Io>
ffi::Error Run(ffi::ThreadPool& pool, const Dims& d, const typename Io::T* pq,
               const typename Io::T* pk, const typename Io::T* pv, const int32_t* pages,
               const int32_t* start, typename Io::T* po, float scale) {
  const int64_t B = d.B, T = d.T, H = d.H, h = d.h, N = d.N, K = d.K, P = d.P, W = d.W;
  const int64_t g = H / K;
  // Every page a row reads must be in the pool: checked before any task runs.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = start[b] < 0 ? 1 : LiveSlots(d, start, b);
    for (int64_t w = 0; w * P < n; ++w) {
      const int32_t page = pages[b * W + w];
      if (page < 0 || page >= N || start[b] < 0) {
        return ffi::Error::InvalidArgument(
            "rao_decode_attention: row " + std::to_string(b) + " reads cache page " +
            std::to_string(page) + " (page-table entry " + std::to_string(w) +
            ") from position " + std::to_string(start[b]) + ", outside the cache's " +
            std::to_string(N) + " pages");
      }
    }
  }
  // Task t: (row b, kv head kv). It reads that row's keys and values once for all g * T
  // queries of the head group, and owns the output of those queries.
  rao_jax::ParallelFor(pool, B * K, [=](int64_t t) {
    const int64_t b = t / K, kv = t % K;
    const int32_t* table = pages + b * W;
    const int64_t n = LiveSlots(d, start, b);
    const int64_t m = T * g;   // query rows of the group: (t, head j) at t * g + j
    float* qs = Scratch(tls_q, m * h);
    float* s = Scratch(tls_scores, m * std::max<int64_t>(n, 1));
    for (int64_t qt = 0; qt < T; ++qt) {
      for (int64_t j = 0; j < g; ++j) {
        const int64_t src = ((b * T + qt) * H + kv * g + j) * h;
        for (int64_t c = 0; c < h; ++c) {
          qs[(qt * g + j) * h + c] = Io::Round(Io::Load(pq, src + c) * scale);
        }
      }
    }
    // scores[i, :n] = q_i . k[:, :n], by axpys over each page's contiguous key rows. Page by
    // page (its h x P keys stay in cache), each score still sums over c in order: the same
    // float32 result whatever the page size.
    std::fill(s, s + m * n, 0.0f);
    for (int64_t w = 0; w * P < n; ++w) {
      const int64_t j0 = w * P, len = std::min<int64_t>(P, n - j0);
      const typename Io::T* kb = pk + (static_cast<int64_t>(table[w]) * K + kv) * h * P;
      for (int64_t c = 0; c < h; ++c) {
        const typename Io::T* krow = kb + c * P;
        for (int64_t i = 0; i < m; ++i) {
          const float qc = qs[i * h + c];
          float* si = s + i * n + j0;
          for (int64_t j = 0; j < len; ++j) si[j] += qc * Io::Load(krow, j);
        }
      }
    }
    // Softmax of each query row over the slots it sees, in place; probabilities rounded to
    // the cache's dtype (as XLA casts them before the product with the values), 0 past them.
    for (int64_t i = 0; i < m; ++i) {
      const int64_t last = std::min<int64_t>(n, start[b] + i / g + 1);
      float* si = s + i * n;
      float mx = si[0];
      for (int64_t j = 1; j < last; ++j) mx = std::max(mx, si[j]);
      float sum = 0.0f;
      for (int64_t j = 0; j < last; ++j) {
        si[j] = std::exp(si[j] - mx);
        sum += si[j];
      }
      for (int64_t j = 0; j < last; ++j) si[j] = Io::Round(si[j] / sum);
      std::fill(si + last, si + n, 0.0f);
    }
    // out[i] = sum_j p[i, j] v[j]: slot-major, so each value row is read from memory once for
    // all m query rows of the group, not once per query head.
    float* acc = Scratch(tls_acc, m * h);
    std::fill(acc, acc + m * h, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const typename Io::T* vrow =
          pv + ((static_cast<int64_t>(table[j / P]) * K + kv) * P + j % P) * h;
      for (int64_t i = 0; i < m; ++i) {
        const float p = s[i * n + j];
        float* ai = acc + i * h;
        for (int64_t c = 0; c < h; ++c) ai[c] += p * Io::Load(vrow, c);
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      const int64_t qt = i / g, head = kv * g + i % g;
      typename Io::T* o = po + ((b * T + qt) * H + head) * h;
      for (int64_t c = 0; c < h; ++c) Io::Store(o, c, acc[i * h + c]);
    }
  });
  return ffi::Error::Success();
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::S32> pages,
                           ffi::Buffer<ffi::S32> start, ffi::Result<ffi::AnyBuffer> out,
                           float scale) {
  Dims d;
  if (auto e = CheckDims(q, k, v, pages, start, out, &d); e.failure()) return e;
  const int32_t* pr = pages.typed_data();
  const int32_t* ps = start.typed_data();
  switch (q.element_type()) {
    case ffi::DataType::F32:
      return Run<F32Io>(pool, d, static_cast<const float*>(q.untyped_data()),
                        static_cast<const float*>(k.untyped_data()),
                        static_cast<const float*>(v.untyped_data()), pr, ps,
                        static_cast<float*>(out->untyped_data()), scale);
    case ffi::DataType::BF16:
      return Run<Bf16Io>(pool, d, static_cast<const uint16_t*>(q.untyped_data()),
                         static_cast<const uint16_t*>(k.untyped_data()),
                         static_cast<const uint16_t*>(v.untyped_data()), pr, ps,
                         static_cast<uint16_t*>(out->untyped_data()), scale);
    default:
      return ffi::Error::InvalidArgument("rao_decode_attention: float32 or bfloat16 only");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaoDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q [B, T, H, h]
                                  .Arg<ffi::AnyBuffer>()          // k pages [N, K, h, P]
                                  .Arg<ffi::AnyBuffer>()          // v pages [N, K, P, h]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page table [B, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // start [B]
                                  .Ret<ffi::AnyBuffer>()          // out [B, T, H, h]
                                  .Attr<float>("scale"));
