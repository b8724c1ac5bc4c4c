// int8_group_linear: out[M, N] = x[M, K] @ W.T + bias for int8-wo's group-wise weights (every build: AVX2,
// AVX-512, AVX-512 VNNI), loaded with the other sources by llminfer/backends/cpu_kernels.py.
//
// Weights: codes c[n, k] in [0, 255] (uint8, [N, K] row-major) and, per output channel n and group
// g = k / G of G input columns, a float32 scale s[n, g] and minimum z[n, g]:
//   W[n, k] = c[n, k] * s[n, g] + z[n, g].
// Both grids a group can take are this form: the asymmetric one (z the group's minimum, s its range / 255)
// and the symmetric one of a GGUF Q8_0 block (s = d, z = -128 d, c = q + 128); see
// llminfer.backends.int8_group.quantize_int8_groupwise.
//
// Activations are rounded per row to 14 bits as int8_linear's VNNI path does: sx = max|x| / 8191,
// qx = round(x / sx) (to nearest even) in [-8191, 8191] as int16. The codes are widened to int16 and
// multiplied with vpmaddwd (AVX2, AVX-512 BW) or vpdpwssd (AVX-512 VNNI): pairs of products added into
// int32 lanes, exact (a group's sum is at most 256 * 255 * 8191 < 2^31). Then
//   out[m, n] = sx[m] * (sum_g s[n, g] * dot_g + sum_g z[n, g] * xsum[m, g]) + bias[n],
// dot_g = sum_{k in g} qx[m, k] * c[n, k] and xsum[m, g] the group's sum of qx: llama.cpp's Q4_1 x Q8_1 block
// product (the minimum times the activations' block sum), with 8-bit codes and 14-bit activations.
// Per group the int32 lanes become float32 and are added with one FMA by s[n, g] into one of two
// accumulators (even and odd groups); every output element is this one fixed sequence whatever M, the
// threads or the tile, so a row's result does not depend on the batch (the build passes -ffp-contract=off).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kGroupActMax = 8191;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
// 32 int16 columns per vector.
using ivec = __m512i;
using fvec = __m512;
constexpr int64_t kVecCols = 32;
inline ivec load_codes(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline ivec load_act(const int16_t* p) { return _mm512_loadu_si512(p); }
inline ivec izero() { return _mm512_setzero_si512(); }
#if defined(__AVX512VNNI__)
inline ivec dot_add(ivec acc, ivec a, ivec b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
inline ivec dot_add(ivec acc, ivec a, ivec b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
inline fvec fzero() { return _mm512_setzero_ps(); }
inline fvec to_float(ivec v) { return _mm512_cvtepi32_ps(v); }
inline fvec fset1(float a) { return _mm512_set1_ps(a); }
inline fvec fload(const float* p) { return _mm512_loadu_ps(p); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec fadd(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline float fsum(fvec v) {  // a fixed order: halves, then 8 lanes
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}
#else
// 16 int16 columns per vector (AVX2: 16 registers).
using ivec = __m256i;
using fvec = __m256;
constexpr int64_t kVecCols = 16;
inline ivec load_codes(const uint8_t* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline ivec load_act(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec izero() { return _mm256_setzero_si256(); }
#if defined(__AVXVNNI__)
inline ivec dot_add(ivec acc, ivec a, ivec b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#else
inline ivec dot_add(ivec acc, ivec a, ivec b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif
inline fvec fzero() { return _mm256_setzero_ps(); }
inline fvec to_float(ivec v) { return _mm256_cvtepi32_ps(v); }
inline fvec fset1(float a) { return _mm256_set1_ps(a); }
inline fvec fload(const float* p) { return _mm256_loadu_ps(p); }
inline fvec ffma(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec fadd(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline float fsum(fvec v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}
#endif

// Each row rounded on its own to 14 bits (AVX2 code: every build has it). scale[m] is NaN where the row holds
// a NaN or an infinity, which makes its outputs NaN as a float product's would be; 0 for an all-zero row.
void quantize_rows14(const float* x, int64_t M, int64_t K, int16_t* q, double* scale) {
  llminfer::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      __m256 mx = _mm256_setzero_ps();
      bool finite = true;
      for (int64_t k = 0; k < K; k += 8) {
        const __m256 v = _mm256_loadu_ps(row + k);
        finite = finite && _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) == 0;
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      const float amax = *std::max_element(lanes, lanes + 8);
      finite = finite && std::isfinite(amax);
      int16_t* qr = q + m * K;
      if (!finite || amax == 0.f) {
        std::fill(qr, qr + K, static_cast<int16_t>(0));
        scale[m] = finite ? 0.0 : std::nan("");
        continue;
      }
      const float sx = amax / static_cast<float>(kGroupActMax);
      scale[m] = static_cast<double>(sx);
      const __m256 vsx = _mm256_set1_ps(sx);
      const __m256i lo = _mm256_set1_epi32(-kGroupActMax), hi = _mm256_set1_epi32(kGroupActMax);
      for (int64_t k = 0; k < K; k += 8) {
        // cvtps rounds to nearest even (the default MXCSR mode), as torch.round does
        __m256i qi = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(row + k), vsx));
        qi = _mm256_min_epi32(_mm256_max_epi32(qi, lo), hi);
        const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k), packed);
      }
    }
  });
}

// Rows [m0, m0 + MT) times channels [n0, n0 + NT): sums[m * NT + j] = sum_g s[n, g] * dot_g +
// sum_g z[n, g] * xsum[m, g] for n = n0 + j. Each activation vector is loaded once for the NT channels and
// each code vector once for the MT rows. Even and odd groups go to two accumulators (half the FMA chain's
// latency); the minima's term is a dot product over the groups, kVecCols / 2 at a time. Every output element
// is this one sequence whatever MT and NT, so a row's result does not depend on the batch.
template <int MT, int NT, int G>
inline void group_tile(const int16_t* q, int64_t m0, const uint8_t* codes, int64_t K, const float* s,
                       const float* z, const float* xsum, float* sums) {
  constexpr int64_t kFloatLanes = kVecCols / 2;
  const int64_t groups = K / G;
  fvec acc0[MT][NT], acc1[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc0[m][j] = acc1[m][j] = fzero();
  auto group = [&](int64_t g, fvec (*acc)[NT]) __attribute__((always_inline)) {
    ivec dot[MT][NT];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NT; ++j) dot[m][j] = izero();
    // The next tile's codes (the NT * K bytes after this tile's), streamed in over this tile's groups.
    const char* next = reinterpret_cast<const char*>(codes + NT * K);
    for (int64_t b = g * NT * G; b < (g + 1) * NT * G; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    for (int64_t k = g * G; k < (g + 1) * G; k += kVecCols) {
      ivec w[NT];
      for (int j = 0; j < NT; ++j) w[j] = load_codes(codes + j * K + k);
      for (int m = 0; m < MT; ++m) {
        const ivec a = load_act(q + (m0 + m) * K + k);
        for (int j = 0; j < NT; ++j) dot[m][j] = dot_add(dot[m][j], a, w[j]);
      }
    }
    for (int j = 0; j < NT; ++j) {
      const fvec sg = fset1(s[j * groups + g]);
      for (int m = 0; m < MT; ++m) acc[m][j] = ffma(to_float(dot[m][j]), sg, acc[m][j]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    group(g, acc0);
    group(g + 1, acc1);
  }
  if (g < groups) group(g, acc0);
  for (int m = 0; m < MT; ++m) {
    const float* xs = xsum + (m0 + m) * groups;
    for (int j = 0; j < NT; ++j) {
      const float* zj = z + j * groups;
      fvec t = fzero();
      int64_t h = 0;
      for (; h + kFloatLanes <= groups; h += kFloatLanes) t = ffma(fload(zj + h), fload(xs + h), t);
      float tail = 0.f;
      for (; h < groups; ++h) tail += zj[h] * xs[h];
      sums[m * NT + j] = fsum(fadd(fadd(acc0[m][j], acc1[m][j]), t)) + tail;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
constexpr int kTileCols = 4;  // 2 rows x 4 channels: 8 dots + 16 accumulators + 4 codes + 1 activation of 32
#else
constexpr int kTileCols = 2;  // 2 x 2: 4 + 8 + 2 + 1 of 16
#endif
constexpr int kTileRows = 2;

template <int MT, int G>
inline void group_cols(int64_t cols, const int16_t* q, int64_t m, const uint8_t* cn, int64_t K, const float* sn,
                       const float* zn, const float* xsum, float* sums) {
  switch (cols) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
    case 4: group_tile<MT, 4, G>(q, m, cn, K, sn, zn, xsum, sums); break;
    case 3: group_tile<MT, 3, G>(q, m, cn, K, sn, zn, xsum, sums); break;
#endif
    case 2: group_tile<MT, 2, G>(q, m, cn, K, sn, zn, xsum, sums); break;
    default: group_tile<MT, 1, G>(q, m, cn, K, sn, zn, xsum, sums); break;
  }
}

template <int G>
inline void group_any_rows(int64_t rows, int64_t cols, const int16_t* q, int64_t m, const uint8_t* cn, int64_t K,
                           const float* sn, const float* zn, const float* xsum, float* sums) {
  if (rows == 2) group_cols<2, G>(cols, q, m, cn, K, sn, zn, xsum, sums);
  else group_cols<1, G>(cols, q, m, cn, K, sn, zn, xsum, sums);
}

inline void group_dispatch(int64_t rows, int64_t cols, const int16_t* q, int64_t m, const uint8_t* cn, int64_t K,
                           int64_t G, const float* sn, const float* zn, const float* xsum, float* sums) {
  switch (G) {
    case 32: group_any_rows<32>(rows, cols, q, m, cn, K, sn, zn, xsum, sums); break;
    case 64: group_any_rows<64>(rows, cols, q, m, cn, K, sn, zn, xsum, sums); break;
    case 128: group_any_rows<128>(rows, cols, q, m, cn, K, sn, zn, xsum, sums); break;
    default: group_any_rows<256>(rows, cols, q, m, cn, K, sn, zn, xsum, sums); break;
  }
}

// Channels in blocks of about kBlockBytes of codes: a block stays in L2 while every group of kGroupRows rows
// passes over it (at decode there is one pass, straight from memory). Blocks run in parallel.
constexpr int64_t kBlockBytes = 192 * 1024;

void int8_group_linear_impl(const float* x, int64_t M, int64_t K, const uint8_t* codes, int64_t N, int64_t G,
                            const float* scale, const float* minimum, const float* bias, float* out) {
  std::vector<int16_t> q(static_cast<size_t>(M * K));
  std::vector<double> sx(static_cast<size_t>(M));
  quantize_rows14(x, M, K, q.data(), sx.data());
  const int64_t groups = K / G;
  std::vector<float> xsum(static_cast<size_t>(M * groups));  // exact integers (|sum| <= 256 * 8191)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      int32_t t = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) t += q[m * K + k];
      xsum[m * groups + g] = static_cast<float>(t);
    }
  const int64_t block = std::max<int64_t>(1, kBlockBytes / K);
  const int64_t blocks = (N + block - 1) / block;
  llminfer::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * block, n1 = std::min(N, n0 + block);
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, M - m);
        for (int64_t n = n0; n < n1; n += kTileCols) {
          const int64_t cols = std::min<int64_t>(kTileCols, n1 - n);
          float sums[kTileRows * kTileCols];
          group_dispatch(rows, cols, q.data(), m, codes + n * K, K, G, scale + n * groups, minimum + n * groups,
                         xsum.data(), sums);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < cols; ++j) {
              float v = static_cast<float>(static_cast<double>(sums[i * cols + j]) * sx[m + i]);
              if (bias) v += bias[n + j];
              out[(m + i) * N + n + j] = v;
            }
        }
      }
    }
  });
}

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                             const at::Tensor& minimum, int64_t group_size, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "int8_group_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_group_linear: x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), G = group_size;
  TORCH_CHECK((G == 32 || G == 64 || G == 128 || G == 256) && K > 0 && K % G == 0,
              "int8_group_linear: group_size must be 32, 64, 128 or 256 and divide K, got group_size ", G,
              " and K ", K);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(1) == K,
              "int8_group_linear: codes must be a contiguous uint8 [N, K] tensor");
  const int64_t N = codes.size(0);
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == N && t->size(1) == K / G,
                "int8_group_linear: scale and minimum must be contiguous float32 [N, K / group_size] CPU tensors");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "int8_group_linear: bias must be a contiguous float32 [N] CPU tensor");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  int8_group_linear_impl(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), N, G, scale.data_ptr<float>(),
                         minimum.data_ptr<float>(), b, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("int8_group_linear(Tensor x, Tensor codes, Tensor scale, Tensor minimum, int group_size, "
        "Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("int8_group_linear", &int8_group_linear); }
