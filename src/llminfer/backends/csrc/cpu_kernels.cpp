// llminfer's CPU kernels, loaded by llminfer/backends/cpu_kernels.py. Built for AVX-512 (F, BW, DQ, VL: 16
// fp32 lanes, 32 registers) where the CPU has it, else for AVX2 + FMA (8 lanes, 16 registers);
// LLMINFER_KERNEL_AVX512 tells which.
//
// Linear products: out[M, N] = x[M, K] @ (w[N, K] * scale[N]).T + bias[N], fp32 activations and
// accumulation, weights fp32 or int8 (symmetric per output channel); on AVX-512 builds also int4 group-wise
// weights (int4_linear, VNNI) and bf16 activations and weights (bf16_linear, AVX-512 BF16), further down.
//
// Why: at decode M (the step's rows) is 1..64 while N and K are the model's, so the product is bound by
// the weight bytes read, not by FLOPs. torch's fp32 kernels stream the weights at well under the memory
// bandwidth on some CPUs, and its int8 weight-only kernel dequantizes the weight again for every
// activation row. Here each thread takes a range of output channels and, for NT channels at a time,
// reads (and for int8 converts) their weight once per MT activation rows, accumulating in vector registers.
// Prefill-sized products (more than MT rows) run here too, blocked for the caches, because torch's GEMM
// gives a row different bits at different M.
//
// Every output element is one fixed sequence of fp32 FMAs over k (kLanes lanes, then a fixed lane sum,
// then scale and bias: the build passes -ffp-contract=off so that epilogue is never fused in one code
// path and not in another), so a row's result does not depend on M, on the thread count or on where the
// row falls in a tile (it does depend on the ISA the kernel was built for: AVX2 and AVX-512 sum in
// different orders).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define LLMINFER_KERNEL_AVX512 1
#else
#define LLMINFER_KERNEL_AVX512 0
#endif
// AVX-512 VNNI (vpdpwssd: 32 int16 x int16 products added pairwise into 16 int32 lanes per instruction) in
// the AVX-512 build where the CPU has it: int8 products then take the integer path (int8_linear below).
#if LLMINFER_KERNEL_AVX512 && defined(__AVX512VNNI__)
#define LLMINFER_KERNEL_VNNI 1
#else
#define LLMINFER_KERNEL_VNNI 0
#endif
// AVX-512 BF16 (vdpbf16ps: 32 bf16 x bf16 products added pairwise into 16 fp32 lanes per instruction) in the
// AVX-512 build where the CPU has it: bf16 models' products then run here too (bf16_linear below).
#if LLMINFER_KERNEL_AVX512 && defined(__AVX512BF16__)
#define LLMINFER_KERNEL_BF16 1
#else
#define LLMINFER_KERNEL_BF16 0
#endif

