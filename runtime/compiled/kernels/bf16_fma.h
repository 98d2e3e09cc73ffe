// bf16 dot products without AVX512-BF16, for small_linear.cpp (either form): the same products as
// bf16_dot.h's VDPBF16PS from fp32 FMAs. w is packed as the same bf16 pairs [N/kLanes][K/2][kLanes][2];
// each pair vector's halves are widened to fp32 in registers (a bf16's bits are the high half of an
// fp32's) and x arrives as its bf16 values widened to fp32. Per pair the odd element's product is
// added first, then the even's, pairs in k order: the order VDPBF16PS defines. A product of two bf16
// is exact in fp32, so each FMA rounds once where VDPBF16PS rounds once: the sums are the hardware's
// bit for bit (subnormals aside, which VDPBF16PS flushes to zero). Two FMAs per pair where VDPBF16PS
// takes one instruction, but half the weight bytes of fp32 products, and a row's result again does
// not depend on the call's row count.
// Included inside small_linear.cpp's anonymous namespace, after the Vec helpers.

#ifdef __AVX512F__
using VecI = __m512i;
inline VecI vload_words(const uint32_t* p) { return _mm512_loadu_si512(p); }
inline Vec even_half(VecI w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline Vec odd_half(VecI w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536))); }
// Column blocks per tile for 1..6 rows: M*C sums + 2C weight halves + 2 broadcasts within 32 registers.
constexpr int kFmaWidth[7] = {0, 8, 6, 4, 4, 3, 3};
#else
using VecI = __m256i;
inline VecI vload_words(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vec even_half(VecI w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline Vec odd_half(VecI w) { return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536))); }
// within 16 registers (the 6-row tile's width divides the chunks' 12 blocks)
constexpr int kFmaWidth[7] = {0, 4, 3, 2, 2, 2, 1};
#endif

// The first n (<= kLanes) fp32 sums stored as fp32 (fp32 x: --matmul_precision medium), or rounded to
// bf16 (bf16 x), to nearest, ties to even.
inline void store_sums(float* y, int64_t n, Vec v) { n >= kLanes ? vstore(y, v) : vstore_first(y, n, v); }
inline void store_sums(uint16_t* y, int64_t n, Vec v) {
  alignas(64) float sums[kLanes];
  vstore(sums, v);
  for (int64_t i = 0; i < std::min<int64_t>(n, kLanes); ++i) y[i] = c10::BFloat16(sums[i]).x;
}

// x rows [M][2*K2] (bf16 values as fp32, an odd K's last pair padded with zero) times C packed pair
// blocks, fp32 sums stored as Y.
template <int M, int C, typename Y>
__attribute__((noinline)) void tile_fma(const float* x, int64_t K2, const uint32_t* p, int64_t b0, int64_t N, Y* y) {
  Vec acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = vzero();
  const uint32_t* pb[C];
  for (int c = 0; c < C; ++c) pb[c] = p + (b0 + c) * K2 * kLanes;
  for (int64_t k = 0; k < K2; ++k) {
    Vec even[C], odd[C];
    for (int c = 0; c < C; ++c) {
      const VecI words = vload_words(pb[c] + k * kLanes);
      even[c] = even_half(words);
      odd[c] = odd_half(words);
    }
    for (int m = 0; m < M; ++m) {
      const Vec xo = vset1(x[m * 2 * K2 + 2 * k + 1]);
      for (int c = 0; c < C; ++c) acc[m][c] = vfma(odd[c], xo, acc[m][c]);
      const Vec xe = vset1(x[m * 2 * K2 + 2 * k]);
      for (int c = 0; c < C; ++c) acc[m][c] = vfma(even[c], xe, acc[m][c]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) {
      const int64_t n = (b0 + c) * kLanes;
      store_sums(y + m * N + n, N - n, acc[m][c]);
    }
}

template <int M, int C, typename Y>
inline void tiles_fma(const float* x, int64_t K2, const uint32_t* p, int64_t b0, int64_t b1, int64_t N, Y* y) {
  over_tiles<C>(b0, b1, [&](auto width, int64_t b) { tile_fma<M, decltype(width)::value, Y>(x, K2, p, b, N, y); });
}

template <typename Y>
void packed_rows_fma(const float* x, int64_t M, int64_t K2, const uint32_t* p, int64_t b0, int64_t b1, int64_t N,
                     Y* y) {
  in_row_passes(M, [&](auto rows, int64_t m0) {
    constexpr int R = decltype(rows)::value;
    tiles_fma<R, kFmaWidth[R], Y>(x + m0 * 2 * K2, K2, p, b0, b1, N, y + m0 * N);
  });
}

// x [M, K] (fp32 rounded to bf16, to nearest, ties to even; or bf16) as the fp32 values tile_fma reads:
// rows of 2*K2, an odd K's last pair padded with zero.
template <typename T>
void widened_rows(const T* x, int64_t M, int64_t K, float* out) {
  const int64_t width = (K + 1) / 2 * 2;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) out[m * width + k] = static_cast<float>(c10::BFloat16(x[m * K + k]));
    if (width > K) out[m * width + K] = 0.0f;
  }
}
