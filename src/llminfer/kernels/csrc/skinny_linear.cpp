// skinny_linear: out[M, N] = x[M, K] @ (w[N, K] * scale[N]).T + bias[N], float32 activations and
// accumulation, weights float32 or int8 (symmetric per output channel). Wrapper: llminfer/kernels/linear.py.
//
// Why: at decode M (the step's rows) is 1..64 while N and K are the model's, so the product is bound by
// the weight bytes read, not by FLOPs. torch's fp32 kernels stream the weights at well under the memory
// bandwidth on some CPUs, and its int8 weight-only kernel dequantizes the weight again for every
// activation row. Here each thread takes a range of output channels and, for NT channels at a time,
// reads (and for int8 converts) their weight once per MT activation rows, accumulating in vector registers.
// Prefill-sized products (more than MT rows) run here too, blocked for the caches, because torch's GEMM
// gives a row different bits at different M.
//
// Every output element is one fixed sequence of fp32 FMAs over k (kLanes lanes, then a fixed lane sum,
// then scale and bias: the build passes -ffp-contract=off so that epilogue is never fused in one code
// path and not in another), so a row's result does not depend on M, on the thread count or on where the
// row falls in a tile (it does depend on the ISA the kernel was built for: AVX2 and AVX-512 sum in
// different orders).
#include "common.h"

namespace llminfer {
namespace {

// Rows per streamed tile: one weight vector loaded, then one FMA for each of up to 8 rows. For fp32 weights
// larger than any cache (kStreamMinBytes: an LM head), up to 8 rows read the weights once from memory at
// about the memory's bandwidth (measured on Zen 4, fp32 LM head 151646 x 512, 2 threads: 8 rows 16.3 -> 10.0
// ms against two groups of 4 from L2 blocks, 4 rows 13.4 -> 7.7). Weights that a cache can hold, and int8
// weights (converted per vector), ran 5-45 % slower streamed at 2-16 rows than in the interleaved tiles, on
// both builds, so they keep those (one row always streams).
constexpr int64_t kStreamRows = 8;
constexpr int64_t kStreamMinBytes = int64_t{32} << 20;

// MT activation rows times NT weight rows over the whole of K (K % 8 == 0). kStream: the weights come from
// memory (decode), so each channel is read in turn as one sequential stream against all MT rows (the rows
// stay in L1); otherwise (weights in L2, prefill) the NT channels are read side by side so that each
// activation vector loaded serves NT FMAs. Each output element gets the very same FMAs in the same order
// either way (only the order across channels changes), so its bits do not change.
template <bool kStream, int MT, int NT, typename W>
inline void micro_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, const float* scale,
                       const float* bias, float* out, int64_t ldo) {
  vec acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = vzero();
  // A cache line of weights at a time, prefetching the same line of the next NT rows (the next tile):
  // the hardware prefetcher alone leaves the int8 loop waiting on memory (measured on Zen: 3.5 -> 5.5 G
  // weights/s on one thread). Prefetching past the end of the weights is harmless (no fault).
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(W));
  static_assert(kLine % kLanes == 0, "a cache line holds whole vectors");
  constexpr std::false_type kFull{};
  if constexpr (kStream || MT == 1) {
    // Each weight vector loaded serves MT FMAs, so reading from memory stays the bound; one stream at a time
    // is what the prefetchers follow best.
    for (int n = 0; n < NT; ++n) {
      const W* wn = w + n * ldw;
      vec a[MT];
      for (int m = 0; m < MT; ++m) a[m] = vzero();
      // always_inline: GCC otherwise kept such lambdas out of line, so every vector step was a call that
      // loaded and stored all the accumulators.
      auto step = [&](int64_t k, auto half) __attribute__((always_inline)) {
        constexpr bool kHalf = decltype(half)::value;
        const vec wv = kHalf ? vload_half(wn + k) : vload(wn + k);
        for (int m = 0; m < MT; ++m) a[m] = vfma(kHalf ? vload_half(x + m * ldx + k) : vload(x + m * ldx + k), wv, a[m]);
      };
      int64_t k = 0;
      for (; k + kLine <= K; k += kLine) {
        // Into L2 only: prefetches into L1 held the line-fill buffers that the loads of the row in hand
        // were waiting for (measured on Zen 4, fp32 LM head, 2 threads, 4 rows: 11.1 -> 8.9 ms).
        _mm_prefetch(reinterpret_cast<const char*>(wn + NT * ldw + k), _MM_HINT_T1);
        for (int64_t j = k; j < k + kLine; j += kLanes) step(j, kFull);
      }
      for (; k + kLanes <= K; k += kLanes) step(k, kFull);
      if (k < K) step(k, std::true_type{});  // AVX-512 only (with 8 lanes K % 8 == 0 leaves no half)
      for (int m = 0; m < MT; ++m) acc[m][n] = a[m];
    }
  } else {
    // One vector of columns from k; kHalf: the last 8 columns of a row, upper lanes zero in both operands.
    // always_inline: see above (measured on Zen 4: the int8 LM head 6.9 -> 5.9 ms on 2 threads).
    auto step = [&](int64_t k, auto half) __attribute__((always_inline)) {
      constexpr bool kHalf = decltype(half)::value;
      vec wv[NT];
      for (int n = 0; n < NT; ++n) wv[n] = kHalf ? vload_half(w + n * ldw + k) : vload(w + n * ldw + k);
      for (int m = 0; m < MT; ++m) {
        const vec xv = kHalf ? vload_half(x + m * ldx + k) : vload(x + m * ldx + k);
        for (int n = 0; n < NT; ++n) acc[m][n] = vfma(xv, wv[n], acc[m][n]);
      }
    };
    int64_t k = 0;
    for (; k + kLine <= K; k += kLine) {
      for (int n = 0; n < NT; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + NT) * ldw + k), _MM_HINT_T0);
      for (int64_t j = k; j < k + kLine; j += kLanes) step(j, kFull);
    }
    for (; k + kLanes <= K; k += kLanes) step(k, kFull);
    if (k < K) step(k, std::true_type{});  // AVX-512 only (with 8 lanes K % 8 == 0 leaves no half)
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float v = lane_sum(acc[m][n]);
      if (scale) v *= scale[n];
      if (bias) v += bias[n];
      out[m * ldo + n] = v;
    }
}

