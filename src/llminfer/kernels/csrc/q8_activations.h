// The q8 path: int8 and int4 weight-only products on 8-bit activations (int8_linear_q8.cpp,
// int4_linear_q8.cpp), and here what both share: the activation rows rounded per block of 32 columns and
// the float accumulator.
//
// Why: int8_linear.cpp / int4_linear.cpp round activations to 14 bits and widen the weights to
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
#pragma once

#include "common.h"

#include <limits>

namespace llminfer {

constexpr int64_t kBlock = 32;       // activation block: one d per 32 columns (llama.cpp's QK8_0)
constexpr int64_t kChunk = LLMINFER_Q8_512 ? 64 : 32;  // columns per dot-product instruction
constexpr int kQ8Rows = 4;           // activation rows per tile
constexpr int kQ8Cols = LLMINFER_Q8_512 ? 4 : 3;  // channels per tile (accumulators + weights in registers)

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
inline Q8Rows quantize_rows_q8(const float* x, int64_t M, int64_t K, int64_t pad = kChunk) {
  Q8Rows r;
  r.Kp = (K + pad - 1) / pad * pad;
  const int64_t Kp = r.Kp;
  r.q.assign(static_cast<size_t>(M * Kp), 0);
  r.absq.assign(static_cast<size_t>(M * Kp), 0);
  r.corr.assign(static_cast<size_t>(M * Kp / 4), 0);
  r.dlane.assign(static_cast<size_t>(M * Kp / 4), 0.f);
  r.dblock.assign(static_cast<size_t>(M * Kp / kBlock), 0.f);
  parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
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
using facc = __m512;
inline facc fzero() { return _mm512_setzero_ps(); }
inline float facc_sum(facc v) { return lane_sum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))); }
inline facc facc_add(facc a, facc b) { return _mm512_add_ps(a, b); }
#else
using facc = __m256;
inline facc fzero() { return _mm256_setzero_ps(); }
inline float facc_sum(facc v) { return lane_sum8(v); }
inline facc facc_add(facc a, facc b) { return _mm256_add_ps(a, b); }
#endif

// The group-wise products' shared steps (int4_linear_q8.cpp, int8_group_linear_q8.cpp).
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

// xsum[m, g]: each group's sum of the float32 activations (in double, rounded once), for the zero points' term.
// G is a multiple of 8; the sum runs in two vectors of 4 doubles (columns 8i..8i+3 and 8i+4..8i+7), then
// their fixed lane sum.
inline std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t G) {
  const int64_t groups = K / G;
  std::vector<float> xsum(static_cast<size_t>(M * groups));
  parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + m * K + g * G;
        __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
        for (int64_t k = 0; k < G; k += 8) {
          lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm_loadu_ps(xg + k)));
          hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm_loadu_ps(xg + k + 4)));
        }
        const __m256d t = _mm256_add_pd(lo, hi);
        __m128d s = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
        s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
        xsum[m * groups + g] = static_cast<float>(_mm_cvtsd_f64(s));
      }
  });
  return xsum;
}

inline void check_float_vec(const char* op, const char* name, const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 &&
                  t.numel() == n,
              op, ": ", name, " must be a contiguous float32 [N] CPU tensor");
}

// The optional float32 [N] bias's pointer (nullptr for none), checked.
inline const float* optional_bias(const char* op, const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  check_float_vec(op, "bias", *bias, N);
  return bias->data_ptr<float>();
}

// The group-wise ops' per-group scale and zero point (or minimum): contiguous float32 [N, groups] CPU tensors.
inline void check_group_params(const char* op, const at::Tensor& scale, const at::Tensor& zero, int64_t N,
                               int64_t groups, const char* zero_name = "zero") {
  for (const at::Tensor* t : {&scale, &zero})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == N && t->size(1) == groups,
                op, ": scale and ", zero_name, " must be contiguous float32 [N, K / group_size] CPU tensors, got ",
                t->sizes(), " for N = ", N, " and ", groups, " groups");
}

}  // namespace llminfer
