// llminfer's CPU kernels, part two: int8 and int4 weight-only products on 8-bit activations (the "q8" path),
// loaded with cpu_kernels.cpp by llminfer/backends/cpu_kernels.py (one library, several sources).
//
// Why: int8_linear / int4_linear in cpu_kernels.cpp round activations to 14 bits and widen the weights to
// int16 for vpdpwssd. On a CPU that runs AVX-512 on 256-bit units (AMD Zen 4) the widening and the 16-bit
// products leave the loop short of the memory bandwidth (the int8 LM head at one row read ~9.7 GB/s where
// llama.cpp's Q8_0 step reads ~20). Here the weights stay 8-bit (or 4-bit codes) and the activations are
// rounded to 8 bits per block of 32 columns, so one u8 x s8 dot-product instruction multiplies 64 (AVX-512)
// or 32 (AVX2) weights at a time. The scheme is llama.cpp's Q8_0 activation blocks (ggml's quantize_row_q8_0
// and its x86 vec_dot_q8_0_q8_0 / vec_dot_q4_0_q8_0; read to learn, not copied):
//
//   per row m and block b of 32 columns: d[m, b] = max|x| / 127 (float32), q = round(x / d) in [-127, 127]
//   out[m, n] = scale[n] * sum_b d[m, b] * (sum_{k in b} q[m, k] * w[n, k]) + bias[n]          (int8)
//
// The u8 x s8 instructions (vpdpbusd, vpmaddubsw) need one unsigned operand; activations and weights are
// both signed. Two ways, both exact:
// - VNNI (vpdpbusd, AVX-512 VNNI or AVX-VNNI): the weights become unsigned with w ^ 0x80 = w + 128 (one xor
//   per weight vector, shared by every activation row), and each int32 lane of 4 columns starts from
//   -128 * (the sum of the row's q over those columns), precomputed once per row, so the lane ends at the
//   exact sum of q * w. vpdpbusd does not saturate (128 + 127 = 255 times 127, four to a lane, fits int32).
// - AVX2 (vpmaddubsw): llama.cpp's sign trick: |q| is the unsigned operand and w takes q's sign
//   (vpsignb), so the products are q * w; pairs of them are at most 2 * 127 * 127 = 32258, inside
//   vpmaddubsw's saturating int16, and vpmaddwd with ones adds the pairs into int32 lanes of 4 columns.
//   (w + 128 would not do here: 2 * 255 * 127 saturates int16.)
// Either way lane j of a vector holds the exact dot product of columns 4j..4j+3 of its chunk; it is turned
// into float32 and added with one FMA times that column block's d into a float32 accumulator, chunk after
// chunk, then the fixed lane sum, times scale[n], plus bias[n]. Every output element is that one sequence
// whatever M, the threads or its place in a tile (the build passes -ffp-contract=off), so a row's result does
// not depend on the batch. Against float32 activations it differs by the activation rounding: at most
// d[m, b] / 2 per element, so |error| <= scale[n] * sum_k |w[n, k]| * d[m, b(k)] / 2 plus float32 sums.
// A block holding a NaN or an infinity gets d = NaN, which makes the row's outputs NaN.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define LLMINFER_Q8_512 1  // 64 columns per vpdpbusd on zmm registers
#else
#define LLMINFER_Q8_512 0
#endif
// 256-bit kernels: vpdpbusd on ymm where the build has AVX-VNNI (VEX) or AVX-512 VNNI + VL (EVEX, the same
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