namespace {

// The fixed lane sum of 8 fp32 lanes (both builds end with it).
inline float lane_sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The vector operations the kernels use, for the ISA this file is built for. Rows are K % 8 == 0 long;
// with 16 lanes a row may end in half a vector, which the *_half forms read with the upper lanes zero.
#if LLMINFER_KERNEL_AVX512
using vec = __m512;
constexpr int64_t kLanes = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec vload_half(const float* p) { return _mm512_maskz_loadu_ps(0x00FF, p); }
inline vec vload_half(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline void vstore_half(float* p, vec v) { _mm512_mask_storeu_ps(p, 0x00FF, v); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float lane_sum(vec v) {
  return lane_sum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#else
using vec = __m256;
constexpr int64_t kLanes = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// With 8 lanes a row never ends in half a vector; these exist so the kernels read the same for both ISAs.
inline vec vload_half(const float* p) { return vload(p); }
inline vec vload_half(const int8_t* p) { return vload(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline void vstore_half(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float lane_sum(vec v) { return lane_sum8(v); }
#endif

// bf16 values widened exactly to fp32 (a bf16 is the upper half of an fp32), for K/V caches in bf16.
#if LLMINFER_KERNEL_AVX512
inline vec vload(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline vec vload_half(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), 16));
}
#else
inline vec vload(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline vec vload_half(const c10::BFloat16* p) { return vload(p); }
#endif

// MT activation rows times NT weight rows over the whole of K (K % 8 == 0).
template <int MT, int NT, typename W>
inline void micro_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, const float* scale,
                       const float* bias, float* out, int64_t ldo) {
  vec acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = vzero();
  // One vector of columns from k; kHalf: the last 8 columns of a row, upper lanes zero in both operands.
  // always_inline: GCC otherwise kept this lambda out of line, so every vector step was a call that
  // loaded and stored all the accumulators (measured on Zen 4: the int8 LM head 6.9 -> 5.9 ms on 2 threads,
  // 1-row int8 products from L2 10.8 -> 19.5 G weights/s on one; the same operations, so the same bits).
  auto step = [&](int64_t k, auto half) __attribute__((always_inline)) {
    constexpr bool kHalf = decltype(half)::value;
    vec wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = kHalf ? vload_half(w + n * ldw + k) : vload(w + n * ldw + k);
    for (int m = 0; m < MT; ++m) {
      const vec xv = kHalf ? vload_half(x + m * ldx + k) : vload(x + m * ldx + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = vfma(xv, wv[n], acc[m][n]);
    }
  };
  constexpr std::false_type kFull{};
  // A cache line of weights at a time, prefetching the same line of the next NT rows (the next tile):
  // the hardware prefetcher alone leaves the int8 loop waiting on memory (measured on Zen: 3.5 -> 5.5 G
  // weights/s on one thread). Prefetching past the end of the weights is harmless (no fault).
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(W));
  static_assert(kLine % kLanes == 0, "a cache line holds whole vectors");
  if constexpr (MT == 1) {
    // One row (decode): each channel's weights in turn, so the tile is read as one sequential stream
    // instead of NT interleaved ones. Each output element gets the very same FMAs in the same order as in
    // the interleaved loop below (only the order across channels changes), so its bits do not change.
    for (int n = 0; n < NT; ++n) {
      const W* wn = w + n * ldw;
      vec a = vzero();
      int64_t k = 0;
      for (; k + kLine <= K; k += kLine) {
        _mm_prefetch(reinterpret_cast<const char*>(wn + NT * ldw + k), _MM_HINT_T0);
        for (int64_t j = k; j < k + kLine; j += kLanes) a = vfma(vload(x + j), vload(wn + j), a);
      }
      for (; k + kLanes <= K; k += kLanes) a = vfma(vload(x + k), vload(wn + k), a);
      if (k < K) a = vfma(vload_half(x + k), vload_half(wn + k), a);  // AVX-512 only, as below
      acc[0][n] = a;
    }
  } else {
    int64_t k = 0;
    for (; k + kLine <= K; k += kLine) {
      for (int n = 0; n < NT; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + NT) * ldw + k), _MM_HINT_T0);
      for (int64_t j = k; j < k + kLine; j += kLanes) step(j, kFull);
    }
    for (; k + kLanes <= K; k += kLanes) step(k, kFull);
    if (k < K) step(k, std::true_type{});  // AVX-512 only (with 8 lanes K % 8 == 0 leaves no half)
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float v = lane_sum(acc[m][n]);
      if (scale) v *= scale[n];
      if (bias) v += bias[n];
      out[m * ldo + n] = v;
    }
}

constexpr int kRows = 4;  // MT: activation rows per tile
// NT: weight rows (output channels) per tile. AVX2 (16 registers): 12 accumulators + 3 weights + 1 x.
// AVX-512 (32 registers): 24 + 6 + 1; at one row that is also 6 independent FMA chains instead of 3.
constexpr int kCols = LLMINFER_KERNEL_AVX512 ? 6 : 3;

// One tile: `rows` (1..kRows) activation rows times NT weight rows.
template <int NT, typename W>
inline void row_tile(int64_t rows, const float* x, int64_t K, const W* w, int64_t ldw, const float* scale,
                     const float* bias, float* out, int64_t N) {
  switch (rows) {
    case 4: micro_tile<4, NT>(x, K, w, ldw, K, scale, bias, out, N); break;
    case 3: micro_tile<3, NT>(x, K, w, ldw, K, scale, bias, out, N); break;
    case 2: micro_tile<2, NT>(x, K, w, ldw, K, scale, bias, out, N); break;
    default: micro_tile<1, NT>(x, K, w, ldw, K, scale, bias, out, N); break;
  }
}

// The tile of output channels [n, n + nt) (nt <= kCols) for activation rows [m, m + rows).
template <typename W>
inline void tile(int64_t nt, int64_t rows, const float* x, int64_t K, const W* w, const float* scale,
                 const float* bias, float* out, int64_t N) {
  switch (nt) {
#if LLMINFER_KERNEL_AVX512
    case 6: row_tile<6>(rows, x, K, w, K, scale, bias, out, N); break;
    case 5: row_tile<5>(rows, x, K, w, K, scale, bias, out, N); break;
    case 4: row_tile<4>(rows, x, K, w, K, scale, bias, out, N); break;
#endif
    case 3: row_tile<3>(rows, x, K, w, K, scale, bias, out, N); break;
    case 2: row_tile<2>(rows, x, K, w, K, scale, bias, out, N); break;
    default: row_tile<1>(rows, x, K, w, K, scale, bias, out, N); break;
  }
}

// Weights (as fp32) of one block of tiles, held in L2 while every activation row passes over them.
constexpr int64_t kBlockBytes = 256 * 1024;

// Calls tile(m, rows, n, cols) over an [M, N] output in tiles of up to `group_rows` rows and `tile_cols`
// output channels, in parallel over the channels (tasks of at least ~64 KB of weights; `row_bytes` is one
// channel's weight bytes). Up to `group_rows` rows each tile's weights are read once, straight from memory;
// beyond, a block of tiles (kBlockBytes of weights) stays in L2 while every group of rows passes over it.
// The order changes which tile runs when, never the operations of an output element.
template <typename F>
inline void for_each_tile(int64_t M, int64_t N, int64_t group_rows, int64_t tile_cols, int64_t row_bytes, F&& tile) {
  const int64_t tiles = (N + tile_cols - 1) / tile_cols;
  const int64_t tile_bytes = tile_cols * row_bytes;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / tile_bytes);
  const int64_t block_tiles = M <= group_rows ? tiles : std::max<int64_t>(1, kBlockBytes / tile_bytes);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += block_tiles) {
      const int64_t b1 = std::min(end, b0 + block_tiles);
      for (int64_t m = 0; m < M; m += group_rows) {
        const int64_t rows = std::min<int64_t>(group_rows, M - m);
        for (int64_t t = b0; t < b1; ++t) {
          const int64_t n = t * tile_cols;
          tile(m, rows, n, std::min<int64_t>(tile_cols, N - n));
        }
      }
    }
  });
}

// The weights of channels [n0, n1) as fp32: the weights themselves, or (int8) a thread-local copy
// converted exactly (every int8 is a float); the products are the same FMAs either way.
inline const float* block_weights(const float* w, int64_t n0, int64_t, int64_t K) { return w + n0 * K; }
inline const float* block_weights(const int8_t* w, int64_t n0, int64_t n1, int64_t K) {
  thread_local std::vector<float> converted;
  converted.resize(static_cast<size_t>((n1 - n0) * K));
  const int8_t* src = w + n0 * K;
  for (int64_t i = 0; i < (n1 - n0) * K; i += kLanes) {
    if (i + kLanes <= (n1 - n0) * K)
      vstore(converted.data() + i, vload(src + i));
    else
      vstore_half(converted.data() + i, vload_half(src + i));
  }
  return converted.data();
}

