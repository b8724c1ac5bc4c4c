// int4_linear_q8: group-wise int4 weights times 8-bit activation blocks (q8_activations.h). Wrapper:
// llminfer/kernels/q8_linear.py.
//
// Codes q[n, k] in [0, 15], two to a byte, in runs of 128 columns (64 bytes) from k0: byte i holds column
// k0 + i in its low nibble and k0 + 64 + i in its high one (a shorter last run has zero nibbles where it has no
// columns). So a 64-byte load masked with 0x0F gives columns k0..k0+63 in order and the same load shifted
// right by 4 gives k0+64..k0+127: unsigned bytes ready for vpdpbusd (no offset needed) or vpmaddubsw (15 *
// 127 * 2 fits int16), in the columns' order, so lanes of 4 columns never mix two blocks or groups. (The
// layout of int4_linear.cpp pairs columns 32 apart in 16-bit words for vpdpwssd instead.)
// W[n, k] = q[n, k] * scale[n, g] + zero[n, g] for g = k / G (zero being the layer's zero point less 8 *
// scale), and
//   out[m, n] = lane sum of [sum over chunks of (float(dot lanes) * d[m, lane's block]) * scale[n, lane's group]
//                            + sum over vectors of groups of zero[n, g] * xsum[m, g]] + bias[n],
// the dot lanes exact (int32), xsum[m, g] the group's sum of the float32 activations themselves (in double,
// rounded once), every float step in one fixed order: a row's result does not depend on the batch. This is
// llama.cpp's Q4_1 x Q8_0 block product (the zero term from the activations' sums, as its Q4_1 "m" term)
// with llminfer's code layout and group sizes.
#include "q8_activations.h"

namespace llminfer {
namespace {

inline int64_t int4_q8_row_bytes(int64_t K) { return (K + 127) / 128 * 64; }

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
  const std::vector<float> xsum = group_sums(x, M, K, G);
  const int64_t row_bytes = int4_q8_row_bytes(K);
  for_each_tile(M, N, kQ8Rows, 1, row_bytes, [&](int64_t m, int64_t rows, int64_t n, int64_t) {
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

}  // namespace

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
  check_group_params(op, scale, zero, N, K / G);
  const float* bias_p = optional_bias(op, bias, N);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  int4_linear_q8_impl(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), N, G, scale.data_ptr<float>(),
                      zero.data_ptr<float>(), bias_p, out.data_ptr<float>());
  return out;
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("int4_linear_q8(Tensor x, Tensor codes, Tensor scale, Tensor zero, int group_size, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("int4_linear_q8", &llminfer::int4_linear_q8); }
