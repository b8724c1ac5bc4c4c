// int8_linear_a8: x [M, K] float32 @ (weight [N, K] int8 * scale[N]).T with each activation row rounded to
// 8 bits as a whole (one scale per row, not per block), so that a row's dot product with a channel is one
// exact int32 sum of u8 x s8 products on vpdpbusd (64 a zmm instruction), with no float work until the end.
// The AVX-512 VNNI build only; wrapper: llminfer/kernels/argmax_screen.py (the argmax screen's int8 copy,
// whose error bound covers the coarser activations; the weight-only layers keep their own paths).
//
// Activations: sx = max|x| / 127 (float32), q = round(x / sx) (to nearest even) in [-127, 127], stored as
// q + 128 (u8). With wsum[n] = sum_k weight[n, k], sum_k q_k w_k = sum_k (q_k + 128) w_k - 128 * wsum[n]; every
// term fits int32 for K <= 2^31 / (255 * 127). The output is float32(float32(dot) * sx) * scale[n]: one fixed
// sequence per element, so a row's result does not depend on M, the threads or the tile. A row holding a NaN
// or an infinity gives NaN outputs.
#include "common.h"

namespace llminfer {
namespace {

#if LLMINFER_Q8_512
constexpr int64_t kStep = 64;   // activations per vpdpbusd
constexpr int kA8Rows = 4;      // MT: 4 x 6 accumulators + 1 weight vector + 1 activation vector (K > 1024)
constexpr int kA8Cols = 6;      // NT

struct ByteRows {
  std::vector<uint8_t> q;     // [M, K], q + 128
  std::vector<float> scale;   // [M], NaN for a row with a NaN or an infinity
};

ByteRows quantize_rows_a8(const float* x, int64_t M, int64_t K) {
  ByteRows r;
  r.q.resize(static_cast<size_t>(M * K));
  r.scale.resize(static_cast<size_t>(M));
  parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      bool finite;
      const float amax = row_abs_max(row, K, &finite);
      uint8_t* q = r.q.data() + m * K;
      if (!finite || amax == 0.f) {
        std::fill(q, q + K, static_cast<uint8_t>(128));
        r.scale[m] = finite ? 0.f : std::nanf("");
        continue;
      }
      const float sx = amax / 127.f;
      r.scale[m] = sx;
      const __m512 vsx = _mm512_set1_ps(sx);
      const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
      for (int64_t k = 0; k < K; k += 16) {
        // cvtps rounds to nearest even (the default MXCSR mode), as torch.round does
        const __m512i qi = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(row + k), vsx));
        const __m512i u = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(qi, lo), hi), off);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(u));
      }
    }
  });
  return r;
}

// The sums of the 16 int32 lanes of a, b, c and d, as [sum a, sum b, sum c, sum d] (integer adds: exact in
// any order).
inline __m128i lane_sums4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  // per 128-bit lane: [a, b, a, b] and [c, d, c, d] partial sums -> [a, b, c, d]
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Rows [m0, m0 + MT) times channels [0, NT) of w: out[m, n].
template <int MT, int NT>
inline void a8_tile(const ByteRows& r, int64_t m0, const int8_t* w, int64_t K, const float* scale,
                    const int32_t* wsum, float* out, int64_t ldo) {
  __m512i acc[MT * NT];
  for (int i = 0; i < MT * NT; ++i) acc[i] = _mm512_setzero_si512();
  const uint8_t* q = r.q.data() + m0 * K;
  if constexpr (MT == 1) {
    // One row (decode): each channel's weights in turn, one sequential stream, prefetching the same bytes of
    // the next tile's channel. Two accumulators per channel halve the dependency chain (exact either way).
    for (int n = 0; n < NT; ++n) {
      const int8_t* wn = w + n * K;
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      int64_t k = 0;
      for (; k + 2 * kStep <= K; k += 2 * kStep) {
        _mm_prefetch(reinterpret_cast<const char*>(wn + NT * K + k), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wn + NT * K + k + kStep), _MM_HINT_T0);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(q + k), _mm512_loadu_si512(wn + k));
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(q + k + kStep), _mm512_loadu_si512(wn + k + kStep));
      }
      if (k < K) a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(q + k), _mm512_loadu_si512(wn + k));
      acc[n] = _mm512_add_epi32(a0, a1);
    }
  } else {
    // Several rows: still each channel's weights in turn (one sequential stream, as at one row; the
    // interleaved order of the other kernels was slower here), every row's activations from L1.
    for (int n = 0; n < NT; ++n) {
      const int8_t* wn = w + n * K;
      for (int64_t k = 0; k < K; k += kStep) {
        _mm_prefetch(reinterpret_cast<const char*>(wn + NT * K + k), _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512(wn + k);
        for (int m = 0; m < MT; ++m)
          acc[m * NT + n] = _mm512_dpbusd_epi32(acc[m * NT + n], _mm512_loadu_si512(q + m * K + k), wv);
      }
    }
  }
  constexpr int kPairs = MT * NT, kGroups = (kPairs + 3) / 4;
  alignas(16) int32_t dot[kGroups * 4];
  const __m512i z = _mm512_setzero_si512();
  for (int g = 0; g < kGroups; ++g) {
    const int i = 4 * g;
    _mm_store_si128(reinterpret_cast<__m128i*>(dot + i),
                    lane_sums4(acc[i], i + 1 < kPairs ? acc[i + 1] : z, i + 2 < kPairs ? acc[i + 2] : z,
                               i + 3 < kPairs ? acc[i + 3] : z));
  }
  for (int m = 0; m < MT; ++m) {
    const float sx = r.scale[m0 + m];
    for (int n = 0; n < NT; ++n)
      out[m * ldo + n] = static_cast<float>(dot[m * NT + n] - 128 * wsum[n]) * sx * scale[n];
  }
}

