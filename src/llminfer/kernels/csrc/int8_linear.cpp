// int8_linear: skinny_linear for int8 weights with a scale, on integer dot products where the build has
// AVX-512 VNNI (vpdpwssd), activations rounded to 14 bits per row (int16_activations.h). Wrapper:
// llminfer/kernels/linear.py.
//
// The integer path: vpdpwssd multiplies 32 int16 pairs (q, and the
// weights sign-extended from int8) and adds each two into 16 int32 lanes; a lane holds K / 16 products of
// at most 8191 * 127, exact in int32 for K <= 32768, and the lanes are summed in int64. So the dot product
// is exact, and the output is float32(double(dot) * sx * scale[n]) + bias[n]: a row's result does not
// depend on M, the threads, the tile or the order of the sums, and differs from the fp32-activation result
// only by the rounding of the activations (at most half a step of max|x| / 8191 per element).
#include "int16_activations.h"

namespace llminfer {
namespace {

#if LLMINFER_KERNEL_VNNI
constexpr int64_t kIntK = 32;         // int16 activations per vector: the integer path needs K % 32 == 0
constexpr int64_t kIntMaxK = 32768;   // int32 lanes stay exact up to this K

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
  // 32 columns from k (always_inline: see micro_tile in skinny_linear.cpp).
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
#endif  // LLMINFER_KERNEL_VNNI

}  // namespace

// int8_linear: skinny_linear for int8 weights with a scale. On the VNNI build, with K % 32 == 0 and
// K <= 32768, it runs the integer path described at the top (activations rounded to 14 bits per row); elsewhere it is
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

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("int8_linear", &llminfer::int8_linear); }
