// What every kernel of llminfer's CPU library shares: the ISA the build targets, the fp32 vector operations,
// and the loop over an output's tiles. Each op is one .cpp file next to this one (skinny_linear.cpp,
// int8_linear.cpp, int4_linear.cpp, bf16_linear.cpp, int8_linear_q8.cpp, int4_linear_q8.cpp, int8_linear_a8.cpp,
// screen_candidates.cpp, paged_decode_attention.cpp; library.cpp defines the library and the build's queries), all compiled into one
// extension by llminfer/kernels/build.py.
//
// Built for AVX-512 (F, BW, DQ, VL: 16 fp32 lanes, 32 registers) where the CPU has it, else for AVX2 + FMA
// (8 lanes, 16 registers); LLMINFER_KERNEL_AVX512 tells which. The build passes -ffp-contract=off, so no
// compiler fuses a multiply and an add in one code path and not in another: every output element of every op
// is one fixed sequence of operations whatever M, the thread count or the element's place in a tile.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "thread_pool.h"

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
// the AVX-512 build where the CPU has it: int8 products then take the integer path (int8_linear.cpp).
#if LLMINFER_KERNEL_AVX512 && defined(__AVX512VNNI__)
#define LLMINFER_KERNEL_VNNI 1
#else
#define LLMINFER_KERNEL_VNNI 0
#endif
// AVX-512 BF16 (vdpbf16ps: 32 bf16 x bf16 products added pairwise into 16 fp32 lanes per instruction) in the
// AVX-512 build where the CPU has it: bf16 models' products then run here too (bf16_linear.cpp).
#if LLMINFER_KERNEL_AVX512 && defined(__AVX512BF16__)
#define LLMINFER_KERNEL_BF16 1
#else
#define LLMINFER_KERNEL_BF16 0
#endif
// The q8 path (int8_linear_q8.cpp, int4_linear_q8.cpp): u8 x s8 dot products on zmm registers where the build
// has AVX-512 VNNI, BW and VL.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define LLMINFER_Q8_512 1  // 64 columns per vpdpbusd on zmm registers
#else
#define LLMINFER_Q8_512 0
#endif
// 256-bit q8 kernels: vpdpbusd on ymm where the build has AVX-VNNI (VEX) or AVX-512 VNNI + VL (EVEX, the same
// instruction), else vpmaddubsw + vpmaddwd (plain AVX2).
#if defined(__AVXVNNI__)
#define LLMINFER_Q8_DP256 1
#define LLMINFER_DPBUSD256 _mm256_dpbusd_avx_epi32
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LLMINFER_Q8_DP256 1
#define LLMINFER_DPBUSD256 _mm256_dpbusd_epi32
#else
#define LLMINFER_Q8_DP256 0
#endif

namespace llminfer {

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
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
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
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
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

#if LLMINFER_KERNEL_AVX512
// max|x| over a row of K floats (K % 16 == 0), and whether the row is finite: max_ps drops a NaN operand, so
// NaNs are looked for on their own (the activation quantizers of int16_activations.h and int8_linear_a8.cpp).
inline float row_abs_max(const float* row, int64_t K, bool* finite) {
  __m512 mx = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = _mm512_loadu_ps(row + k);
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const float amax = _mm512_reduce_max_ps(mx);
  *finite = nan == 0 && std::isfinite(amax);
  return amax;
}
#endif

constexpr int kRows = 4;  // MT: activation rows per tile
// NT: weight rows (output channels) per tile. AVX2 (16 registers): 12 accumulators + 3 weights + 1 x.
// AVX-512 (32 registers): 24 + 6 + 1; at one row that is also 6 independent FMA chains instead of 3.
constexpr int kCols = LLMINFER_KERNEL_AVX512 ? 6 : 3;

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
  parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
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

// The checked shapes and pointers of a linear product's arguments (`op` names the op in the errors).
struct LinearArgs {
  int64_t M, K, N;
  const float* scale;
  const float* bias;
};

// x [M, K] float32, weight [N, K] (any dtype), scale and bias float32 [N] or absent (skinny_linear.cpp).
LinearArgs check_linear_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias);

// x @ (weight * scale).T + bias on float32 activations (skinny_linear.cpp; int8_linear falls back to it).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias);

}  // namespace llminfer