template <int NT>
inline void a8_rows(int64_t rows, const ByteRows& r, int64_t m, const int8_t* w, int64_t K, const float* s,
                    const int32_t* ws, float* o, int64_t N) {
  switch (rows) {
    case 4: a8_tile<4, NT>(r, m, w, K, s, ws, o, N); break;
    case 3: a8_tile<3, NT>(r, m, w, K, s, ws, o, N); break;
    case 2: a8_tile<2, NT>(r, m, w, K, s, ws, o, N); break;
    default: a8_tile<1, NT>(r, m, w, K, s, ws, o, N); break;
  }
}

// Rows [m0, m0 + MT) over `cols` channels of w, for K = 64 * KV: the rows' activations stay in registers
// (MT * KV of them) while the channels stream past, four at a time, each channel's weights read once in
// order; the four channels' sums of a row are reduced together (lane_sums4) and scaled as four floats (the
// same float32(dot) * sx * scale per element as a8_tile).
template <int MT, int KV>
inline void a8_panel(const ByteRows& r, int64_t m0, const int8_t* w, int64_t cols, const float* scale,
                     const int32_t* wsum, float* out, int64_t ldo) {
  constexpr int64_t K = KV * kStep;
  __m512i xa[MT][KV];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < KV; ++v) xa[m][v] = _mm512_loadu_si512(r.q.data() + (m0 + m) * K + v * kStep);
  const __m512i z = _mm512_setzero_si512();
  for (int64_t n = 0; n < cols; n += 4) {
    const int live = static_cast<int>(std::min<int64_t>(4, cols - n));
    __m512i acc[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int c = 0; c < 4; ++c) acc[m][c] = z;
    for (int c = 0; c < live; ++c) {
      const int8_t* wc = w + (n + c) * K;
      for (int v = 0; v < KV; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(wc + 4 * K + v * kStep), _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512(wc + v * kStep);
        for (int m = 0; m < MT; ++m) acc[m][c] = _mm512_dpbusd_epi32(acc[m][c], xa[m][v], wv);
      }
    }
    const __mmask8 mask = static_cast<__mmask8>((1u << live) - 1);
    const __m128i corr = _mm_mullo_epi32(_mm_maskz_loadu_epi32(mask, wsum + n), _mm_set1_epi32(128));
    const __m128 sc = _mm_maskz_loadu_ps(mask, scale + n);
    for (int m = 0; m < MT; ++m) {
      const __m128i dot = _mm_sub_epi32(lane_sums4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]), corr);
      const __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(dot), _mm_set1_ps(r.scale[m0 + m])), sc);
      _mm_mask_storeu_ps(out + m * ldo + n, mask, v);
    }
  }
}

// Channels per panel call: the activations are loaded once per 32 channels.
constexpr int kPanelCols = 32;

