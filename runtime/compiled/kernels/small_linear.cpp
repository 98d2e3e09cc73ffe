// y = x @ w^T for the few rows of a decode or verify step (fp32, w row-major as nn.Linear stores it).
//
// MKL's sgemm on the CPUs we measure costs M times its one-row cost for M = 2..8 rows (a 838x192
// product: 11 us at M=1, 42 us at M=5), so a verify of K+1 tokens paid K+1 decodes in its products.
//
// Two layouts of w:
// * packed (a weight seen before): w copied once into [N/16][K][16] (AVX-512; [N/8][K][8] in the AVX2
//   form), so 16 (8) outputs are one vector.
//   For each k, a tile loads C weight vectors and multiplies them by x[m][k] broadcast, for all M
//   rows at once: every weight is read once per call, no horizontal sums, M*C independent sums.
//   The copies live in a cache keyed by the weight's storage (held weakly: a dead storage's entry
//   is dropped, and its address cannot be reused while the entry holds it), offset, shape and
//   strides; a weight changed in place (its version counter moved) is packed again.
// * row-major (a weight seen for the first time, or an inference tensor, whose version cannot be
//   read): each 4-row block of w is read once per group of up to 4 input rows (3 in the AVX2 form),
//   16 (12) accumulators, four sums reduced in one shuffle tree.
// A weight is packed at its second use, so a weight computed afresh every call is never packed.
// small_linear_bf16w multiplies by w rounded to bf16 (a compiled draft's weights): a bf16 packed copy
// made at the first use, widened to fp32 in registers.
// A weight whose every value is already a bf16 number (a bf16 checkpoint run in fp32, as the embedded
// drafts are) is packed as bf16 by small_linear too: the same values and the same sums in the same
// order, so the same products, from half the bytes.
// Two forms, one source built twice (runtime/small_linear.py picks one per process from the CPU's
// flags): AVX-512 (16 lanes, the layout [N/16][K][16]) and AVX2 + FMA (8 lanes, [N/8][K][8], tiles
// sized for 16 registers); each output's sum runs over k in the same order in every tile, so in
// either form a row's result does not depend on the call's row count.
// bf16 x and w (a bf16 model on the compiled path): w packed once, at its first use, as bf16 pairs
// [N/kLanes][K/2][kLanes][2], and each pair of x broadcast into VDPBF16PS (AVX512-BF16, bf16_dot.h):
// 32 multiply-adds per instruction where an fp32 FMA does 16, each exact product added in fp32 in a
// fixed order (odd, then even element of a pair, pairs in k order), so a row's result does not depend
// on how many rows the call has (a verify's rows equal a decode's); the fp32 sums are rounded to bf16
// at the end, as torch's bf16 linear does. Without AVX512-BF16 (the AVX2 form, or an AVX-512 CPU
// without it) the same sums come from fp32 FMAs over the pairs widened in registers (bf16_fma.h).
// small_linear_bf16 (--matmul_precision medium, torch's name for fp32 products computed from bf16
// inputs) rounds fp32 x and w to bf16 and runs the same dot products, the fp32 sums kept as the
// result: each row's result again independent of the call's row count.
// Work is split across threads in blocks of w rows (at::parallel_for), so a product stays on one
// thread until it is large.
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>
#include <immintrin.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unistd.h>
#include <vector>

namespace {

// The vector the kernels are written in, chosen at compile time: this file is built once per form
// (runtime/small_linear.py), AVX-512 (16 fp32 lanes, 32 registers) or AVX2 + FMA (8 lanes, 16).
// vload_first/vstore_first touch the first n < kLanes lanes only (the rest read as zero).
#ifdef __AVX512F__
using Vec = __m512;
constexpr int kLanes = 16;  // outputs per vector in the packed layout
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
inline Vec vload_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void vstore_first(float* p, int64_t n, Vec v) { _mm512_mask_storeu_ps(p, first(n), v); }
// kLanes bf16 numbers widened to fp32 (a bf16's bits are the high half of an fp32's).
inline Vec vload(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// The sums of four vectors' lanes, as [sum a, sum b, sum c, sum d]: 13 instructions for four
// results, where a reduce per vector takes about 8 for one (a quarter of the work at K = 192).
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128-bit lane: a b a b
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));  // c d c d
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#else
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i first(int64_t n) {  // lanes < n all ones
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec vload_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void vstore_first(float* p, int64_t n, Vec v) { _mm256_maskstore_ps(p, first(n), v); }
inline Vec vload(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m128 vsum4(Vec a, Vec b, Vec c, Vec d) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));  // per 128-bit lane: a b a b
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));  // c d c d
  const __m256 abcd = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));  // a b c d
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