template <typename W>
void skinny_linear_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* scale,
                        const float* bias, float* out) {
  const int64_t tiles = (N + kCols - 1) / kCols;
  // Enough tiles per task that a task reads at least ~64 KB of weights.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kCols * K * static_cast<int64_t>(sizeof(W))));
  // int8 weights are converted in registers for every group of rows up to this many rows; beyond, one
  // converted copy of a block (kBlockBytes) costs less than converting again for each group.
  constexpr int64_t kDirectRows = std::is_same<W, int8_t>::value ? 4 * kRows : kRows;
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    if (M <= kDirectRows) {  // decode: each tile's weights are read once, straight from memory
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * kCols;
        for (int64_t m = 0; m < M; m += kRows)
          tile(std::min<int64_t>(kCols, N - n), std::min<int64_t>(kRows, M - m), x + m * K, K, w + n * K,
               scale ? scale + n : nullptr, bias ? bias + n : nullptr, out + m * N + n, N);
      }
      return;
    }
    // More rows (prefill): a block of tiles whose fp32 weights fit in L2, then every group of kRows rows
    // over the whole block, so each group of rows is read from L1 and each weight from L2. The loop order
    // changes which tile runs when, not the operations of any output element.
    const int64_t block_tiles = std::max<int64_t>(1, kBlockBytes / (kCols * K * static_cast<int64_t>(sizeof(float))));
    for (int64_t b0 = begin; b0 < end; b0 += block_tiles) {
      const int64_t b1 = std::min(end, b0 + block_tiles);
      const int64_t n0 = b0 * kCols, n1 = std::min(N, b1 * kCols);
      const float* wb = block_weights(w, n0, n1, K);
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - m);
        for (int64_t n = n0; n < n1; n += kCols)
          tile(std::min<int64_t>(kCols, n1 - n), rows, x + m * K, K, wb + (n - n0) * K, scale ? scale + n : nullptr,
               bias ? bias + n : nullptr, out + m * N + n, N);
      }
    }
  });
}

// Bytes of one row's codes: 64 per run of 128 columns (a partial last run padded).
inline int64_t int4_row_bytes(int64_t K) { return (K + 127) / 128 * 64; }

#if LLMINFER_KERNEL_VNNI
// ------------------------------------------------------------------------------------------------
// int8 products on integer dot products (the VNNI build).
//
// Each activation row is quantized on its own to 14 bits: sx = max|x| / 8191 (float32), q = round(x / sx)
// (to nearest even) in [-8191, 8191], stored as int16. vpdpwssd multiplies 32 int16 pairs (q, and the
// weights sign-extended from int8) and adds each two into 16 int32 lanes; a lane holds K / 16 products of
// at most 8191 * 127, exact in int32 for K <= 32768, and the lanes are summed in int64. So the dot product
// is exact, and the output is float32(double(dot) * sx * scale[n]) + bias[n]: a row's result does not
// depend on M, the threads, the tile or the order of the sums, and differs from the fp32-activation result
// only by the rounding of the activations (at most half a step of max|x| / 8191 per element).
constexpr int kActMax = 8191;
constexpr int64_t kIntK = 32;         // int16 activations per vector: the integer path needs K % 32 == 0
constexpr int64_t kIntMaxK = 32768;   // int32 lanes stay exact up to this K

// Quantized activation rows: q [M, K] int16, and each row's scale sx (NaN where the row has a NaN or an
// infinity, which makes its outputs NaN as the float path's would be).
struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<double> scale;
};

inline QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantizedRows r;
  r.q.resize(static_cast<size_t>(M * K));
  r.scale.resize(static_cast<size_t>(M));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      __m512 mx = _mm512_setzero_ps();
      __mmask16 nan = 0;  // max_ps drops a NaN operand, so NaNs are looked for on their own
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_loadu_ps(row + k);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      }
      const float amax = _mm512_reduce_max_ps(mx);
      const bool finite = nan == 0 && std::isfinite(amax);
      int16_t* q = r.q.data() + m * K;
      if (!finite || amax == 0.f) {
        std::fill(q, q + K, static_cast<int16_t>(0));
        r.scale[m] = finite ? 0.0 : std::nan("");
        continue;
      }
      const float sx = amax / static_cast<float>(kActMax);
      r.scale[m] = static_cast<double>(sx);
      const __m512 vsx = _mm512_set1_ps(sx);
      const __m512i lo = _mm512_set1_epi32(-kActMax), hi = _mm512_set1_epi32(kActMax);
      for (int64_t k = 0; k < K; k += 16) {
        // cvtps rounds to nearest even (the default MXCSR mode), as torch.round does
        const __m512i qi = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(row + k), vsx));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k),
                            _mm512_cvtepi32_epi16(_mm512_min_epi32(_mm512_max_epi32(qi, lo), hi)));
      }
    }
  });
  return r;
}

