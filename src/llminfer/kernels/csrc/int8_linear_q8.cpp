// int8_linear_q8: x [M, K] float32 @ (weight [N, K] int8 * scale[N]).T + bias on 8-bit activation blocks
// (the scheme in q8_activations.h). Wrapper: llminfer/kernels/q8_linear.py.
#include "q8_activations.h"

namespace llminfer {
namespace {

#if LLMINFER_Q8_512
// 64 weights from p made unsigned (w + 128); a last chunk of 32 reads only 32 bytes (the rest 0, whose
// products meet padding activations q = 0 and correction 0).
inline __m512i load_w_u8(const int8_t* p, bool half) {
  const __m512i w = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p) : _mm512_loadu_si512(p);
  return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));
}
// One chunk of one row against one channel's unsigned weights: acc + float(exact lane dots) * d.
inline facc chunk_fma(const Q8Rows& r, int64_t m, int64_t k, __m512i wu, facc acc) {
  const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(r.corr.data() + (m * r.Kp + k) / 4), wu,
                                          _mm512_loadu_si512(r.q.data() + m * r.Kp + k));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(r.dlane.data() + (m * r.Kp + k) / 4), acc);
}
#else
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
  for_each_tile(M, N, kQ8Rows, kQ8Cols, K, [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
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

}  // namespace

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
  const float* bias_p = optional_bias(op, bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  int8_linear_q8_impl(x.data_ptr<float>(), M, K, weight.data_ptr<int8_t>(), N, scale.data_ptr<float>(), bias_p,
                      out.data_ptr<float>());
  return out;
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("int8_linear_q8(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("int8_linear_q8", &llminfer::int8_linear_q8); }
