// bf16_linear: out[M, N] = bf16(x[M, K] @ w[N, K].T + bias[N]) on vdpbf16ps (the AVX-512 BF16 build only).
// Wrapper: llminfer/kernels/bf16_linear.py.
#include "common.h"

namespace llminfer {
namespace {

#if LLMINFER_KERNEL_BF16
// ------------------------------------------------------------------------------------------------
// bf16 products on vdpbf16ps (the BF16 build): out[M, N] = bf16(x[M, K] @ w[N, K].T + bias[N]).
//
// Why: a bf16 model read through torch's bf16 matmul at decode sizes pays oneDNN's per-call setup on every
// small layer (measured on a Xeon with AMX: 0.055-0.07 ms for a 512x1536 product at 1 row, against
// 0.03 ms for the same product in fp32 on skinny_linear.cpp), and bf16 weights are half the bytes of fp32.
//
// Each output element is one fixed sequence: acc (16 fp32 lanes) += the products of 32 bf16 pairs per
// instruction (exact in fp32, added pairwise, round to nearest even, denormals flushed: the instruction's
// rules) over k, then the fixed lane sum, + bias, then one rounding to bf16 (nearest even). So, as for the
// fp32 kernel, a row's result does not depend on M, the threads or the row's place in a tile.
using bf16_t = c10::BFloat16;
constexpr int64_t kBf16K = 32;  // bf16 values per vector: the path needs K % 32 == 0

inline __m512bh load_bf16(const bf16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// B: the bias element type (float or bf16; a bf16 bias is widened exactly, so both give the same bits).
template <int MT, int NT, typename B>
inline void bf16_micro_tile(const bf16_t* x, int64_t ldx, const bf16_t* w, int64_t K, const B* bias,
                            bf16_t* out, int64_t ldo) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  // A vector of 32 bf16 weights is one cache line: prefetch the same line of the next tile's row.
  if constexpr (MT == 1) {
    // One row (decode): each channel's weights in turn, one sequential stream (as in micro_tile); the same
    // instructions per output element as the interleaved loop below, so the same bits.
    for (int n = 0; n < NT; ++n) {
      const bf16_t* wn = w + n * K;
      __m512 a = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += kBf16K) {
        _mm_prefetch(reinterpret_cast<const char*>(wn + NT * K + k), _MM_HINT_T0);
        a = _mm512_dpbf16_ps(a, load_bf16(x + k), load_bf16(wn + k));
      }
      acc[0][n] = a;
    }
  } else {
    for (int64_t k = 0; k < K; k += kBf16K) {
      __m512bh wv[NT];
      for (int n = 0; n < NT; ++n) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + NT) * K + k), _MM_HINT_T0);
        wv[n] = load_bf16(w + n * K + k);
      }
      for (int m = 0; m < MT; ++m) {
        const __m512bh xv = load_bf16(x + m * ldx + k);
        for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float v = lane_sum(acc[m][n]);
      if (bias) v += static_cast<float>(bias[n]);
      out[m * ldo + n] = bf16_t(v);  // c10::BFloat16 rounds to nearest even
    }
}

// Calls f(rows, nt) with both as std::integral_constant: rows 1..kRows, nt 1..kCols.
template <typename F>
inline void with_tile_shape(int64_t rows, int64_t nt, F&& f) {
  auto by_rows = [&](auto cols) {
    switch (rows) {
      case 4: f(std::integral_constant<int, 4>{}, cols); break;
      case 3: f(std::integral_constant<int, 3>{}, cols); break;
      case 2: f(std::integral_constant<int, 2>{}, cols); break;
      default: f(std::integral_constant<int, 1>{}, cols); break;
    }
  };
  switch (nt) {
    case 6: by_rows(std::integral_constant<int, 6>{}); break;
    case 5: by_rows(std::integral_constant<int, 5>{}); break;
    case 4: by_rows(std::integral_constant<int, 4>{}); break;
    case 3: by_rows(std::integral_constant<int, 3>{}); break;
    case 2: by_rows(std::integral_constant<int, 2>{}); break;
    default: by_rows(std::integral_constant<int, 1>{}); break;
  }
}

template <typename B>
void bf16_linear_impl(const bf16_t* x, int64_t M, int64_t K, const bf16_t* w, int64_t N, const B* bias,
                      bf16_t* out) {
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(bf16_t));
  for_each_tile(M, N, kRows, kCols, row_bytes, [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
    with_tile_shape(rows, cols, [&](auto mt, auto nt) {
      bf16_micro_tile<decltype(mt)::value, decltype(nt)::value>(x + m * K, K, w + n * K, K, bias ? bias + n : nullptr,
                                                                out + m * N + n, N);
    });
  });
}
#endif  // LLMINFER_KERNEL_BF16

}  // namespace

// bf16_linear: x [M, K] bf16 @ weight [N, K] bf16 .T + bias [N] (bf16 or float32), bf16 [M, N] out, on
// vdpbf16ps (the BF16 build only; K % 32 == 0).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(LLMINFER_KERNEL_BF16, "bf16_linear: this build has no AVX-512 BF16 path (see bf16_supported())");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_linear: x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "bf16_linear: weight must be a contiguous bfloat16 [N, K] tensor with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K > 0 && K % 32 == 0, "bf16_linear: K must be a positive multiple of 32, got ", K);
  if (bias.has_value())  // read as it is (no per-call conversion: bf16 layers call this every step)
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->numel() == N && bias->is_contiguous() &&
                    (bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat),
                "bf16_linear: bias must be a contiguous bfloat16 or float32 [N] tensor on the CPU");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if LLMINFER_KERNEL_BF16
  const bf16_t* xp = x.data_ptr<at::BFloat16>();
  const bf16_t* wp = weight.data_ptr<at::BFloat16>();
  if (bias.has_value() && bias->scalar_type() == at::kBFloat16)
    bf16_linear_impl(xp, M, K, wp, N, bias->data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  else
    bf16_linear_impl(xp, M, K, wp, N, bias.has_value() ? bias->data_ptr<float>() : static_cast<const float*>(nullptr),
                     out.data_ptr<at::BFloat16>());
#endif
  return out;
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("bf16_linear", &llminfer::bf16_linear); }