// The sums of 8 vectors of 8 int64 lanes each, out[i] = sum of v[i]'s lanes (a transposing tree of adds:
// 21 operations for the 8 sums instead of 8 separate horizontal reductions).
inline void lane_sums8(const __m512i* v, int64_t* out) {
  __m512i t[4], r[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane L: [v[2i] pair sum, v[2i+1] pair sum]
    t[i] = _mm512_add_epi64(_mm512_unpacklo_epi64(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi64(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // [t0 L0+L1, t0 L2+L3, t1 L0+L1, t1 L2+L3]
    r[i] = _mm512_add_epi64(_mm512_shuffle_i64x2(t[2 * i], t[2 * i + 1], 0x88),
                            _mm512_shuffle_i64x2(t[2 * i], t[2 * i + 1], 0xDD));
  _mm512_storeu_si512(out, _mm512_add_epi64(_mm512_shuffle_i64x2(r[0], r[1], 0x88),
                                            _mm512_shuffle_i64x2(r[0], r[1], 0xDD)));
}

// 32 int8 weights sign-extended to int16.
inline __m512i widen_int8(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// MT activation rows times NT channels over the whole of K: one int32 accumulator per pair.
template <int MT, int NT>
inline void int_micro_tile(const QuantizedRows& r, int64_t m0, const int8_t* w, int64_t K, const float* scale,
                           const float* bias, float* out, int64_t ldo) {
  __m512i acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_si512();
  const int16_t* q = r.q.data() + m0 * K;
  // 32 columns from k (always_inline: see micro_tile).
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    __m512i wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = widen_int8(w + n * K + k);
    for (int m = 0; m < MT; ++m) {
      const __m512i xv = _mm512_loadu_si512(q + m * K + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpwssd_epi32(acc[m][n], xv, wv[n]);
    }
  };
  if constexpr (MT == 1) {
    // One row (decode): each channel's weights in turn, so the tile is read as one sequential stream
    // (measured on Zen 4: the int8 LM head at 1 row 3.5-4.0 -> 2.35-2.9 ms against the interleaved order
    // below). Two accumulators per channel halve the dependency chain; the sums are exact either way.
    for (int n = 0; n < NT; ++n) {
      const int8_t* wn = w + n * K;
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      int64_t k = 0;
      for (; k + 64 <= K; k += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(wn + NT * K + k), _MM_HINT_T0);  // the next tile's row n
        a0 = _mm512_dpwssd_epi32(a0, _mm512_loadu_si512(q + k), widen_int8(wn + k));
        a1 = _mm512_dpwssd_epi32(a1, _mm512_loadu_si512(q + k + kIntK), widen_int8(wn + k + kIntK));
      }
      if (k < K) a0 = _mm512_dpwssd_epi32(a0, _mm512_loadu_si512(q + k), widen_int8(wn + k));
      acc[0][n] = _mm512_add_epi32(a0, a1);
    }
  } else {
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {  // a cache line of weights, prefetching the same line of the next tile
      for (int n = 0; n < NT; ++n) _mm_prefetch(reinterpret_cast<const char*>(w + (n + NT) * K + k), _MM_HINT_T0);
      step(k);
      step(k + kIntK);
    }
    if (k < K) step(k);
  }
  // Each accumulator widened to 8 int64 lanes, then summed 8 at a time.
  constexpr int kPairs = MT * NT, kGroups = (kPairs + 7) / 8;
  __m512i wide[kGroups * 8];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n)
      wide[m * NT + n] = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[m][n])),
                                          _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[m][n], 1)));
  for (int i = kPairs; i < kGroups * 8; ++i) wide[i] = _mm512_setzero_si512();
  alignas(64) int64_t dot[kGroups * 8];
  for (int g = 0; g < kGroups; ++g) lane_sums8(wide + 8 * g, dot + 8 * g);
  // float32(double(dot) * sx[m] * scale[n]) + bias[n], one row of NT outputs at a time.
  constexpr __mmask8 kMask = static_cast<__mmask8>((1u << NT) - 1);
  const __m512d sc = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(kMask, scale));
  const __m256 bs = bias ? _mm256_maskz_loadu_ps(kMask, bias) : _mm256_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    const __m512d d = _mm512_cvtepi64_pd(_mm512_maskz_loadu_epi64(kMask, dot + m * NT));
    __m256 v = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(d, _mm512_set1_pd(r.scale[m0 + m])), sc));
    if (bias) v = _mm256_add_ps(v, bs);
    _mm256_mask_storeu_ps(out + m * ldo, kMask, v);
  }
}

// 4 rows x 6 channels: 24 accumulators + 6 weight vectors + 1 activation vector of the 32 registers.
constexpr int kIntCols = 6;

template <int NT>
inline void int_row_tile(int64_t rows, const QuantizedRows& r, int64_t m0, const int8_t* w, int64_t K,
                         const float* scale, const float* bias, float* out, int64_t N) {
  switch (rows) {
    case 4: int_micro_tile<4, NT>(r, m0, w, K, scale, bias, out, N); break;
    case 3: int_micro_tile<3, NT>(r, m0, w, K, scale, bias, out, N); break;
    case 2: int_micro_tile<2, NT>(r, m0, w, K, scale, bias, out, N); break;
    default: int_micro_tile<1, NT>(r, m0, w, K, scale, bias, out, N); break;
  }
}

void int8_linear_impl(const float* x, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* scale,
                      const float* bias, float* out) {
  const QuantizedRows r = quantize_rows(x, M, K);
  for_each_tile(M, N, kRows, kIntCols, K, [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
    const int8_t* wt = w + n * K;
    float* o = out + m * N + n;
    const float* b = bias ? bias + n : nullptr;
    switch (cols) {
      case 6: int_row_tile<6>(rows, r, m, wt, K, scale + n, b, o, N); break;
      case 5: int_row_tile<5>(rows, r, m, wt, K, scale + n, b, o, N); break;
      case 4: int_row_tile<4>(rows, r, m, wt, K, scale + n, b, o, N); break;
      case 3: int_row_tile<3>(rows, r, m, wt, K, scale + n, b, o, N); break;
      case 2: int_row_tile<2>(rows, r, m, wt, K, scale + n, b, o, N); break;
      default: int_row_tile<1>(rows, r, m, wt, K, scale + n, b, o, N); break;
    }
  });
}