constexpr int kRows = 4;  // w rows per block
// Input rows per row-major block: G*kRows sums + kRows weight vectors fit the registers (16 ymm: 3).
constexpr int kGroup = kLanes == 16 ? 4 : 3;

// The kernels (block, tile) are not inlined: inlined into the parallel_for lambda, GCC 12 kept
// their accumulator arrays in memory, a store after every FMA (5-row products ran 2.7x slower).

template <int G>
__attribute__((noinline)) void block(const float* x, int64_t K, const float* w, int64_t n0, int64_t rows,
                  float* y, int64_t N, int64_t m0) {
  Vec acc[kRows][G];
  for (int r = 0; r < kRows; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = vzero();
  const float* wr[kRows];
  for (int r = 0; r < kRows; ++r) wr[r] = w + (n0 + (r < rows ? r : 0)) * K;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = vload(wr[r] + k);
    for (int g = 0; g < G; ++g) {
      const Vec xv = vload(x + (m0 + g) * K + k);
      for (int r = 0; r < kRows; ++r) acc[r][g] = vfma(wv[r], xv, acc[r][g]);
    }
  }
  if (k < K) {
    Vec wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = vload_first(wr[r] + k, K - k);
    for (int g = 0; g < G; ++g) {
      const Vec xv = vload_first(x + (m0 + g) * K + k, K - k);
      for (int r = 0; r < kRows; ++r) acc[r][g] = vfma(wv[r], xv, acc[r][g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m128 sums = vsum4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]);
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


// Tile of C packed column blocks (kLanes outputs each) for M rows of x: M*C accumulators. W: float,
// or uint16_t for bf16 weights (widened in registers).
template <int M, int C, typename W>
__attribute__((noinline)) void tile(const float* x, int64_t K, const W* p, int64_t b0, int64_t N, float* y) {
  Vec acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = vzero();
  const W* pb[C];
  for (int c = 0; c < C; ++c) pb[c] = p + (b0 + c) * K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = vload(pb[c] + k * kLanes);
    for (int m = 0; m < M; ++m) {
      const Vec xv = vset1(x[m * K + k]);
      for (int c = 0; c < C; ++c) acc[m][c] = vfma(wv[c], xv, acc[m][c]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) {
      const int64_t n = (b0 + c) * kLanes;
      if (n + kLanes <= N) vstore(y + m * N + n, acc[m][c]);
      else vstore_first(y + m * N + n, N - n, acc[m][c]);
    }
}

// Column blocks [b0, b1) as tiles of C blocks, then the rest in one narrower tile per halving:
// run(std::integral_constant<int, width>, first block) for each.
template <int C, typename Run>
inline void over_tiles(int64_t b0, int64_t b1, const Run& run) {
  int64_t b = b0;
  for (; b + C <= b1; b += C) run(std::integral_constant<int, C>{}, b);
  if constexpr (C > 1) {
    constexpr int half = (C + 1) / 2;
    if (b1 - b >= half) {
      run(std::integral_constant<int, half>{}, b);
      b += half;
    }
    over_tiles<C / 2>(b, b1, run);
  }
}

// run(std::integral_constant<int, rows>, first row) for rows = R..MaxRows, chosen at run time.
template <int R, int MaxRows, typename Run>
inline void run_rows(int64_t rows, int64_t m0, const Run& run) {
  if constexpr (R < MaxRows) {
    if (rows != R) return run_rows<R + 1, MaxRows>(rows, m0, run);
  }
  run(std::integral_constant<int, R>{}, m0);
}

// M rows in passes of up to MaxRows (each pass reads w once): run(std::integral_constant<int, rows>,
// first row) for each.
template <int MaxRows = 6, typename Run>
inline void in_row_passes(int64_t M, const Run& run) {
  for (int64_t m0 = 0; m0 < M; m0 += MaxRows) run_rows<1, MaxRows>(std::min<int64_t>(M - m0, MaxRows), m0, run);
}

// Column blocks [b0, b1) for M rows, C blocks per tile, the rest in one narrower tile: a lone block
// has one chain of dependent FMAs per row (latency-bound, 1/4 to 1/8 of the FMA rate at one row),
// and 192-wide products (12 blocks: 8 + 4 at one row) are the embedded model's commonest.
template <int M, int C, typename W>
inline void tiles(const float* x, int64_t K, const W* p, int64_t b0, int64_t b1, int64_t N, float* y) {
  over_tiles<C>(b0, b1, [&](auto width, int64_t b) { tile<M, decltype(width)::value, W>(x, K, p, b, N, y); });
}

#ifdef __AVX512F__
#include "bf16_dot.h"
#else
bool has_bf16_dot() { return false; }  // VDPBF16PS is AVX-512: the AVX2 form emulates it (bf16_fma.h)
#endif
#include "bf16_fma.h"

// Column blocks per tile for 1..kPassRows rows. AVX-512: at most 27 sums (9 rows x 3 blocks), the 3
// weight vectors and a broadcast in 32 registers, so up to 9 rows per pass over w: a K = 8 verify's 9
// rows read w once. In passes of 6 + 3 (and of 8 + 1, whose 1-row pass reads all of w again from
// cache) the 4x-widened layer's 9-row products cost 1.24-1.36x one row at two threads, in one pass
// 1.15x (Zen 4). AVX2: M*C sums + the M broadcasts (or C weights) + 1 within 16 registers, up to 6
// rows.
// kStreamWidth: the AVX-512 form's tiles of 2-9 rows (one pass over w) where w streams from memory
// on an Intel CPU (tile_streaming): two column blocks. A Xeon with 480 MiB of L3 (2 threads,
// 8x-widened layer products, 700 MiB cycled, the two interleaved) ran 5 rows in 25.4 ms with the wide
// tiles against 23.8 ms (1 row: 22.3), 2 rows 24.3 against 22.2, 9 rows 27.9 against 25.9; with the
// same products in its cache the wide tiles are the faster (5 rows 2.2 against 2.6 ms), so do the
// later passes of more rows (read from cache, in_chunks), and a Zen 4 was not measured: the wide
// tiles stay the default. The width does not change any sum: each output's runs over k in order.
#ifdef __AVX512F__
constexpr int kPassRows = 9;
constexpr int kWidth[10] = {0, 8, 6, 6, 4, 4, 3, 3, 3, 3};
constexpr int kStreamWidth[10] = {0, 8, 2, 2, 2, 2, 2, 2, 2, 2};
constexpr bool kStreamTiles = true;
#else
constexpr int kPassRows = 6;
constexpr int kWidth[7] = {0, 8, 6, 4, 3, 2, 2};
constexpr int kStreamWidth[7] = {0, 8, 6, 4, 3, 2, 2};
constexpr bool kStreamTiles = false;   // the same tiles: nothing to choose
#endif
// 0: streaming tiles where the CPU is Intel's and the packed weights exceed its L3 (set as they are
// packed); 1: never; 2: always (tests and benchmarks compare the two)
std::atomic<int> tile_choice{0};
std::atomic<bool> weights_stream{false};

bool tile_streaming() {
  const int choice = tile_choice.load(std::memory_order_relaxed);
  return kStreamTiles && (choice == 2 || (choice == 0 && weights_stream.load(std::memory_order_relaxed)));
}

// Whether packed weights of ``bytes`` stream from memory on an Intel CPU: more than its L3.
bool streams_from_memory(int64_t bytes) {
  static const bool intel = __builtin_cpu_is("intel");
  static const int64_t l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return intel && l3 > 0 && bytes > l3;
}

// Up to kPassRows rows per pass over w.
template <typename W>
void packed_rows(const float* x, int64_t M, int64_t K, const W* p, int64_t b0, int64_t b1, int64_t N, float* y) {
  const bool streaming = M <= kPassRows && tile_streaming();   // one pass: w from memory
  in_row_passes<kPassRows>(M, [&](auto rows, int64_t m0) {
    constexpr int R = decltype(rows)::value;
    if (kStreamWidth[R] != kWidth[R] && streaming) tiles<R, kStreamWidth[R], W>(x + m0 * K, K, p, b0, b1, N, y + m0 * N);
    else tiles<R, kWidth[R], W>(x + m0 * K, K, p, b0, b1, N, y + m0 * N);
  });
}

// More rows than a pass holds take several passes over w: each pass runs over a chunk of column blocks
// of about kChunkBytes (a multiple of 12 blocks, which the 6- and 8-row tiles' widths divide) before the next chunk,
// so the later passes read w from cache instead of streaming it from memory again (9-row products of
// full-width bf16 weights, 1 thread: 21504x4096 21.8 -> 14.0 ms, 4096x21504 17.2 -> 10.3 ms). Each
// output's sum is the same either way.
constexpr int64_t kChunkBytes = 512 << 10;

template <typename F>
void in_chunks(int64_t M, int64_t pass_rows, int64_t block_bytes, int64_t b0, int64_t b1, F&& rows) {
  if (M <= pass_rows) return rows(b0, b1);
  const int64_t chunk = std::max<int64_t>(12, kChunkBytes / std::max<int64_t>(1, block_bytes) / 12 * 12);
  for (int64_t b = b0; b < b1; b += chunk) rows(b, std::min(b + chunk, b1));
}

// Whether every value of w is a bf16 number (the low 16 bits of each fp32 zero): then its bf16 copy
// holds exactly the values of w.
bool bf16_exact(const at::Tensor& w) {
  const auto* src = reinterpret_cast<const uint32_t*>(w.const_data_ptr<float>());
  const int64_t N = w.size(0), K = w.size(1), s0 = w.stride(0), s1 = w.stride(1);
  uint32_t low = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) low |= src[n * s0 + k * s1] & 0xFFFFu;
  return low == 0;
}

enum class Layout : int { kFloat = 0, kBf16 = 1, kBf16Pairs = 2 };

// w [N, K] as bf16 pairs [N/16][ceil(K/2)][16][2] (an odd K's last pair padded with zero): a bf16 w
// copied, an fp32 w rounded to nearest, ties to even.
at::Tensor pack_pairs(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), K2 = (K + 1) / 2, blocks = (N + kLanes - 1) / kLanes;
  at::Tensor out = at::zeros({blocks, K2, kLanes, 2}, w.options().dtype(at::kBFloat16));
  auto* dst = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t s0 = w.stride(0), s1 = w.stride(1);
  auto fill = [&](const auto* src) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[(((n / kLanes) * K2 + k / 2) * kLanes + n % kLanes) * 2 + k % 2] = c10::BFloat16(src[n * s0 + k * s1]);
  };
  if (w.scalar_type() == at::kBFloat16) fill(w.const_data_ptr<c10::BFloat16>());
  else fill(w.const_data_ptr<float>());
  return out;
}

// w [N, K] as [N/kLanes][K][kLanes], in fp32 or rounded to bf16 (to nearest, ties to even).
at::Tensor pack(const at::Tensor& w, bool bf16) {
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + kLanes - 1) / kLanes;
  at::Tensor out = at::zeros({blocks, K, kLanes}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* src = w.const_data_ptr<float>();
  const int64_t s0 = w.stride(0), s1 = w.stride(1);
  auto at_packed = [&](int64_t n, int64_t k) { return ((n / kLanes) * K + k) * kLanes + n % kLanes; };
  if (bf16) {
    auto* dst = reinterpret_cast<c10::BFloat16*>(out.mutable_data_ptr());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) dst[at_packed(n, k)] = c10::BFloat16(src[n * s0 + k * s1]);
  } else {
    float* dst = out.mutable_data_ptr<float>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) dst[at_packed(n, k)] = src[n * s0 + k * s1];
  }
  return out;
}