namespace {

constexpr int64_t kBlock = 32;       // activation block: one d per 32 columns (llama.cpp's QK8_0)
constexpr int64_t kChunk = LLMINFER_Q8_512 ? 64 : 32;  // columns per dot-product instruction
constexpr int kQ8Rows = 4;           // activation rows per tile
constexpr int kQ8Cols = LLMINFER_Q8_512 ? 4 : 3;  // channels per tile (accumulators + weights in registers)

inline float lane_sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Activation rows rounded to 8 bits per block of 32 columns, with what the dot products need per lane of 4
// columns. Rows are padded with zeros to Kp (a multiple of kChunk), so a chunk never reads past them.
struct Q8Rows {
  int64_t Kp = 0;
  std::vector<int8_t> q;       // [M, Kp]   round(x / d), 0 in padding
  std::vector<int8_t> absq;    // [M, Kp]   |q| (the AVX2 sign trick's unsigned operand)
  std::vector<int32_t> corr;   // [M, Kp/4] -128 * (sum of q over the lane's 4 columns) (the VNNI offset)
  std::vector<float> dlane;    // [M, Kp/4] the lane's block scale d (0 in padding)
  std::vector<float> dblock;   // [M, Kp/32] d per block
};

// pad: the padded row length is a multiple of it (kChunk; 128 for the int4 codes' runs of 128 columns).
Q8Rows quantize_rows_q8(const float* x, int64_t M, int64_t K, int64_t pad = kChunk) {
  Q8Rows r;
  r.Kp = (K + pad - 1) / pad * pad;
  const int64_t Kp = r.Kp;
  r.q.assign(static_cast<size_t>(M * Kp), 0);
  r.absq.assign(static_cast<size_t>(M * Kp), 0);
  r.corr.assign(static_cast<size_t>(M * Kp / 4), 0);
  r.dlane.assign(static_cast<size_t>(M * Kp / 4), 0.f);
  r.dblock.assign(static_cast<size_t>(M * Kp / kBlock), 0.f);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < K / kBlock; ++b) {
        const float* xb = x + m * K + b * kBlock;
        __m256 mx = _mm256_setzero_ps();
        bool nan = false;
        for (int64_t k = 0; k < kBlock; k += 8) {
          const __m256 v = _mm256_loadu_ps(xb + k);
          mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v));
          nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;  // max_ps drops NaNs
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        int8_t* q = r.q.data() + m * Kp + b * kBlock;
        float d = 0.f;
        if (nan || !std::isfinite(amax)) {
          d = std::numeric_limits<float>::quiet_NaN();  // q stays 0; d = NaN makes the row's outputs NaN
        } else if (amax > 0.f) {
          d = amax / 127.f;
          const __m256 vd = _mm256_set1_ps(d);
          for (int64_t k = 0; k < kBlock; k += 8) {
            // cvtps rounds to nearest even (the default MXCSR mode), as torch.round does
            __m256i qi = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xb + k), vd));
            qi = _mm256_min_epi32(_mm256_max_epi32(qi, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
            alignas(32) int32_t t[8];
            _mm256_store_si256(reinterpret_cast<__m256i*>(t), qi);
            for (int i = 0; i < 8; ++i) q[k + i] = static_cast<int8_t>(t[i]);
          }
        }
        r.dblock[m * Kp / kBlock + b] = d;
        for (int64_t k = 0; k < kBlock; ++k) r.absq[m * Kp + b * kBlock + k] = static_cast<int8_t>(std::abs(q[k]));
        for (int64_t l = 0; l < kBlock / 4; ++l) {
          const int32_t s = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
          r.corr[(m * Kp + b * kBlock) / 4 + l] = -128 * s;
          r.dlane[(m * Kp + b * kBlock) / 4 + l] = d;
        }
      }
    }
  });
  return r;
}