// ------------------------------------------------------------------------------------------------
// int4 group-wise products on the same integer dot products (the VNNI build).
//
// Weights: codes q[n, k] in [0, 15], four to a 16-bit word: each run of 128 columns from k0 (k0 % 128 == 0;
// the last run of a row may be shorter, its unused nibbles zero) is 32 words, word i holding q[k0 + 32j + i]
// in nibble j. So a 64-byte load, shifted right by 4j and masked in 16-bit lanes, gives the 32 codes of
// columns k0 + 32j .. k0 + 32j + 31 in order, ready for vpdpwssd: two instructions per 32 codes and no
// lane-crossing widening. W[n, k] = q[n, k] * scale[n, g] + zero[n, g] for g = k / G (zero here is
// the layer's zero point less 8 * scale). Activations are rounded per row as in int8_linear (qx, sx), and
//   out[m, n] = sx[m] * (sum_g scale[n, g] * dot_g + sum_g zero[n, g] * xsum[m, g]) + bias[n],
// with dot_g = sum_{k in g} qx[m, k] * q[n, k] exact in int32 (vpdpwssd; G <= 256) and xsum[m, g] the
// group's sum of qx. Per group, the 16 int32 lanes are converted to float32 and added with one FMA by the
// group's scale (as llama.cpp's Q4_0 dot products do per block); the float part runs in one fixed order,
// so a row's result depends on nothing but K and G.
constexpr int kInt4Rows = 8;  // activation rows per pass over a channel's codes

// Rows [m0, m0 + MT) times one channel, for groups of G columns: sums[m] = sum_g scale[g] * dot_g +
// sum_g zero[g] * xsum[m, g] (before sx and the bias). Even and odd groups go to two accumulators (half the
// FMA chain's latency); every step is the same whatever M, so a row's bits do not depend on the batch.
template <int MT, int G>
inline void int4_channel(const QuantizedRows& r, int64_t m0, const uint8_t* codes, int64_t K, const float* scale,
                         const float* zero, const float* xsum, float* sums) {
  constexpr int64_t kChunks = G / 32;  // 32-column chunks per group
  __m512 acc[2][MT];
  __m512i dot[MT];
  for (int m = 0; m < MT; ++m) {
    acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    dot[m] = _mm512_setzero_si512();
  }
  const int16_t* q = r.q.data() + m0 * K;
  const __m512i nib = _mm512_set1_epi16(0x0F);
  // chunk j (0..3) of the run of 128 columns from k0, holding its words
  auto chunk = [&](int64_t k0, __m512i words, auto j) __attribute__((always_inline)) {
    constexpr int kJ = decltype(j)::value;
    const int64_t k = k0 + 32 * kJ;
    const __m512i w = _mm512_and_si512(kJ ? _mm512_srli_epi16(words, 4 * kJ) : words, nib);
    for (int m = 0; m < MT; ++m) dot[m] = _mm512_dpwssd_epi32(dot[m], _mm512_loadu_si512(q + m * K + k), w);
    const int64_t c = k / 32;
    if ((c + 1) % kChunks == 0) {  // the group ends here: scale it into its accumulator
      const int64_t g = c / kChunks;
      const __m512 sg = _mm512_set1_ps(scale[g]);
      for (int m = 0; m < MT; ++m) {
        acc[g & 1][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), sg, acc[g & 1][m]);
        dot[m] = _mm512_setzero_si512();
      }
    }
  };
  int64_t k0 = 0;
  for (; k0 + 128 <= K; k0 += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + k0 / 2 + 1024), _MM_HINT_T0);
    const __m512i words = _mm512_loadu_si512(codes + k0 / 2);
    chunk(k0, words, std::integral_constant<int, 0>{});
    chunk(k0, words, std::integral_constant<int, 1>{});
    chunk(k0, words, std::integral_constant<int, 2>{});
    chunk(k0, words, std::integral_constant<int, 3>{});
  }
  if (k0 < K) {  // a last run of 32, 64 or 96 columns
    const __m512i words = _mm512_loadu_si512(codes + k0 / 2);
    chunk(k0, words, std::integral_constant<int, 0>{});
    if (k0 + 32 < K) chunk(k0, words, std::integral_constant<int, 1>{});
    if (k0 + 64 < K) chunk(k0, words, std::integral_constant<int, 2>{});
  }
  // The zero points' term: a dot product of the channel's zeros with each row's group sums, 16 at a time.
  const int64_t groups = K / G;
  for (int m = 0; m < MT; ++m) {
    const float* xs = xsum + (m0 + m) * groups;
    __m512 z = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 mask = groups - g >= 16 ? static_cast<__mmask16>(0xFFFF)
                                              : static_cast<__mmask16>((1u << (groups - g)) - 1);
      z = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, zero + g), _mm512_maskz_loadu_ps(mask, xs + g), z);
    }
    sums[m] = lane_sum(_mm512_add_ps(_mm512_add_ps(acc[0][m], acc[1][m]), z));
  }
}

// One channel for `rows` (1..kInt4Rows) rows and the group size G (32, 64, 128 or 256).
template <int G>
inline void int4_rows(int64_t rows, const QuantizedRows& r, int64_t m, const uint8_t* cn, int64_t K, const float* sn,
                      const float* zn, const float* xsum, float* sums) {
  switch (rows) {
    case 8: int4_channel<8, G>(r, m, cn, K, sn, zn, xsum, sums); break;
    case 7: int4_channel<7, G>(r, m, cn, K, sn, zn, xsum, sums); break;
    case 6: int4_channel<6, G>(r, m, cn, K, sn, zn, xsum, sums); break;
    case 5: int4_channel<5, G>(r, m, cn, K, sn, zn, xsum, sums); break;
    case 4: int4_channel<4, G>(r, m, cn, K, sn, zn, xsum, sums); break;
    case 3: int4_channel<3, G>(r, m, cn, K, sn, zn, xsum, sums); break;
    case 2: int4_channel<2, G>(r, m, cn, K, sn, zn, xsum, sums); break;
    default: int4_channel<1, G>(r, m, cn, K, sn, zn, xsum, sums); break;
  }
}

