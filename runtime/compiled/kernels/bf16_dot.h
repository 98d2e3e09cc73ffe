// bf16 dot products (AVX512-BF16 VDPBF16PS) for small_linear.cpp: x rows as bf16 pairs times w packed
// as bf16 pairs [N/16][K/2][16][2], 32 multiply-adds per instruction, each exact product added in
// fp32 in a fixed order. Included inside small_linear.cpp's anonymous namespace, after kLanes.
// 16 fp32 sums stored as fp32 (fp32 x: --matmul_precision medium) or rounded to bf16 (bf16 x).
inline void store16(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void store16(uint16_t* y, __mmask16 mask, __m512 v) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// bf16 x rows (as pairs: one uint32 holds x[2j] and x[2j+1]) times C packed pair blocks, fp32 sums
// stored as Y.
template <int M, int C, typename Y>
__attribute__((noinline, target("avx512f,avx512bw,avx512vl,avx512bf16")))
void tile_dot(const uint32_t* x, int64_t K2, const uint32_t* p, int64_t b0, int64_t N, Y* y) {
  __m512 acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  const uint32_t* pb[C];
  for (int c = 0; c < C; ++c) pb[c] = p + (b0 + c) * K2 * kLanes;
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(pb[c] + k * kLanes);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * K2 + k]));
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], wv[c], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) {
      const int64_t n = (b0 + c) * kLanes;
      const __mmask16 mask = n + kLanes <= N ? static_cast<__mmask16>(0xFFFF)
                                             : static_cast<__mmask16>((1u << (N - n)) - 1);
      store16(y + m * N + n, mask, acc[m][c]);
    }
}

template <int M, int C, typename Y>
inline void tiles_dot(const uint32_t* x, int64_t K2, const uint32_t* p, int64_t b0, int64_t b1, int64_t N, Y* y) {
  over_tiles<C>(b0, b1, [&](auto width, int64_t b) { tile_dot<M, decltype(width)::value, Y>(x, K2, p, b, N, y); });
}

// Column blocks per tile for 1..kDotPassRows rows (27 sums at most, with the weight vectors and a
// broadcast in 32 registers): up to 9 rows per pass over w, as small_linear.cpp's fp32 tiles.
constexpr int kDotPassRows = 9;
constexpr int kDotWidth[10] = {0, 8, 6, 6, 4, 4, 3, 3, 3, 3};

template <typename Y>
void packed_rows_dot(const uint32_t* x, int64_t M, int64_t K2, const uint32_t* p, int64_t b0, int64_t b1, int64_t N,
                     Y* y) {
  in_row_passes<kDotPassRows>(M, [&](auto rows, int64_t m0) {
    constexpr int R = decltype(rows)::value;
    tiles_dot<R, kDotWidth[R], Y>(x + m0 * K2, K2, p, b0, b1, N, y + m0 * N);
  });
}

// fp32 rows x [M, K] rounded to bf16 (to nearest, ties to even) as pairs [M][ceil(K/2)], an odd K's
// last pair padded with zero.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void to_pairs(const float* x, int64_t M, int64_t K, uint32_t* out) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    auto* dst = reinterpret_cast<uint16_t*>(out + m * K2);
    for (int64_t k = 0; k < 2 * K2; k += 32) {
      const int64_t lo = std::min<int64_t>(16, K - k), hi = std::min<int64_t>(16, K - k - 16);
      const __m512 a = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << std::max<int64_t>(lo, 0)) - 1), row + k);
      const __m512 b = hi > 0 ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1ull << hi) - 1), row + k + 16)
                              : _mm512_setzero_ps();
      const int64_t words = std::min<int64_t>(32, 2 * K2 - k);
      _mm512_mask_storeu_epi16(dst + k, static_cast<__mmask32>((1ull << words) - 1),
                               (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

// Whether the dot products run here: the CPU has AVX512-BF16 and NEMOSPEC_BF16_DOT is not 0 (the switch
// lets a CPU that has them run, and test, what one without them runs).
bool has_bf16_dot() {
  static const bool on = [] {
    const char* env = std::getenv("NEMOSPEC_BF16_DOT");
    return __builtin_cpu_supports("avx512bf16") && !(env != nullptr && std::strcmp(env, "0") == 0);
  }();
  return on;
}