// One tile: `rows` activation rows (1..kStreamRows streamed, 1..kRows otherwise) times NT weight rows.
template <bool kStream, int NT, typename W>
inline void row_tile(int64_t rows, const float* x, int64_t K, const W* w, int64_t ldw, const float* scale,
                     const float* bias, float* out, int64_t N) {
  if constexpr (kStream) {  // MT + 1 vector registers, so up to kStreamRows rows fit even in AVX2's 16
    switch (rows) {
      case 8: micro_tile<true, 8, NT>(x, K, w, ldw, K, scale, bias, out, N); return;
      case 7: micro_tile<true, 7, NT>(x, K, w, ldw, K, scale, bias, out, N); return;
      case 6: micro_tile<true, 6, NT>(x, K, w, ldw, K, scale, bias, out, N); return;
      case 5: micro_tile<true, 5, NT>(x, K, w, ldw, K, scale, bias, out, N); return;
      default: break;
    }
  }
  switch (rows) {
    case 4: micro_tile<kStream, 4, NT>(x, K, w, ldw, K, scale, bias, out, N); break;
    case 3: micro_tile<kStream, 3, NT>(x, K, w, ldw, K, scale, bias, out, N); break;
    case 2: micro_tile<kStream, 2, NT>(x, K, w, ldw, K, scale, bias, out, N); break;
    default: micro_tile<kStream, 1, NT>(x, K, w, ldw, K, scale, bias, out, N); break;
  }
}

// The tile of output channels [n, n + nt) (nt <= kCols) for activation rows [m, m + rows).
template <bool kStream, typename W>
inline void tile(int64_t nt, int64_t rows, const float* x, int64_t K, const W* w, const float* scale,
                 const float* bias, float* out, int64_t N) {
  switch (nt) {
#if LLMINFER_KERNEL_AVX512
    case 6: row_tile<kStream, 6>(rows, x, K, w, K, scale, bias, out, N); break;
    case 5: row_tile<kStream, 5>(rows, x, K, w, K, scale, bias, out, N); break;
    case 4: row_tile<kStream, 4>(rows, x, K, w, K, scale, bias, out, N); break;
#endif
    case 3: row_tile<kStream, 3>(rows, x, K, w, K, scale, bias, out, N); break;
    case 2: row_tile<kStream, 2>(rows, x, K, w, K, scale, bias, out, N); break;
    default: row_tile<kStream, 1>(rows, x, K, w, K, scale, bias, out, N); break;
  }
}