struct PackKey {
  const c10::StorageImpl* storage;
  int64_t offset, n, k, s0, s1;
  Layout layout;
  bool operator==(const PackKey& o) const {
    return storage == o.storage && offset == o.offset && n == o.n && k == o.k && s0 == o.s0 && s1 == o.s1 &&
           layout == o.layout;
  }
};
struct PackKeyHash {
  size_t operator()(const PackKey& key) const {
    size_t h = std::hash<const void*>()(key.storage) ^ static_cast<size_t>(key.layout);
    for (int64_t v : {key.offset, key.n, key.k, key.s0, key.s1}) h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};
struct PackEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  uint32_t version;
  at::Tensor packed;  // undefined until the weight's second use
};

std::mutex cache_mutex;
std::atomic<bool> packing{true};  // off: every fp32-weight product row-major (benchmarks/small_linear.py's A/B)
// Packed copies double the memory of the weights they copy: past this many bytes of copies, a weight
// stays row-major (a full-size fp32 model on the compiled path keeps its footprint bounded).
std::atomic<int64_t> budget{int64_t{4} << 30};
// A thread's share of a packed product: at least ~1M multiply-adds, or at least this many bytes of
// weights where that comes first. One row of a wide model's 1024x768 product is 0.8M multiply-adds but
// 3 MiB streamed from memory: on one thread it ran 1.5x the time of two rows split over two (Zen 4,
// 2 threads); a cache-resident model's products (the embedded target's, < 1 MiB each) stay on one
// thread, where a fork and join costs more than it saves. small_linear_task_bytes sets it (0: the
// multiply-adds alone decide).
std::atomic<int64_t> task_bytes{int64_t{1} << 20};

