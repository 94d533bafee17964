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
#include <type_traits>
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

// The register blocks of the score and value loops: a block of kRows query rows by kVecs
// vectors of kLanes floats stays in registers (16 + kVecs of AVX-512's 32 zmm; 8 + 2 of AVX2's
// 16 ymm) while it sums over a head dimension or over slots. GCC's vector extensions, so one
// source builds for either (and for any other -march, where GCC splits the vectors).
#if defined(__AVX512F__)
constexpr int kLanes = 16, kRows = 4, kVecs = 4;
#else
constexpr int kLanes = 8, kRows = 4, kVecs = 2;
#endif
typedef float VecF __attribute__((vector_size(4 * kLanes)));
typedef float VecFu __attribute__((vector_size(4 * kLanes), aligned(1), may_alias));
typedef uint16_t VecHu __attribute__((vector_size(2 * kLanes), aligned(1), may_alias));
typedef uint32_t VecU __attribute__((vector_size(4 * kLanes)));

// Element access for the two cache dtypes: float32 as is, bfloat16 widened on load.
struct F32Io {
  using T = float;
  static float Load(const float* p, int64_t i) { return p[i]; }
  static VecF LoadVec(const float* p) { return *reinterpret_cast<const VecFu*>(p); }
  static void Store(float* p, int64_t i, float x) { p[i] = x; }
  static float Round(float x) { return x; }
};
struct Bf16Io {
  using T = uint16_t;
  static float Load(const uint16_t* p, int64_t i) { return Bf16ToF32(p[i]); }
  static VecF LoadVec(const uint16_t* p) {
    VecU bits = __builtin_convertvector(*reinterpret_cast<const VecHu*>(p), VecU) << 16;
    return reinterpret_cast<VecF&>(bits);
  }
  static void Store(uint16_t* p, int64_t i, float x) { p[i] = F32ToBf16(x); }
  static float Round(float x) { return Bf16ToF32(F32ToBf16(x)); }
};

inline void StoreVec(float* p, VecF x) { *reinterpret_cast<VecFu*>(p) = x; }

// s[(i0 + r) n + x] = sum over c in order of qs[(i0 + r) h + c] kb[c P + x], for r < R and
// x < NV kLanes: R query rows' scores against NV vectors of one page's keys (kb: the page's
// first slot of the block), the keys loaded once for all R rows. Each score is summed in the
// order of the plain loop's (0 + q_0 k_0 + q_1 k_1 + ...), so the result is bit for bit that.
template <typename Io, int R, int NV>
inline void ScoreBlock(const float* qs, int64_t h, const typename Io::T* kb, int64_t P,
                       float* s, int64_t n, int64_t i0) {
  VecF acc[R][NV] = {};
  for (int64_t c = 0; c < h; ++c) {
    VecF k[NV];
    for (int v = 0; v < NV; ++v) k[v] = Io::LoadVec(kb + c * P + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float qc = qs[(i0 + r) * h + c];
      for (int v = 0; v < NV; ++v) acc[r][v] = acc[r][v] + qc * k[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) StoreVec(s + (i0 + r) * n + v * kLanes, acc[r][v]);
  }
}

// acc[(i0 + r) h + c0 + x] = sum over slots j < n in order of s[(i0 + r) n + j] v_j[c0 + x],
// for r < R and x < CV kLanes: R query rows' outputs over CV vectors of the head dimension,
// each value vector loaded once for all R rows, summed in the plain loop's order.
template <typename Io, int R, int CV>
inline void ValueBlock(const float* s, int64_t n, int64_t i0, const typename Io::T* pv,
                       const int32_t* table, int64_t P, int64_t K, int64_t kv, int64_t h,
                       int64_t c0, float* out) {
  VecF acc[R][CV] = {};
  for (int64_t j0 = 0; j0 < n; j0 += P) {
    const typename Io::T* page = pv + (static_cast<int64_t>(table[j0 / P]) * K + kv) * P * h;
    const int64_t len = std::min<int64_t>(P, n - j0);
    for (int64_t j = 0; j < len; ++j) {
      VecF v[CV];
      for (int x = 0; x < CV; ++x) v[x] = Io::LoadVec(page + j * h + c0 + x * kLanes);
      for (int r = 0; r < R; ++r) {
        const float p = s[(i0 + r) * n + j0 + j];
        for (int x = 0; x < CV; ++x) acc[r][x] = acc[r][x] + p * v[x];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int x = 0; x < CV; ++x) StoreVec(out + (i0 + r) * h + c0 + x * kLanes, acc[r][x]);
  }
}

// Calls f(integral_constant R, integral_constant V) for the block shape known at run time,
// rows in 1..kRows and vectors in 1..kVecs: the blocks' sizes must be compile-time constants
// for their accumulators to stay in registers.
template <int R = 1, int V = 1, typename F>
inline void WithBlock(int rows, int vecs, F&& f) {
  if constexpr (R < kRows) {
    if (rows > R) return WithBlock<R + 1, V>(rows, vecs, f);
  }
  if constexpr (V < kVecs) {
    if (vecs > V) return WithBlock<R, V + 1>(rows, vecs, f);
  }
  f(std::integral_constant<int, R>{}, std::integral_constant<int, V>{});
}

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
    // Whole vectors of slots go through the register blocks (ScoreBlock), the last few slots
    // of a page through the plain loop; both sum in the same order.
    for (int64_t w = 0; w * P < n; ++w) {
      const int64_t j0 = w * P, len = std::min<int64_t>(P, n - j0);
      const typename Io::T* kb = pk + (static_cast<int64_t>(table[w]) * K + kv) * h * P;
      const int64_t whole = len / kLanes * kLanes;
      for (int64_t jb = 0; jb < whole; jb += kVecs * kLanes) {
        const int nv = static_cast<int>(std::min<int64_t>(kVecs, (whole - jb) / kLanes));
        for (int64_t i0 = 0; i0 < m; i0 += kRows) {
          WithBlock(static_cast<int>(std::min<int64_t>(kRows, m - i0)), nv, [&](auto R, auto V) {
            ScoreBlock<Io, decltype(R)::value, decltype(V)::value>(qs, h, kb + jb, P,
                                                                   s + j0 + jb, n, i0);
          });
        }
      }
      if (whole == len) continue;
      for (int64_t i = 0; i < m; ++i) std::fill(s + i * n + j0 + whole, s + i * n + j0 + len,
                                                0.0f);
      for (int64_t c = 0; c < h; ++c) {
        const typename Io::T* krow = kb + c * P;
        for (int64_t i = 0; i < m; ++i) {
          const float qc = qs[i * h + c];
          float* si = s + i * n + j0;
          for (int64_t j = whole; j < len; ++j) si[j] += qc * Io::Load(krow, j);
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
    if (h % kLanes == 0) {
      for (int64_t c0 = 0; c0 < h; c0 += kVecs * kLanes) {
        const int cv = static_cast<int>(std::min<int64_t>(kVecs, (h - c0) / kLanes));
        for (int64_t i0 = 0; i0 < m; i0 += kRows) {
          WithBlock(static_cast<int>(std::min<int64_t>(kRows, m - i0)), cv, [&](auto R, auto V) {
            ValueBlock<Io, decltype(R)::value, decltype(V)::value>(s, n, i0, pv, table, P, K, kv,
                                                                   h, c0, acc);
          });
        }
      }
    } else {   // a head dimension of no whole vectors: the plain loop, in the same order
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