#if LLMINFER_Q8_512
// 64 weights from p made unsigned (w + 128); a last chunk of 32 reads only 32 bytes (the rest 0, whose
// products meet padding activations q = 0 and correction 0).
inline __m512i load_w_u8(const int8_t* p, bool half) {
  const __m512i w = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p) : _mm512_loadu_si512(p);
  return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
}
using facc = __m512;
inline facc fzero() { return _mm512_setzero_ps(); }
// One chunk of one row against one channel's unsigned weights: acc + float(exact lane dots) * d.
inline facc chunk_fma(const Q8Rows& r, int64_t m, int64_t k, __m512i wu, facc acc) {
  const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(r.corr.data() + (m * r.Kp + k) / 4), wu,
                                          _mm512_loadu_si512(r.q.data() + m * r.Kp + k));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(r.dlane.data() + (m * r.Kp + k) / 4), acc);
}
inline float facc_sum(facc v) { return lane_sum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))); }
inline facc facc_add(facc a, facc b) { return _mm512_add_ps(a, b); }
#else
using facc = __m256;
inline facc fzero() { return _mm256_setzero_ps(); }
#if LLMINFER_Q8_DP256
inline __m256i load_w(const int8_t* p, bool) {
  return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(static_cast<char>(0x80)));
}
inline facc chunk_fma(const Q8Rows& r, int64_t m, int64_t k, __m256i wu, facc acc) {
  const int64_t i = m * r.Kp + k;
  const __m256i dot = LLMINFER_DPBUSD256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.corr.data() + i / 4)), wu,
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q.data() + i)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_loadu_ps(r.dlane.data() + i / 4), acc);
}
#else
inline __m256i load_w(const int8_t* p, bool) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline facc chunk_fma(const Q8Rows& r, int64_t m, int64_t k, __m256i w, facc acc) {
  const int64_t i = m * r.Kp + k;
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q.data() + i));
  const __m256i aq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.absq.data() + i));
  const __m256i p16 = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(w, q));  // |q| * (w * sign q) = q * w
  const __m256i dot = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_loadu_ps(r.dlane.data() + i / 4), acc);
}
#endif
inline float facc_sum(facc v) { return lane_sum8(v); }
inline facc facc_add(facc a, facc b) { return _mm256_add_ps(a, b); }
#endif

#if LLMINFER_Q8_512
using wvec = __m512i;
inline wvec load_wv(const int8_t* p, bool half) { return load_w_u8(p, half); }
#else
using wvec = __m256i;
inline wvec load_wv(const int8_t* p, bool half) { return load_w(p, half); }
#endif

// Rows [m0, m0 + MT) times channels [0, NT) of w (rows of K int8): out[m, n] for the int8 scheme above.
template <int MT, int NT>
inline void q8_int8_tile(const Q8Rows& r, int64_t m0, const int8_t* w, int64_t K, const float* scale,
                         const float* bias, float* out, int64_t ldo) {
  facc acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = fzero();
  if constexpr (MT == 1) {
    // One row (decode): each channel's weights in turn, one sequential stream, prefetching the same bytes
    // of the next tile's channel; the same operations per output element as the loop below.
    for (int n = 0; n < NT; ++n) {
      const int8_t* wn = w + n * K;
      facc a = fzero();
      for (int64_t k = 0; k < K; k += kChunk) {
        _mm_prefetch(reinterpret_cast<const char*>(wn + NT * K + k), _MM_HINT_T0);
        a = chunk_fma(r, m0, k, load_wv(wn + k, K - k < kChunk), a);
      }
      acc[0][n] = a;
    }
  } else {
    for (int64_t k = 0; k < K; k += kChunk) {
      wvec wv[NT];
      for (int n = 0; n < NT; ++n) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + NT) * K + k), _MM_HINT_T0);
        wv[n] = load_wv(w + n * K + k, K - k < kChunk);
      }
      for (int m = 0; m < MT; ++m)
        for (int n = 0; n < NT; ++n) acc[m][n] = chunk_fma(r, m0 + m, k, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float v = facc_sum(acc[m][n]) * scale[n];
      if (bias) v += bias[n];
      out[m * ldo + n] = v;
    }
}

// Weights of one block of tiles held in L2 while every group of rows passes over them (prefill sizes).
constexpr int64_t kQ8BlockBytes = 256 * 1024;

// tile(m, rows, n, cols) over an [M, N] output in tiles of up to group_rows rows and tile_cols channels, in
// parallel over the channels (as for_each_tile in cpu_kernels.cpp); the order never changes an element's
// operations.
template <typename F>
inline void q8_for_each_tile(int64_t M, int64_t N, int64_t group_rows, int64_t tile_cols, int64_t row_bytes, F&& tile) {
  const int64_t tiles = (N + tile_cols - 1) / tile_cols;
  const int64_t tile_bytes = tile_cols * row_bytes;
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / tile_bytes);
  const int64_t block_tiles = M <= group_rows ? tiles : std::max<int64_t>(1, kQ8BlockBytes / tile_bytes);
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