void int4_linear_impl(const float* x, int64_t M, int64_t K, const uint8_t* codes, int64_t N, int64_t G,
                      const float* scale, const float* zero, const float* bias, float* out) {
  const QuantizedRows r = quantize_rows(x, M, K);
  const int64_t groups = K / G;
  // Each row's group sums of qx (exact integers), as float32 for the zero-point term.
  std::vector<float> xsum(static_cast<size_t>(M * groups));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      int32_t t = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) t += r.q[m * K + k];
      xsum[m * groups + g] = static_cast<float>(t);
    }
  const int64_t row_bytes = int4_row_bytes(K);
  for_each_tile(M, N, kInt4Rows, 1, row_bytes, [&](int64_t m, int64_t rows, int64_t n, int64_t) {
    float sums[kInt4Rows];
    const uint8_t* cn = codes + n * row_bytes;
    const float* sn = scale + n * groups;
    const float* zn = zero + n * groups;
    switch (G) {
      case 32: int4_rows<32>(rows, r, m, cn, K, sn, zn, xsum.data(), sums); break;
      case 64: int4_rows<64>(rows, r, m, cn, K, sn, zn, xsum.data(), sums); break;
      case 128: int4_rows<128>(rows, r, m, cn, K, sn, zn, xsum.data(), sums); break;
      default: int4_rows<256>(rows, r, m, cn, K, sn, zn, xsum.data(), sums); break;
    }
    for (int64_t i = 0; i < rows; ++i) {
      float v = static_cast<float>(static_cast<double>(sums[i]) * r.scale[m + i]);
      if (bias) v += bias[n];
      out[(m + i) * N + n] = v;
    }
  });
}
#endif  // LLMINFER_KERNEL_VNNI

#if LLMINFER_KERNEL_BF16
// ------------------------------------------------------------------------------------------------
// bf16 products on vdpbf16ps (the BF16 build): out[M, N] = bf16(x[M, K] @ w[N, K].T + bias[N]).
//
// Why: a bf16 model read through torch's bf16 matmul at decode sizes pays oneDNN's per-call setup on every
// small layer (measured on a Xeon with AMX: 0.055-0.07 ms for a 512x1536 product at 1 row, against
// 0.03 ms for the same product in fp32 on the kernel above), and bf16 weights are half the bytes of fp32.
//
// Each output element is one fixed sequence: acc (16 fp32 lanes) += the products of 32 bf16 pairs per
// instruction (exact in fp32, added pairwise, round to nearest even, denormals flushed: the instruction's
// rules) over k, then the fixed lane sum, + bias, then one rounding to bf16 (nearest even). So, as for the
// fp32 kernel, a row's result does not depend on M, the threads or the row's place in a tile.
using bf16_t = c10::BFloat16;
constexpr int64_t kBf16K = 32;  // bf16 values per vector: the path needs K % 32 == 0

inline __m512bh load_bf16(const bf16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// B: the bias element type (float or bf16; a bf16 bias is widened exactly, so both give the same bits).
template <int MT, int NT, typename B>
inline void bf16_micro_tile(const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t K, const B* bias,
                            bf16_t* out, int64_t ldo) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  // A vector of 32 bf16 weights is one cache line: prefetch the same line of the next tile's row.
  if constexpr (MT == 1) {
    // One row (decode): each channel's weights in turn, one sequential stream (as in micro_tile); the same
    // instructions per output element as the interleaved loop below, so the same bits.
    for (int n = 0; n < NT; ++n) {
      const bf16_t* wn = w + n * K;
      __m512 a = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += kBf16K) {
        _mm_prefetch(reinterpret_cast<const char*>(wn + NT * K + k), _MM_HINT_T0);
        a = _mm512_dpbf16_ps(a, load_bf16(x + k), load_bf16(wn + k));
      }
      acc[0][n] = a;
    }
  } else {
    for (int64_t k = 0; k < K; k += kBf16K) {
      __m512bh wv[NT];
      for (int n = 0; n < NT; ++n) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + NT) * K + k), _MM_HINT_T0);
        wv[n] = load_bf16(w + n * K + k);
      }
      for (int m = 0; m < MT; ++m) {
        const __m512bh xv = load_bf16(x + m * ldx + k);
        for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float v = lane_sum(acc[m][n]);
      if (bias) v += static_cast<float>(bias[n]);
      out[m * ldo + n] = bf16_t(v);  // c10::BFloat16 rounds to nearest even
    }
}

// Calls f(rows, nt) with both as std::integral_constant: rows 1..kRows, nt 1..kCols.
template <typename F>
inline void with_tile_shape(int64_t rows, int64_t nt, F&& f) {
  auto by_rows = [&](auto cols) {
    switch (rows) {
      case 4: f(std::integral_constant<int, 4>{}, cols); break;
      case 3: f(std::integral_constant<int, 3>{}, cols); break;
      case 2: f(std::integral_constant<int, 2>{}, cols); break;
      default: f(std::integral_constant<int, 1>{}, cols); break;
    }
  };
  switch (nt) {
    case 6: by_rows(std::integral_constant<int, 6>{}); break;
    case 5: by_rows(std::integral_constant<int, 5>{}); break;
    case 4: by_rows(std::integral_constant<int, 4>{}); break;
    case 3: by_rows(std::integral_constant<int, 3>{}); break;
    case 2: by_rows(std::integral_constant<int, 2>{}); break;
    default: by_rows(std::integral_constant<int, 1>{}); break;
  }
}

template <typename B>
void bf16_linear_impl(const bf16_t* x, int64_t M, int64_t K, const bf16_t* w, int64_t N, const B* bias,
                      bf16_t* out) {
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(bf16_t));
  for_each_tile(M, N, kRows, kCols, row_bytes, [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
    with_tile_shape(rows, cols, [&](auto mt, auto nt) {
      bf16_micro_tile<decltype(mt)::value, decltype(nt)::value>(x + m * K, K, w + n * K, K, bias ? bias + n : nullptr,
                                                                out + m * N + n, N);
    });
  });
}
#endif  // LLMINFER_KERNEL_BF16