// The weights of channels [n0, n1) as fp32: the weights themselves, or (int8) a thread-local copy
// converted exactly (every int8 is a float); the products are the same FMAs either way.
inline const float* block_weights(const float* w, int64_t n0, int64_t, int64_t K) { return w + n0 * K; }
inline const float* block_weights(const int8_t* w, int64_t n0, int64_t n1, int64_t K) {
  thread_local std::vector<float> converted;
  converted.resize(static_cast<size_t>((n1 - n0) * K));
  const int8_t* src = w + n0 * K;
  for (int64_t i = 0; i < (n1 - n0) * K; i += kLanes) {
    if (i + kLanes <= (n1 - n0) * K)
      vstore(converted.data() + i, vload(src + i));
    else
      vstore_half(converted.data() + i, vload_half(src + i));
  }
  return converted.data();
}

template <typename W>
void skinny_linear_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* scale,
                        const float* bias, float* out) {
  const int64_t tiles = (N + kCols - 1) / kCols;
  // Enough tiles per task that a task reads at least ~64 KB of weights.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kCols * K * static_cast<int64_t>(sizeof(W))));
  const bool stream = std::is_same<W, float>::value && N * K * static_cast<int64_t>(sizeof(W)) >= kStreamMinBytes;
  // Up to this many rows each tile's weights are read once, straight from memory, for every group of rows
  // (int8 weights converted in registers each time); beyond, blocks of tiles are held in L2 (int8: one
  // converted copy of a block, kBlockBytes, costs less than converting again for each group).
  const int64_t direct_rows = stream ? kStreamRows : std::is_same<W, int8_t>::value ? 4 * kRows : kRows;
  const int64_t group_rows = stream ? kStreamRows : kRows;
  parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    if (M <= direct_rows) {  // decode
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * kCols;
        for (int64_t m = 0; m < M; m += group_rows) {
          const int64_t nt = std::min<int64_t>(kCols, N - n), rows = std::min<int64_t>(group_rows, M - m);
          const float* sc = scale ? scale + n : nullptr;
          const float* b = bias ? bias + n : nullptr;
          if (stream)
            tile<true>(nt, rows, x + m * K, K, w + n * K, sc, b, out + m * N + n, N);
          else
            tile<false>(nt, rows, x + m * K, K, w + n * K, sc, b, out + m * N + n, N);
        }
      }
      return;
    }
    // More rows (prefill): a block of tiles whose fp32 weights fit in L2, then every group of kRows rows
    // over the whole block, so each group of rows is read from L1 and each weight from L2. The loop order
    // changes which tile runs when, not the operations of any output element.
    const int64_t block_tiles = std::max<int64_t>(1, kBlockBytes / (kCols * K * static_cast<int64_t>(sizeof(float))));
    for (int64_t b0 = begin; b0 < end; b0 += block_tiles) {
      const int64_t b1 = std::min(end, b0 + block_tiles);
      const int64_t n0 = b0 * kCols, n1 = std::min(N, b1 * kCols);
      const float* wb = block_weights(w, n0, n1, K);
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - m);
        for (int64_t n = n0; n < n1; n += kCols)
          tile<false>(std::min<int64_t>(kCols, n1 - n), rows, x + m * K, K, wb + (n - n0) * K, scale ? scale + n : nullptr,
               bias ? bias + n : nullptr, out + m * N + n, N);
      }
    }
  });
}

}  // namespace

LinearArgs check_linear_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1), op,
              ": weight must be a contiguous [N, K] tensor with x's K");
  LinearArgs a{x.size(0), x.size(1), weight.size(0), nullptr, nullptr};
  TORCH_CHECK(a.K > 0 && a.K % 8 == 0, op, ": K must be a positive multiple of 8, got ", a.K);
  if (scale.has_value()) {
    TORCH_CHECK(scale->device().is_cpu() && scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->dim() == 1 && scale->numel() == a.N, op,
                ": scale must be a contiguous float32 [N] tensor");
    a.scale = scale->data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->numel() == a.N, op,
                ": bias must be a contiguous float32 [N] tensor");
    a.bias = bias->data_ptr<float>();
  }
  return a;
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias) {
  const LinearArgs a = check_linear_args("skinny_linear", x, weight, scale, bias);
  const int64_t M = a.M, K = a.K, N = a.N;
  const float* scale_p = a.scale;
  const float* bias_p = a.bias;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (weight.scalar_type() == at::kFloat) {
    skinny_linear_impl(x.data_ptr<float>(), M, K, weight.data_ptr<float>(), N, scale_p, bias_p,
                       out.data_ptr<float>());
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kChar, "skinny_linear: weight must be float32 or int8");
    skinny_linear_impl(x.data_ptr<float>(), M, K, weight.data_ptr<int8_t>(), N, scale_p, bias_p,
                       out.data_ptr<float>());
  }
  return out;
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? scale=None, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("skinny_linear", &llminfer::skinny_linear); }
