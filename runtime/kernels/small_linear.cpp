// y = x @ w^T for the few rows of a decode or verify step (fp32, w row-major as nn.Linear stores it).
//
// MKL's sgemm on the CPUs we measure costs M times its one-row cost for M = 2..8 rows (a 838x192
// product: 11 us at M=1, 42 us at M=5), so a verify of K+1 tokens paid K+1 decodes in its products.
// Here each 4-row block of w is read once for every group of up to 4 input rows: 16 accumulators,
// one FMA per weight per row, the weights streamed once per group. Rows are split across threads
// in blocks of w rows (at::parallel_for), so a product stays on one thread until it is large.
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int kRows = 4;  // w rows per block

// The sums of four vectors' lanes, as [sum a, sum b, sum c, sum d]: 13 instructions for four
// results, where a reduce per vector takes about 8 for one (a quarter of the work at K = 192).
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128-bit lane: a b a b
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));  // c d c d
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

template <int G>
inline void block(const float* x, int64_t K, const float* w, int64_t n0, int64_t rows,
                  float* y, int64_t N, int64_t m0) {
  __m512 acc[kRows][G];
  for (int r = 0; r < kRows; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const float* wr[kRows];
  for (int r = 0; r < kRows; ++r) wr[r] = w + (n0 + (r < rows ? r : 0)) * K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = _mm512_loadu_ps(wr[r] + k);
    for (int g = 0; g < G; ++g) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + g) * K + k);
      for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_fmadd_ps(wv[r], xv, acc[r][g]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, wr[r] + k);
    for (int g = 0; g < G; ++g) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (m0 + g) * K + k);
      for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_fmadd_ps(wv[r], xv, acc[r][g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m128 sums = reduce4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]);
    float* out = y + (m0 + g) * N + n0;
    if (rows == kRows) {
      _mm_storeu_ps(out, sums);
    } else {
      alignas(16) float tail[kRows];
      _mm_store_ps(tail, sums);
      for (int r = 0; r < rows; ++r) out[r] = tail[r];
    }
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 2,
              "nemospec::small_linear: expected fp32 x [..., K] and fp32 w [N, K]");
  TORCH_CHECK(x.size(-1) == w.size(1), "nemospec::small_linear: x has ", x.size(-1), " features, w expects ",
              w.size(1));
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t K = wc.size(1), N = wc.size(0), M = K ? xc.numel() / K : 0;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const float* xp = xc.const_data_ptr<float>();
  const float* wp = wc.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  // >= ~1M multiply-adds per task: a decode or verify product of the embedded model stays on one
  // thread (a fork and join cost more than it saves there); a full-width one is split
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, K * std::max<int64_t>(M, 1) * kRows));
  at::parallel_for(0, (N + kRows - 1) / kRows, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRows, rows = std::min<int64_t>(kRows, N - n0);
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) block<4>(xp, K, wp, n0, rows, yp, N, m0);
      switch (M - m0) {
        case 3: block<3>(xp, K, wp, n0, rows, yp, N, m0); break;
        case 2: block<2>(xp, K, wp, n0, rows, yp, N, m0); break;
        case 1: block<1>(xp, K, wp, n0, rows, yp, N, m0); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace

// The C entry point a compiled graph's C++ wrapper calls directly (inductor's custom_ops_to_c_shims),
// instead of a boxed call through the dispatcher (~4 us a call, a kernel's worth at one row).
extern "C" AOTITorchError aoti_torch_cpu_small_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(
        small_linear(*torch::aot_inductor::tensor_handle_to_tensor_pointer(x),
                     *torch::aot_inductor::tensor_handle_to_tensor_pointer(w)));
  });
}

TORCH_LIBRARY(nemospec, m) { m.def("small_linear(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(nemospec, CPU, m) { m.impl("small_linear", &small_linear); }