// The checked shapes and pointers of a linear product's arguments (`op` names the op in the errors).
struct LinearArgs {
  int64_t M, K, N;
  const float* scale;
  const float* bias;
};

LinearArgs check_linear_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1), op,
              ": weight must be a contiguous [N, K] tensor with x's K");
  LinearArgs a{x.size(0), x.size(1), weight.size(0), nullptr, nullptr};
  TORCH_CHECK(a.K > 0 && a.K % 8 == 0, op, ": K must be a positive multiple of 8, got ", a.K);
  if (scale.has_value()) {
    TORCH_CHECK(scale->device().is_cpu() && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->dim() == 1 && scale->numel() == a.N, op,
                ": scale must be a contiguous float32 [N] tensor");
    a.scale = scale->data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->numel() == a.N, op,
                ": bias must be a contiguous float32 [N] tensor");
    a.bias = bias->data_ptr<float>();
  }
  return a;
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias) {
  const LinearArgs a = check_linear_args("skinny_linear", x, weight, scale, bias);
  const int64_t M = a.M, K = a.K, N = a.N;
  const float* scale_p = a.scale;
  const float* bias_p = a.bias;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (weight.scalar_type() == at::kFloat) {
    skinny_linear_impl(x.data_ptr<float>(), M, K, weight.data_ptr<float>(), N, scale_p, bias_p,
                       out.data_ptr<float>());
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kChar, "skinny_linear: weight must be float32 or int8");
    skinny_linear_impl(x.data_ptr<float>(), M, K, weight.data_ptr<int8_t>(), N, scale_p, bias_p,
                       out.data_ptr<float>());
  }
  return out;
}

// int8_linear: skinny_linear for int8 weights with a scale. On the VNNI build, with K % 32 == 0 and
// K <= 32768, it runs the integer path above (activations rounded to 14 bits per row); elsewhere it is
// skinny_linear (float32 activations).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kChar, "int8_linear: weight must be int8");
#if LLMINFER_KERNEL_VNNI
  const int64_t K = x.dim() == 2 ? x.size(1) : 0;
  if (K > 0 && K % kIntK == 0 && K <= kIntMaxK) {
    TORCH_CHECK(scale.defined(), "int8_linear: scale is required");
    const LinearArgs a = check_linear_args("int8_linear", x, weight, scale, bias);
    at::Tensor out = at::empty({a.M, a.N}, x.options());
    if (a.M == 0 || a.N == 0) return out;
    int8_linear_impl(x.data_ptr<float>(), a.M, a.K, weight.data_ptr<int8_t>(), a.N, a.scale, a.bias,
                     out.data_ptr<float>());
    return out;
  }
#endif
  return skinny_linear(x, weight, scale, bias);
}

// int4_linear: x [M, K] float32 @ W.T + bias for the int4 codes above (the VNNI build only; G one of 32,
// 64, 128, 256 dividing K; K <= 32768).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                       int64_t group_size, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(LLMINFER_KERNEL_VNNI, "int4_linear: this build has no AVX-512 VNNI path (see int8_activation_bits())");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "int4_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_linear: x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), G = group_size;
  TORCH_CHECK((G == 32 || G == 64 || G == 128 || G == 256) && K > 0 && K % G == 0 && K <= 32768,
              "int4_linear: group_size must be 32, 64, 128 or 256 and divide K (K <= 32768), got group_size ",
              G, " and K ", K);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) == int4_row_bytes(K),
              "int4_linear: codes must be a contiguous uint8 [N, ceil(K / 128) * 64] tensor");
  const int64_t N = codes.size(0);
  for (const at::Tensor* t : {&scale, &zero})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == N && t->size(1) == K / G,
                "int4_linear: scale and zero must be contiguous float32 [N, K / group_size] CPU tensors");
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->numel() == N,
                "int4_linear: bias must be a contiguous float32 [N] CPU tensor");
    bias_p = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if LLMINFER_KERNEL_VNNI
  int4_linear_impl(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), N, G, scale.data_ptr<float>(),
                   zero.data_ptr<float>(), bias_p, out.data_ptr<float>());
#endif
  return out;
}

// bf16_linear: x [M, K] bf16 @ weight [N, K] bf16 .T + bias [N] (bf16 or float32), bf16 [M, N] out, on
// vdpbf16ps (the BF16 build only; K % 32 == 0).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(LLMINFER_KERNEL_BF16, "bf16_linear: this build has no AVX-512 BF16 path (see bf16_supported())");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_linear: x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "bf16_linear: weight must be a contiguous bfloat16 [N, K] tensor with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K > 0 && K % 32 == 0, "bf16_linear: K must be a positive multiple of 32, got ", K);
  if (bias.has_value())  // read as it is (no per-call conversion: bf16 layers call this every step)
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->numel() == N && bias->is_contiguous() &&
                    (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat),
                "bf16_linear: bias must be a contiguous bfloat16 or float32 [N] tensor on the CPU");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if LLMINFER_KERNEL_BF16
  const bf16_t* xp = x.data_ptr<at::BFloat16>();
  const bf16_t* wp = weight.data_ptr<at::BFloat16>();
  if (bias.has_value() && bias->scalar_type() == at::kBFloat16)
    bf16_linear_impl(xp, M, K, wp, N, bias->data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  else
    bf16_linear_impl(xp, M, K, wp, N, bias.has_value() ? bias->data_ptr<float>() : static_cast<const float*>(nullptr),
                     out.data_ptr<at::BFloat16>());
#endif
  return out;
}

}  // namespace