template <int NT>
inline void q8_int8_rows(int64_t rows, const Q8Rows& r, int64_t m, const int8_t* w, int64_t K, const float* s,
                         const float* b, float* o, int64_t N) {
  switch (rows) {
    case 4: q8_int8_tile<4, NT>(r, m, w, K, s, b, o, N); break;
    case 3: q8_int8_tile<3, NT>(r, m, w, K, s, b, o, N); break;
    case 2: q8_int8_tile<2, NT>(r, m, w, K, s, b, o, N); break;
    default: q8_int8_tile<1, NT>(r, m, w, K, s, b, o, N); break;
  }
}

void int8_linear_q8_impl(const float* x, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* scale,
                         const float* bias, float* out) {
  const Q8Rows r = quantize_rows_q8(x, M, K);
  q8_for_each_tile(M, N, kQ8Rows, kQ8Cols, K, [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
    const int8_t* wt = w + n * K;
    float* o = out + m * N + n;
    const float* b = bias ? bias + n : nullptr;
    switch (cols) {
#if LLMINFER_Q8_512
      case 4: q8_int8_rows<4>(rows, r, m, wt, K, scale + n, b, o, N); break;
#endif
      case 3: q8_int8_rows<3>(rows, r, m, wt, K, scale + n, b, o, N); break;
      case 2: q8_int8_rows<2>(rows, r, m, wt, K, scale + n, b, o, N); break;
      default: q8_int8_rows<1>(rows, r, m, wt, K, scale + n, b, o, N); break;
    }
  });
}

void check_float_vec(const char* op, const char* name, const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 &&
                  t.numel() == n,
              op, ": ", name, " must be a contiguous float32 [N] CPU tensor");
}

// int8_linear_q8: x [M, K] float32 @ (weight [N, K] int8 * scale[N]).T + bias, activations rounded to 8 bits
// per block of 32 (K % 32 == 0).
at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias) {
  const char* op = "int8_linear_q8";
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              op, ": weight must be a contiguous int8 [N, K] tensor with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K > 0 && K % kBlock == 0, op, ": K must be a positive multiple of 32, got ", K);
  check_float_vec(op, "scale", scale, N);
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    check_float_vec(op, "bias", *bias, N);
    bias_p = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  int8_linear_q8_impl(x.data_ptr<float>(), M, K, weight.data_ptr<int8_t>(), N, scale.data_ptr<float>(), bias_p,
                      out.data_ptr<float>());
  return out;
}

// ------------------------------------------------------------------------------------------------
// int4 group-wise products on the same 8-bit activation blocks.
//
// Codes q[n, k] in [0, 15], two to a byte, in runs of 128 columns (64 bytes) from k0: byte i holds column
// k0 + i in its low nibble and k0 + 64 + i in its high one (a shorter last run has zero nibbles where it has no
// columns). So a 64-byte load masked with 0x0F gives columns k0..k0+63 in order and the same load shifted
// right by 4 gives k0+64..k0+127: unsigned bytes ready for vpdpbusd (no offset needed) or vpmaddubsw (15 *
// 127 * 2 fits int16), in the columns' order, so lanes of 4 columns never mix two blocks or groups. (The
// layout of int4_linear in cpu_kernels.cpp pairs columns 32 apart in 16-bit words for vpdpwssd instead.)
// W[n, k] = q[n, k] * scale[n, g] + zero[n, g] for g = k / G (zero being the layer's zero point less 8 *
// scale), and
//   out[m, n] = lane sum of [sum over chunks of (float(dot lanes) * d[m, lane's block]) * scale[n, lane's group]
//                            + sum over vectors of groups of zero[n, g] * xsum[m, g]] + bias[n],
// the dot lanes exact (int32), xsum[m, g] the group's sum of the float32 activations themselves (in double,
// rounded once), every float step in one fixed order: a row's result does not depend on the batch. This is
// llama.cpp's Q4_1 x Q8_0 block product (the zero term from the activations' sums, as its Q4_1 "m" term)
// with llminfer's code layout and group sizes.
inline int64_t int4_q8_row_bytes(int64_t K) { return (K + 127) / 128 * 64; }

