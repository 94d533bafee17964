// C[M, N] = op(A) op(B) in float32, row-major, with MKL's sgemm: an XLA FFI handler for
// rao_jax/model/matmul.py. Why MKL: on an Intel Xeon its sgemm ran most of the model's products
// up to 30% faster than XLA:CPU's own dot kernels (benchmarks/bench_cpu_kernels.py; on AMD it
// ran at half XLA's speed, so cpu_kernels.py uses it on Intel CPUs only).
//
// C is cut into chunks run by parallel_for.h over XLA's intra-op pool, each a single-threaded
// sgemm (linked against mkl_sequential).
#include <algorithm>
#include <cstdint>

#include "mkl_cblas.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMinChunk = 64;  // below this, MKL's per-call overhead dominates

ffi::Error Gemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b) {
  auto da = a.dimensions(), db = b.dimensions(), dc = c->dimensions();
  if (da.size() != 2 || db.size() != 2 || dc.size() != 2) {
    return ffi::Error::InvalidArgument("rao_mkl_gemm: operands and result must be 2-D");
  }
  int64_t m = trans_a ? da[1] : da[0], k = trans_a ? da[0] : da[1];
  int64_t kb = trans_b ? db[1] : db[0], n = trans_b ? db[0] : db[1];
  if (k != kb || dc[0] != m || dc[1] != n) {
    return ffi::Error::InvalidArgument("rao_mkl_gemm: shapes do not match");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  const float* pa = a.typed_data();
  const float* pb = b.typed_data();
  float* pc = c->typed_data();
  // One chunk per thread, cut along the longer side of C. Each chunk's sgemm packs the whole
  // other operand again, so more, smaller chunks cost more than they balance: with up to eight
  // row chunks (the 576 rows of a [576, 1536] weight gradient in 72-row pieces, each repacking
  // a 2048 x 1536 operand) the 4 x 512 SmolLM2 step took 4.5% longer (in-process A/B).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const bool by_rows = m >= n;
  const int64_t side = by_rows ? m : n;
  const int64_t chunks = std::clamp<int64_t>(side / kMinChunk, 1, threads);
  const int64_t per = (side + chunks - 1) / chunks;
  rao_jax::ParallelFor(pool, (side + per - 1) / per, [=](int64_t i) {
    const int64_t s0 = i * per, len = std::min(side, s0 + per) - s0;
    // Rows s0.. of op(A): A is [m, k] (lda k), or [k, m] (lda m) when transposed; columns s0..
    // of op(B): B is [k, n] (ldb n), or [n, k] (ldb k).
    const float* a0 = !by_rows ? pa : trans_a ? pa + s0 : pa + s0 * k;
    const float* b0 = by_rows ? pb : trans_b ? pb + s0 * k : pb + s0;
    float* c0 = by_rows ? pc + s0 * n : pc + s0;
    cblas_sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans,
                static_cast<int>(by_rows ? len : m), static_cast<int>(by_rows ? n : len),
                static_cast<int>(k), 1.0f, a0, static_cast<int>(trans_a ? m : k), b0,
                static_cast<int>(trans_b ? k : n), 0.0f, c0, static_cast<int>(n));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaoMklGemm, Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));