// Column blocks of kLanes outputs per parallel task, for M rows of a K-deep product whose packed
// block holds block_bytes.
int64_t blocks_per_task(int64_t K, int64_t M, int64_t block_bytes) {
  int64_t blocks = (1 << 20) / std::max<int64_t>(1, K * M * kLanes);
  const int64_t bytes = task_bytes.load(std::memory_order_relaxed);
  if (bytes > 0) blocks = std::min(blocks, bytes / std::max<int64_t>(1, block_bytes));
  return std::max<int64_t>(8, blocks);
}
int64_t packed_bytes = 0;  // under cache_mutex

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }
std::unordered_map<PackKey, PackEntry, PackKeyHash> cache;

// w's packed copy, or an undefined tensor: use the row-major kernel this time. A bf16 copy (of an fp32
// w rounded, or of a bf16 w as pairs) is made at the first use (its products must not change after the
// first call) whatever the budget.
at::Tensor packed_weight(const at::Tensor& w, Layout layout) {
  const bool first_use = layout != Layout::kFloat;
  if (!first_use && (!packing.load(std::memory_order_relaxed) || w.is_inference())) return {};
  const uint32_t version = w.is_inference() ? 0 : w.unsafeGetTensorImpl()->version_counter().current_version();
  const PackKey key{w.storage().unsafeGetStorageImpl(), w.storage_offset(), w.size(0), w.size(1), w.stride(0), w.stride(1),
                    layout};
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache.find(key);
  if (it == cache.end()) {
    for (auto e = cache.begin(); e != cache.end();) {
      if (!e->second.storage.expired()) { ++e; continue; }
      packed_bytes -= bytes_of(e->second.packed);
      weights_stream.store(streams_from_memory(packed_bytes), std::memory_order_relaxed);
      e = cache.erase(e);
    }
    it = cache.emplace(key, PackEntry{c10::weak_intrusive_ptr<c10::StorageImpl>(w.storage().getWeakStorageImpl()),
                                      version, {}}).first;
    if (!first_use) return {};
  }
  PackEntry& entry = it->second;
  if (entry.version != version) {  // written in place since: pack at its next use
    entry.version = version;
    packed_bytes -= bytes_of(entry.packed);
    weights_stream.store(streams_from_memory(packed_bytes), std::memory_order_relaxed);
    entry.packed = at::Tensor();
    if (!first_use) return {};
  }
  if (!entry.packed.defined()) {
    if (layout == Layout::kBf16Pairs) {
      entry.packed = pack_pairs(w);
    } else {
      const bool as_bf16 = layout == Layout::kBf16 || bf16_exact(w);  // exact: the fp32 product from the bf16 copy
      const int64_t size = (w.size(0) + kLanes - 1) / kLanes * kLanes * w.size(1) * (as_bf16 ? 2 : 4);
      if (!first_use && packed_bytes + size > budget.load(std::memory_order_relaxed)) return {};
      entry.packed = pack(w, as_bf16);
    }
    packed_bytes += bytes_of(entry.packed);
    weights_stream.store(streams_from_memory(packed_bytes), std::memory_order_relaxed);
  }
  return entry.packed;
}

