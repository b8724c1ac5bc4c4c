// rms_norm: the Llama-family RMSNorm, y = weight * (x * (1 / sqrt(mean(x^2) + eps))) per row, in float32, as
// one op. torch runs it as six (pow, mean, add, rsqrt, mul, mul; torch.nn.functional.rms_norm included), each
// a dispatch and an allocation: about 40 us per norm at batch 1 on a 512-wide model, 17 norms a step on the
// bench model. Here it is about 1 us.
//
// The operations are transformers' (LlamaRMSNorm.forward in float32) in the same order; only the sum of squares
// differs from torch's reduction order (one vector accumulator over the row in order, then lane_sum), so
// results agree with torch to float32 rounding. A row's result never depends on the other rows or the threads.
#include "common.h"

#include <cmath>

namespace llminfer {
namespace {

void rms_norm_row(const float* x, const float* w, float* y, int64_t d, float eps) {
  int64_t k = 0;
  float sum = 0.f;
  {
    vec acc = vzero();
    for (; k + kLanes <= d; k += kLanes) {
      const vec v = vload(x + k);
      acc = vfma(v, v, acc);
    }
    sum = lane_sum(acc);
    for (; k < d; ++k) sum += x[k] * x[k];
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
  const vec vinv = vset1(inv);
  k = 0;
  for (; k + kLanes <= d; k += kLanes) vstore(y + k, vmul(vload(w + k), vmul(vload(x + k), vinv)));
  for (; k < d; ++k) y[k] = w[k] * (x[k] * inv);
}

}  // namespace

// rms_norm(x [..., d] float32, weight [d] float32, eps) -> [..., d] float32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm";
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, op, ": float32 only");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), op,
              ": x [..., d] and weight [d] disagree");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t d = wc.size(0);
  const int64_t rows = d ? xc.numel() / d : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // Threads only where the rows pay for a wake (a prefill chunk); a decode step's few rows run here.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, d));
  if (rows <= grain) {
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(xp + r * d, wp, yp + r * d, d, e);
  } else {
    parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * d, wp, yp + r * d, d, e);
    });
  }
  return y;
}

// add_rms_norm(x [..., d], delta [..., d] float32, weight [d], eps) -> (x + delta, rms_norm(x + delta)): a
// residual connection and the next norm in one op (the decoder loop's pre-norm layers), with the bits of
// torch's add followed by rms_norm above (an fp32 sum is one rounding however it is computed).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  const char* op = "add_rms_norm";
  TORCH_CHECK(x.device().is_cpu() && delta.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              op, ": float32 only");
  TORCH_CHECK(x.sizes() == delta.sizes(), op, ": x ", x.sizes(), " and delta ", delta.sizes(), " differ");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), op,
              ": x [..., d] and weight [d] disagree");
  const at::Tensor xc = x.contiguous(), dc = delta.contiguous(), wc = weight.contiguous();
  at::Tensor sum = at::empty_like(xc);
  at::Tensor y = at::empty_like(xc);
  const int64_t d = wc.size(0);
  const int64_t rows = d ? xc.numel() / d : 0;
  const float* xp = xc.data_ptr<float>();
  const float* dp = dc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const auto body = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t k = 0; k < d; ++k) sp[r * d + k] = xp[r * d + k] + dp[r * d + k];
      rms_norm_row(sp + r * d, wp, yp + r * d, d, e);
    }
  };
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, d));
  if (rows <= grain)
    body(0, rows);
  else
    parallel_for(0, rows, grain, body);
  return {sum, y};
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) {
  m.impl("rms_norm", &llminfer::rms_norm);
  m.impl("add_rms_norm", &llminfer::add_rms_norm);
}