// The vector ISA this library was built for: 512 (AVX-512) or 256 (AVX2).
int64_t vector_bits() { return LLMINFER_KERNEL_AVX512 ? 512 : 256; }
// The activation bits of int8_linear's integer path: 14 on the VNNI build, 0 where it has none.
int64_t int8_activation_bits() { return LLMINFER_KERNEL_VNNI ? 14 : 0; }
// Whether bf16_linear runs here (the AVX-512 build with AVX-512 BF16).
bool bf16_supported() { return LLMINFER_KERNEL_BF16; }

TORCH_LIBRARY(llminfer_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? scale=None, Tensor? bias=None) -> Tensor");
  m.def("vector_bits() -> int", &vector_bits);
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None) -> Tensor");
  m.def("int8_activation_bits() -> int", &int8_activation_bits);
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("bf16_supported() -> bool", &bf16_supported);
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor zero, int group_size, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int4_linear", &int4_linear);
}

// ------------------------------------------------------------------------------------------------
// Paged decode attention: one query token per sequence, K/V read in place from the block pool.
//
//   query  [B, H, D]      float32, any strides for B and H, D contiguous
//   k, v   [H_kv, num_blocks, block_size, D]   float32 or bfloat16 (widened exactly to float32 as they are
//                                              read), contiguous (llminfer's head-major pool)
//   block_tables [B, W]   int64, contiguous; ctx_lens [B] int64 (tokens of context, >= 1)
//   out    [B, H, D]      float32, contiguous
//
// Query head h reads K/V head h / (H / H_kv) (grouped-query attention in HF's repeat_kv order). Each
// (sequence, K/V head) is one task: scores for its G query heads over the whole context, an exact
// softmax (max subtracted, fp32), then the probability-weighted sum of V in context order. A row's
// result does not depend on the batch, the padding of the block table or the thread count.
namespace {

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  vec acc0 = vzero(), acc1 = vzero();
  int64_t i = 0;
  for (; i + 2 * kLanes <= d; i += 2 * kLanes) {
    acc0 = vfma(vload(a + i), vload(b + i), acc0);
    acc1 = vfma(vload(a + i + kLanes), vload(b + i + kLanes), acc1);
  }
  for (; i + kLanes <= d; i += kLanes) acc0 = vfma(vload(a + i), vload(b + i), acc0);
  if (i < d) acc1 = vfma(vload_half(a + i), vload_half(b + i), acc1);  // AVX-512: the last 8
  return lane_sum(vadd(acc0, acc1));
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t d) {
  const vec a = vset1(alpha);
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) vstore(y + i, vfma(a, vload(x + i), vload(y + i)));
  if (i < d) vstore_half(y + i, vfma(a, vload_half(x + i), vload_half(y + i)));  // AVX-512: the last 8
}

}  // namespace

namespace {

// The attention of every (sequence, K/V head) task for K/V caches of element type T (float or bf16).
template <typename T>
void paged_decode_attention_impl(const float* q, int64_t sq_b, int64_t sq_h, const T* kc, const T* vc,
                                 const int64_t* tables, const int64_t* lens, int64_t B, int64_t H, int64_t H_kv,
                                 int64_t num_blocks, int64_t block_size, int64_t D, int64_t W, float sc, float* o) {
  const int64_t G = H / H_kv;
  at::parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H_kv, h = task % H_kv;
      const int64_t L = lens[b];
      scores.resize(static_cast<size_t>(G * L));
      const T* head_k = kc + h * num_blocks * block_size * D;
      const T* head_v = vc + h * num_blocks * block_size * D;
      for (int64_t t = 0; t < L; ++t) {
        const T* kt = head_k + (tables[b * W + t / block_size] * block_size + t % block_size) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(q + b * sq_b + (h * G + g) * sq_h, kt, D) * sc;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        float mx = s[0];
        for (int64_t t = 1; t < L; ++t) mx = std::max(mx, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - mx);
          total += s[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      float* ob = o + (b * H + h * G) * D;
      std::fill(ob, ob + G * D, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* vt = head_v + (tables[b * W + t / block_size] * block_size + t % block_size) * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + t], vt, ob + g * D, D);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.stride(2) == 1,
              "paged_decode_attention: query must be float32 [B, H, D] with D contiguous");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && (kv_type == at::kFloat || kv_type == at::kBFloat16) && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == kv_type && v_cache.is_contiguous(),
              "paged_decode_attention: k/v caches must be contiguous float32 or bfloat16 [H_kv, blocks, block_size, D]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "paged_decode_attention: block_tables must be contiguous int64 [B, W]");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous(),
              "paged_decode_attention: ctx_lens must be contiguous int64 [B]");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t H_kv = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t W = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0, "paged_decode_attention: head_dim must match and be a multiple of 8");
  TORCH_CHECK(H_kv > 0 && H % H_kv == 0, "paged_decode_attention: query heads must be a multiple of K/V heads");
  TORCH_CHECK(block_tables.size(0) == B && ctx_lens.size(0) == B, "paged_decode_attention: batch sizes differ");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * block_size, "paged_decode_attention: context length ", lens[b],
                " out of range for a block table of ", W, " blocks");
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tables[b * W + j] >= 0 && tables[b * W + j] < num_blocks, "paged_decode_attention: block id ",
                  tables[b * W + j], " out of range");
  }
  at::Tensor out = at::empty({B, H, D}, query.options().memory_format(at::MemoryFormat::Contiguous));
  const float sc = static_cast<float>(scale);
  if (kv_type == at::kFloat) {
    paged_decode_attention_impl(query.data_ptr<float>(), query.stride(0), query.stride(1), k_cache.data_ptr<float>(),
                                v_cache.data_ptr<float>(), tables, lens, B, H, H_kv, num_blocks, block_size, D, W, sc,
                                out.data_ptr<float>());
  } else {
    paged_decode_attention_impl(query.data_ptr<float>(), query.stride(0), query.stride(1),
                                k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), tables, lens, B,
                                H, H_kv, num_blocks, block_size, D, W, sc, out.data_ptr<float>());
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor ctx_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