// x and w as bf16 pairs, fp32 sums, a result of x's dtype: bf16 x and w (a bf16 model), or fp32 x and
// w rounded to bf16 (--matmul_precision medium: x rounded at each call, w once when packed). The dot
// products run as VDPBF16PS where the CPU has AVX512-BF16 (bf16_dot.h), else as the same sums from
// fp32 FMAs (bf16_fma.h).
at::Tensor product_dot(const at::Tensor& x, const at::Tensor& w) {
  const int64_t K = w.size(1), N = w.size(0), K2 = (K + 1) / 2;
  const bool fp32 = x.scalar_type() == at::kFloat;
  at::Tensor xc = x.contiguous();
  const int64_t M = K ? xc.numel() / K : 0;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  if (K == 0) return y.zero_();
  if (M == 0 || N == 0) return y;
  const bool hardware = has_bf16_dot();
  // x as bf16 pairs (hardware) or as its bf16 values in fp32 (two words a pair)
  thread_local std::vector<uint32_t> words;
  const uint32_t* xp = words.data();
  if (!hardware) {
    words.resize(M * K2 * 2);
    auto* out = reinterpret_cast<float*>(words.data());
    if (fp32) widened_rows(xc.const_data_ptr<float>(), M, K, out);
    else widened_rows(reinterpret_cast<const c10::BFloat16*>(xc.const_data_ptr()), M, K, out);
    xp = words.data();
  }
#ifdef __AVX512F__
  else if (fp32) {
    words.resize(M * K2);
    to_pairs(xc.const_data_ptr<float>(), M, K, words.data());
    xp = words.data();
  } else {
    if (K % 2) xc = at::constant_pad_nd(xc.reshape({M, K}), {0, 1});  // whole pairs per row
    xp = reinterpret_cast<const uint32_t*>(xc.const_data_ptr());
  }
#endif
  const at::Tensor packed = packed_weight(w, Layout::kBf16Pairs);
  const auto* pp = reinterpret_cast<const uint32_t*>(packed.const_data_ptr());
  void* yp = y.mutable_data_ptr();
  const int64_t grain = blocks_per_task(K, M, K2 * kLanes * 4);
  at::parallel_for(0, (N + kLanes - 1) / kLanes, grain, [&](int64_t b0, int64_t b1) {
#ifdef __AVX512F__
    const int64_t pass_rows = hardware ? kDotPassRows : 6;   // rows per pass over w: the dot tiles', the FMA ones'
#else
    const int64_t pass_rows = 6;
#endif
    in_chunks(M, pass_rows, K2 * kLanes * 4, b0, b1, [&](int64_t c0, int64_t c1) {
      auto run = [&](auto* out) {
#ifdef __AVX512F__
        if (hardware) return packed_rows_dot(xp, M, K2, pp, c0, c1, N, out);
#endif
        packed_rows_fma(reinterpret_cast<const float*>(xp), M, K2, pp, c0, c1, N, out);
      };
      if (fp32) run(static_cast<float*>(yp));
      else run(static_cast<uint16_t*>(yp));
    });
  });
  return y;
}