#if LLMINFER_Q8_512
// The per-lane group scale of the 64-column chunk from k: one value, or (G = 32) two halves.
inline __m512 lane_scales(const float* s, int64_t k, int64_t G, int64_t groups) {
  if (G > 32) return _mm512_set1_ps(s[k / G]);
  const int64_t g = k / 32;
  // s[g] to lanes 0-7 and s[g + 1] to lanes 8-15 (0 where a last chunk of 32 columns has no second group)
  const __m512 two = _mm512_maskz_loadu_ps(g + 1 < groups ? 0x3 : 0x1, s + g);
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), two);
}
#endif

// The zero points' term sum_g zero[g] * xsum[g] as a vector of partial sums (groups a vector at a time, in
// order), added to the products' accumulator before its one lane sum. (A scalar loop here was the int4 loop's
// bottleneck: one dependent add per group per channel.)
inline facc zero_term(const float* z, const float* xs, int64_t groups) {
#if LLMINFER_Q8_512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 mask = groups - g >= 16 ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (groups - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, z + g), _mm512_maskz_loadu_ps(mask, xs + g), acc);
  }
  return acc;
#else
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g += 8) {
    const int64_t left = std::min<int64_t>(8, groups - g);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(z + g, mask), _mm256_maskload_ps(xs + g, mask), acc);
  }
  return acc;
#endif
}

// Rows [m0, m0 + MT) times one channel: out[m] = the sum above (before the bias).
template <int MT>
inline void int4_q8_channel(const Q8Rows& r, int64_t m0, const uint8_t* codes, int64_t K, int64_t G,
                            const float* s, const float* zero, const float* xsum, float* sums) {
  const int64_t groups = K / G;
  facc acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = fzero();
#if LLMINFER_Q8_512
  const __m512i nib = _mm512_set1_epi8(0x0F);
  auto chunk = [&](int64_t k, __m512i c) __attribute__((always_inline)) {
    const __m512 sv = lane_scales(s, k, G, groups);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (m0 + m) * r.Kp + k;
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, _mm512_loadu_si512(r.q.data() + i));
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(r.dlane.data() + i / 4));
      acc[m] = _mm512_fmadd_ps(f, sv, acc[m]);
    }
  };
  for (int64_t k0 = 0; k0 < K; k0 += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + k0 / 2 + 1024), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(codes + k0 / 2);
    chunk(k0, _mm512_and_si512(v, nib));
    if (k0 + 64 < K) chunk(k0 + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
  }
#else
  const __m256i nib = _mm256_set1_epi8(0x0F);
  auto chunk = [&](int64_t k, __m256i c) __attribute__((always_inline)) {
    const __m256 sv = _mm256_set1_ps(s[k / G]);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (m0 + m) * r.Kp + k;
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q.data() + i));
#if LLMINFER_Q8_DP256
      const __m256i dot = LLMINFER_DPBUSD256(_mm256_setzero_si256(), c, q);
#else
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(c, q), _mm256_set1_epi16(1));
#endif
      const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_loadu_ps(r.dlane.data() + i / 4));
      acc[m] = _mm256_fmadd_ps(f, sv, acc[m]);
    }
  };
  for (int64_t k0 = 0; k0 < K; k0 += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + k0 / 2 + 1024), _MM_HINT_T0);
    for (int64_t h = 0; h < 2; ++h) {  // bytes 32h..32h+31: columns k0 + 32h.. (low) and k0 + 64 + 32h.. (high)
      if (k0 + 32 * h >= K) break;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k0 / 2 + 32 * h));
      chunk(k0 + 32 * h, _mm256_and_si256(v, nib));
      if (k0 + 64 + 32 * h < K) chunk(k0 + 64 + 32 * h, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
    }
  }
