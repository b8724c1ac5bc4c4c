// rotary_qk: the Llama-family rotary position embedding ("rotate half") of a step's queries and keys, as one
// op. transformers' apply_rotary_pos_emb runs it as about a dozen (two concatenations, a negation, two
// products, a sum, per tensor), each a dispatch and an allocation: at batch 1 on the bench model that was the
// largest part of the decoder loop's own work outside the products (llminfer/backends/decoder_loop.py).
//
// The operations are transformers' in the same order, each rounded as torch rounds it (the build passes
// -ffp-contract=off, so no product is fused into the sum): for i < D/2
//   y[i]       = x[i] * cos[i]             + (-x[i + D/2]) * sin[i]
//   y[i + D/2] = x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
// and (-a) * b is -(a * b) exactly, so the outputs have torch's bits (tests/test_decoder_loop.py checks them).
#include "common.h"

namespace llminfer {
namespace {

void rotate_row(const float* __restrict x, const float* __restrict c, const float* __restrict s,
                float* __restrict y, int64_t half) {
  for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = 0; i < half; ++i) y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
}

// x [B, heads, T, D] (any strides, the last 1) rotated into a new contiguous tensor of the same shape, with
// cos/sin [B or 1, T, D] contiguous.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = x.size(0), heads = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  at::Tensor y = at::empty({B, heads, T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  const int64_t cos_batch = cos.size(0) == 1 ? 0 : T * D;
  const int64_t rows = B * heads * T;
  const auto body = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r % T, h = (r / T) % heads, b = r / (T * heads);
      const int64_t table = b * cos_batch + t * D;
      rotate_row(xp + b * sb + h * sh + t * st, cp + table, sp + table, yp + r * D, half);
    }
  };
  // Threads only where the rows pay for a wake (a prefill chunk); a decode step's few rows run here.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, D));
  if (rows <= grain)
    body(0, rows);
  else
    parallel_for(0, rows, grain, body);
  return y;
}

}  // namespace

// rotary_qk(q [B, H, T, D], k [B, H_kv, T, D], cos [B or 1, T, D], sin [B or 1, T, D]), all float32 on the
// CPU -> (q rotated, k rotated), contiguous, of q's and k's shapes.
std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin) {
  const char* op = "rotary_qk";
  for (const at::Tensor* t : {&q, &k, &cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, op, ": float32 CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.dim() == 3, op,
              ": q and k [B, heads, T, D], cos and sin [B or 1, T, D]");
  const int64_t B = q.size(0), T = q.size(2), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(2) == T && k.size(3) == D && D % 2 == 0, op,
              ": q and k disagree, or the head size is odd");
  TORCH_CHECK(cos.sizes() == sin.sizes() && (cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) == T &&
                  cos.size(2) == D, op, ": cos/sin shape ", cos.sizes(), " does not match q ", q.sizes());
  const at::Tensor qs = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor ks = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  return {rotate(qs, c, s), rotate(ks, c, s)};
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("rotary_qk", &llminfer::rotary_qk); }