// How an fp32 product multiplies: as given; by w rounded to bf16 (a draft's weights on the compiled
// path, --draft_weight_dtype bfloat16: half the bytes to stream; a bf16 packed copy made at w's first
// use, whatever the budget); or x and w both rounded to bf16 (--matmul_precision medium: the bf16 dot
// products, product_dot).
enum class Form { kFloat, kBf16Weights, kBf16Products };

at::Tensor product(const at::Tensor& x, const at::Tensor& w, Form form) {
  TORCH_CHECK(w.dim() == 2 && x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || (x.scalar_type() == at::kBFloat16 && form == Form::kFloat)),
              "nemospec::small_linear: expected x [..., K] and w [N, K], both fp32 or both bf16");
  TORCH_CHECK(x.size(-1) == w.size(1), "nemospec::small_linear: x has ", x.size(-1), " features, w expects ",
              w.size(1));
  if (x.scalar_type() == at::kBFloat16) return product_dot(x, w);
  if (form == Form::kBf16Products) return product_dot(x, w);
  const bool bf16_weights = form == Form::kBf16Weights;
  const at::Tensor xc = x.contiguous();
  const int64_t K = w.size(1), N = w.size(0), M = K ? xc.numel() / K : 0;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const float* xp = xc.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  if (K == 0) return y.zero_();
  if (M == 0 || N == 0) return y;
  const at::Tensor packed = packed_weight(w, bf16_weights ? Layout::kBf16 : Layout::kFloat);
  if (packed.defined()) {
    // >= ~1M multiply-adds per task: a decode or verify product of the embedded model stays on one
    // thread (a fork and join cost more than it saves there); a full-width one is split
    const int64_t grain = blocks_per_task(K, M, K * kLanes * static_cast<int64_t>(packed.element_size()));
    at::parallel_for(0, (N + kLanes - 1) / kLanes, grain, [&](int64_t b0, int64_t b1) {
      const int64_t block_bytes = K * kLanes * static_cast<int64_t>(packed.element_size());
      in_chunks(M, kPassRows, block_bytes, b0, b1, [&](int64_t c0, int64_t c1) {
        if (packed.scalar_type() == at::kBFloat16)
          packed_rows(xp, M, K, reinterpret_cast<const uint16_t*>(packed.const_data_ptr()), c0, c1, N, yp);
        else
          packed_rows(xp, M, K, packed.const_data_ptr<float>(), c0, c1, N, yp);
      });
    });
    return y;
  }
  const at::Tensor wc = w.contiguous();
  const float* wp = wc.const_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, K * M * kRows));
  at::parallel_for(0, (N + kRows - 1) / kRows, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRows, rows = std::min<int64_t>(kRows, N - n0);
      int64_t m0 = 0;
      for (; m0 + kGroup <= M; m0 += kGroup) block<kGroup>(xp, K, wp, n0, rows, yp, N, m0);
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

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w) { return product(x, w, Form::kFloat); }
at::Tensor small_linear_bf16w(const at::Tensor& x, const at::Tensor& w) { return product(x, w, Form::kBf16Weights); }
at::Tensor small_linear_bf16(const at::Tensor& x, const at::Tensor& w) { return product(x, w, Form::kBf16Products); }

