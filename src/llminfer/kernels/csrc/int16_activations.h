// Activation rows rounded to 14 bits (int16) for vpdpwssd: the integer path of int8_linear.cpp and
// int4_linear.cpp (the VNNI build only).
#pragma once

#include "common.h"

#if LLMINFER_KERNEL_VNNI
namespace llminfer {

// Each activation row is quantized on its own to 14 bits: sx = max|x| / 8191 (float32), q = round(x / sx)
// (to nearest even) in [-8191, 8191], stored as int16.
constexpr int kActMax = 8191;

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
  parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      bool finite;
      const float amax = row_abs_max(row, K, &finite);
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

}  // namespace llminfer
#endif  // LLMINFER_KERNEL_VNNI
