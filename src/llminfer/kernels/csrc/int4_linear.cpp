// int4_linear: group-wise int4 weights times float32 activations rounded to 14 bits per row, on AVX-512
// VNNI integer dot products (the VNNI build only). Wrapper: llminfer/kernels/int4_linear.py.
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
#include "int16_activations.h"

namespace llminfer {
namespace {

// Bytes of one row's codes: 64 per run of 128 columns (a partial last run padded).
inline int64_t int4_row_bytes(int64_t K) { return (K + 127) / 128 * 64; }

#if LLMINFER_KERNEL_VNNI
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

}  // namespace

// int4_linear: x [M, K] float32 @ W.T + bias for the int4 codes described at the top (the VNNI build only; G one of 32,
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

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor zero, int group_size, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("int4_linear", &llminfer::int4_linear); }