#include "moe_routed.h"

}  // namespace

// The C entry point a compiled graph's C++ wrapper calls directly (inductor's custom_ops_to_c_shims),
// instead of a boxed call through the dispatcher (~4 us a call, a kernel's worth at one row).
namespace {
template <at::Tensor (*F)(const at::Tensor&, const at::Tensor&)>
AOTITorchError shim(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(F(*torch::aot_inductor::tensor_handle_to_tensor_pointer(x),
                                                     *torch::aot_inductor::tensor_handle_to_tensor_pointer(w)));
  });
}
}  // namespace

extern "C" AOTITorchError aoti_torch_cpu_small_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
  return shim<small_linear>(x, w, ret0);
}
extern "C" AOTITorchError aoti_torch_cpu_small_linear_bf16w(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
  return shim<small_linear_bf16w>(x, w, ret0);
}
extern "C" AOTITorchError aoti_torch_cpu_small_linear_bf16(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
  return shim<small_linear_bf16>(x, w, ret0);
}
extern "C" AOTITorchError aoti_torch_cpu_moe_routed(AtenTensorHandle x, AtenTensorHandle index, AtenTensorHandle weights,
                                                   AtenTensorHandle up, AtenTensorHandle down, int64_t act,
                                                   int64_t form, AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret0 = torch::aot_inductor::new_tensor_handle(
        moe_routed(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(index),
                   *tensor_handle_to_tensor_pointer(weights), *tensor_handle_to_tensor_pointer(up),
                   *tensor_handle_to_tensor_pointer(down), act, form));
  });
}