template <int KV>
void a8_panels(const ByteRows& r, int64_t M, const int8_t* w, int64_t N, const float* scale, const int32_t* wsum,
               float* out) {
  // Two rows' activations in registers up to K = 640 (20 + 8 accumulators + 1 weight of 32), else one.
  constexpr int MT = KV <= 10 ? 2 : 1;
  for_each_tile(M, N, MT, kPanelCols, KV * kStep, [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
    if (MT == 2 && rows == 2)
      a8_panel<MT, KV>(r, m, w + n * KV * kStep, cols, scale + n, wsum + n, out + m * N + n, N);
    else
      a8_panel<1, KV>(r, m, w + n * KV * kStep, cols, scale + n, wsum + n, out + m * N + n, N);
  });
}

void int8_linear_a8_impl(const float* x, int64_t M, int64_t K, const int8_t* w, int64_t N, const float* scale,
                         const int32_t* wsum, float* out) {
  const ByteRows r = quantize_rows_a8(x, M, K);
  switch (K / kStep) {
#define LLMINFER_A8_PANEL(KV) \
  case KV: return a8_panels<KV>(r, M, w, N, scale, wsum, out);
    LLMINFER_A8_PANEL(1) LLMINFER_A8_PANEL(2) LLMINFER_A8_PANEL(3) LLMINFER_A8_PANEL(4)
    LLMINFER_A8_PANEL(5) LLMINFER_A8_PANEL(6) LLMINFER_A8_PANEL(7) LLMINFER_A8_PANEL(8)
    LLMINFER_A8_PANEL(9) LLMINFER_A8_PANEL(10) LLMINFER_A8_PANEL(11) LLMINFER_A8_PANEL(12)
    LLMINFER_A8_PANEL(13) LLMINFER_A8_PANEL(14) LLMINFER_A8_PANEL(15) LLMINFER_A8_PANEL(16)
#undef LLMINFER_A8_PANEL
    default: break;
  }
  for_each_tile(M, N, kA8Rows, kA8Cols, K, [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
    const int8_t* wt = w + n * K;
    float* o = out + m * N + n;
    switch (cols) {
      case 6: a8_rows<6>(rows, r, m, wt, K, scale + n, wsum + n, o, N); break;
      case 5: a8_rows<5>(rows, r, m, wt, K, scale + n, wsum + n, o, N); break;
      case 4: a8_rows<4>(rows, r, m, wt, K, scale + n, wsum + n, o, N); break;
      case 3: a8_rows<3>(rows, r, m, wt, K, scale + n, wsum + n, o, N); break;
      case 2: a8_rows<2>(rows, r, m, wt, K, scale + n, wsum + n, o, N); break;
      default: a8_rows<1>(rows, r, m, wt, K, scale + n, wsum + n, o, N); break;
    }
  });
}
#endif  // LLMINFER_Q8_512

}  // namespace

// int8_linear_a8: see the top of this file. K % 64 == 0; raises where the build has no AVX-512 VNNI.
at::Tensor int8_linear_a8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                          const at::Tensor& weight_sums) {
  const char* op = "int8_linear_a8";
  TORCH_CHECK(LLMINFER_Q8_512, op, ": this kernel build has no AVX-512 VNNI");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              op, ": weight must be a contiguous int8 [N, K] tensor with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K > 0 && K % 64 == 0 && K <= 65536, op, ": K must be a positive multiple of 64 up to 65536, got ", K);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.device().is_cpu(),
              op, ": scale must be a contiguous float32 [N] CPU tensor");
  TORCH_CHECK(weight_sums.dim() == 1 && weight_sums.size(0) == N && weight_sums.scalar_type() == at::kInt &&
                  weight_sums.is_contiguous() && weight_sums.device().is_cpu(),
              op, ": weight_sums must be a contiguous int32 [N] CPU tensor");
  at::Tensor out = at::empty({M, N}, x.options());
#if LLMINFER_Q8_512
  if (M > 0 && N > 0)
    int8_linear_a8_impl(x.data_ptr<float>(), M, K, weight.data_ptr<int8_t>(), N, scale.data_ptr<float>(),
                        weight_sums.data_ptr<int32_t>(), out.data_ptr<float>());
#endif
  return out;
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("int8_linear_a8(Tensor x, Tensor weight, Tensor scale, Tensor weight_sums) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("int8_linear_a8", &llminfer::int8_linear_a8); }
