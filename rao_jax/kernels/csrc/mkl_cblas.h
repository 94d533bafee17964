// The one MKL entry point the handlers here use (CBLAS row-major sgemm), declared by hand: the
// mkl wheel ships libraries without headers.
#ifndef RAO_JAX_MKL_CBLAS_H_
#define RAO_JAX_MKL_CBLAS_H_

extern "C" void cblas_sgemm(int layout, int trans_a, int trans_b, int m, int n, int k,
                            float alpha, const float* a, int lda, const float* b, int ldb,
                            float beta, float* c, int ldc);

namespace {
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
}  // namespace

#endif  // RAO_JAX_MKL_CBLAS_H_