// Turns the packed layout on or off for every later product; returns whether it was on.
static bool small_linear_packing(bool on) { return packing.exchange(on); }

// Sets the byte budget of packed copies (copies made before stay); returns the previous one.
static int64_t small_linear_pack_budget(int64_t bytes) { return budget.exchange(bytes); }

// Sets the bytes of weights that earn a product's task its own thread (blocks_per_task); returns the
// previous value.
static int64_t small_linear_task_bytes(int64_t bytes) { return task_bytes.exchange(bytes); }

// Bytes held by packed copies now (dead weights' copies are dropped at the next new weight).
static int64_t small_linear_packed_bytes() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  return packed_bytes;
}

// Which multi-row tiles the products use: "auto" (the streaming ones where packed weights exceed an
// Intel CPU's L3), "wide" or "streaming"; returns the previous choice, and "" for a name it does not
// know (then nothing changes).
static std::string small_linear_tiles(const std::string& choice) {
  static const char* names[] = {"auto", "wide", "streaming"};
  for (int i = 0; i < 3; ++i)
    if (choice == names[i]) return names[tile_choice.exchange(i)];
  return "";
}

// Whether the fp32 and bf16-weight products of one pass use the streaming tiles now (never in the
// AVX2 form, whose tiles are already two blocks wide).
static bool small_linear_streaming() { return tile_streaming(); }

// Whether the bf16 dot products run in hardware (AVX512-BF16) rather than as fp32 FMAs: the same sums.
static bool small_linear_bf16_hardware() { return has_bf16_dot(); }

TORCH_LIBRARY(nemospec, m) {
  m.def("small_linear(Tensor x, Tensor w) -> Tensor");
  m.def("small_linear_bf16w(Tensor x, Tensor w) -> Tensor");
  m.def("small_linear_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("moe_routed(Tensor x, Tensor index, Tensor weights, Tensor up, Tensor down, int act, int form) -> Tensor");
  m.def("small_linear_packing(bool on) -> bool", &small_linear_packing);
  m.def("small_linear_pack_budget(int bytes) -> int", &small_linear_pack_budget);
  m.def("small_linear_packed_bytes() -> int", &small_linear_packed_bytes);
  m.def("small_linear_task_bytes(int bytes) -> int", &small_linear_task_bytes);
  m.def("small_linear_bf16_hardware() -> bool", &small_linear_bf16_hardware);
  m.def("small_linear_tiles(str choice) -> str", &small_linear_tiles);
  m.def("small_linear_streaming() -> bool", &small_linear_streaming);
  m.def("moe_routed_counts() -> Tensor", &moe_routed_counts);
}
TORCH_LIBRARY_IMPL(nemospec, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("small_linear_bf16w", &small_linear_bf16w);
  m.impl("small_linear_bf16", &small_linear_bf16);
  m.impl("moe_routed", &moe_routed);
}