#endif
  for (int m = 0; m < MT; ++m)
    sums[m] = facc_sum(facc_add(acc[m], zero_term(zero, xsum + (m0 + m) * groups, groups)));
}

void int4_linear_q8_impl(const float* x, int64_t M, int64_t K, const uint8_t* codes, int64_t N, int64_t G,
                         const float* scale, const float* zero, const float* bias, float* out) {
  const Q8Rows r = quantize_rows_q8(x, M, K, 128);
  const int64_t groups = K / G;
  std::vector<float> xsum(static_cast<size_t>(M * groups));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      double t = 0.0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) t += x[m * K + k];
      xsum[m * groups + g] = static_cast<float>(t);
    }
  const int64_t row_bytes = int4_q8_row_bytes(K);
  q8_for_each_tile(M, N, kQ8Rows, 1, row_bytes, [&](int64_t m, int64_t rows, int64_t n, int64_t) {
    float sums[kQ8Rows];
    const uint8_t* cn = codes + n * row_bytes;
    const float* sn = scale + n * groups;
    const float* zn = zero + n * groups;
    switch (rows) {
      case 4: int4_q8_channel<4>(r, m, cn, K, G, sn, zn, xsum.data(), sums); break;
      case 3: int4_q8_channel<3>(r, m, cn, K, G, sn, zn, xsum.data(), sums); break;
      case 2: int4_q8_channel<2>(r, m, cn, K, G, sn, zn, xsum.data(), sums); break;
      default: int4_q8_channel<1>(r, m, cn, K, G, sn, zn, xsum.data(), sums); break;
    }
    for (int64_t i = 0; i < rows; ++i) {
      float v = sums[i];
      if (bias) v += bias[n];
      out[(m + i) * N + n] = v;
    }
  });
}

// int4_linear_q8: x [M, K] float32 @ W.T + bias for the int4 codes above (G one of 32, 64, 128, 256 dividing
// K).
at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                          const at::Tensor& zero, int64_t group_size, const c10::optional<at::Tensor>& bias) {
  const char* op = "int4_linear_q8";
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), G = group_size;
  TORCH_CHECK((G == 32 || G == 64 || G == 128 || G == 256) && K > 0 && K % G == 0, op,
              ": group_size must be 32, 64, 128 or 256 and divide K, got group_size ", G, " and K ", K);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) == int4_q8_row_bytes(K),
              op, ": codes must be a contiguous uint8 [N, ceil(K / 128) * 64] tensor");
  const int64_t N = codes.size(0);
  for (const at::Tensor* t : {&scale, &zero})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == N && t->size(1) == K / G,
                op, ": scale and zero must be contiguous float32 [N, K / group_size] CPU tensors");
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    check_float_vec(op, "bias", *bias, N);
    bias_p = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  int4_linear_q8_impl(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), N, G, scale.data_ptr<float>(),
                      zero.data_ptr<float>(), bias_p, out.data_ptr<float>());
  return out;
}

// Which instruction the q8 path multiplies with in this build.
std::string q8_instruction() {
#if LLMINFER_Q8_512
  return "vpdpbusd zmm (AVX-512 VNNI)";
#elif LLMINFER_Q8_DP256 && defined(__AVXVNNI__)
  return "vpdpbusd ymm (AVX-VNNI)";
#elif LLMINFER_Q8_DP256
  return "vpdpbusd ymm (AVX-512 VNNI, VL)";
#else
  return "vpmaddubsw ymm (AVX2)";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("int8_linear_q8(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None) -> Tensor");
  m.def("int4_linear_q8(Tensor x, Tensor codes, Tensor scale, Tensor zero, int group_size, Tensor? bias=None) -> Tensor");
  m.def("q8_instruction() -> str", &q8_instruction);
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) {
  m.impl("int8_linear_q8", &int8_linear_q8);
  m.impl("int4_linear_q8", &int4_linear_q8);
}
