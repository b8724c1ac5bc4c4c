// softmax_draw: one token per row of logits, drawn from softmax(logits * inv_temperature) by inverse-CDF with
// one uniform per row, in one op (two passes over the row). Wrapper: llminfer/sampling/sampler.py.
//
// Why: the sampler's torch path (divide, softmax, then llminfer.sampling.sampler.inverse_cdf_draw) evaluates
// the exponentials in softmax and then reads the probabilities twice more, with an allocation per step: 2.5 ms
// of a 32-row step over a 151,646-token vocabulary on a 2-core Zen 4, about 9 % of an int4-wo serving step.
//
// The draw is inverse_cdf_draw's: exponentials e_j = exp((x_j - max) * inv_t), summed per block of 1024 tokens
// in float32, the block sums accumulated in float64 and searched for u * total, then that block's running sum in
// float64 searched for the token. e_j is computed by a polynomial (below, within 2 ulp of exp) and is exactly 0
// where (x_j - max) * inv_t < -87 (a masked token's -inf included), so a token of probability 0, or below
// 2^-125 of the row's largest, is never drawn. A row whose largest value is not finite (NaN, +inf) or whose sum
// is not positive gets -1: the caller draws it the torch way. Rows are independent of each other and of the
// thread count.
#include "common.h"

#include <cmath>

namespace llminfer {
namespace {

constexpr int64_t kBlock = 1024;
constexpr float kCutoff = -87.f;  // below: 0 (exp(-87) = 1.6e-38, the smallest normal floats' range)

// exp(v) for v <= 0: v = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for the reduction), then a degree-6
// Taylor polynomial of exp(r) (error below r^7 / 7! < 2^-23 for |r| <= 0.347) times 2^n; 0 where v < kCutoff.
#if LLMINFER_KERNEL_AVX512
inline vec vexp_nonpositive(vec v) {
  const __mmask16 keep = _mm512_cmp_ps_mask(v, _mm512_set1_ps(kCutoff), _CMP_GE_OQ);
  v = _mm512_max_ps(v, _mm512_set1_ps(kCutoff));
  const vec n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606820309417e-06f), r);
  vec p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(scale)));
}
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline float lane_max(vec v) { return _mm512_reduce_max_ps(v); }
inline bool any_unordered(vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
#else
inline vec vexp_nonpositive(vec v) {
  const __m256 keep = _mm256_cmp_ps(v, _mm256_set1_ps(kCutoff), _CMP_GE_OQ);
  v = _mm256_max_ps(v, _mm256_set1_ps(kCutoff));
  const vec n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606820309417e-06f), r);
  vec p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(scale)));
}
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline float lane_max(vec v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
inline bool any_unordered(vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
#endif

// e_j for the n (<= kBlock) logits at x into out; returns their float32 sum. The tail goes through the same
// vector code on a padded copy, so every e_j of a row is computed one way.
float exp_block(const float* x, int64_t n, float m, float inv_t, float* out) {
  const vec vm = vset1(m), vt = vset1(inv_t);
  vec acc = vzero();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vec e = vexp_nonpositive(vmul(vsub(vload(x + j), vm), vt));
    vstore(out + j, e);
    acc = vadd(acc, e);
  }
  if (j < n) {
    alignas(64) float pad[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) pad[i] = j + i < n ? x[j + i] : -INFINITY;
    const vec e = vexp_nonpositive(vmul(vsub(vload(pad), vm), vt));
    alignas(64) float tail[kLanes];
    vstore(tail, e);
    for (int64_t i = 0; j + i < n; ++i) out[j + i] = tail[i];
    acc = vadd(acc, e);  // the padding's e is 0
  }
  return lane_sum(acc);
}

int64_t draw_row(const float* x, int64_t V, float inv_t, double u, std::vector<double>& cum, float* block) {
  vec vm = vset1(-INFINITY);
  bool unordered = false;
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    const vec v = vload(x + j);
    unordered |= any_unordered(v);
    vm = vmax(vm, v);
  }
  float m = lane_max(vm);
  for (; j < V; ++j) {
    unordered |= std::isnan(x[j]);
    m = std::max(m, x[j]);
  }
  if (unordered || !std::isfinite(m) || !(inv_t > 0.f) || !std::isfinite(inv_t)) return -1;
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += exp_block(x + b * kBlock, std::min(kBlock, V - b * kBlock), m, inv_t, block);
    cum[b] = total;
  }
  if (!(total > 0.0)) return -1;
  const double target = u * total;
  int64_t b = 0;
  while (b < blocks && !(cum[b] > target)) ++b;
  if (b == blocks) {  // rounding put the target at or past the total: the last block holding mass
    b = blocks - 1;
    while (b > 0 && !(cum[b] > cum[b - 1])) --b;
  }
  const double before = b > 0 ? cum[b - 1] : 0.0;
  const int64_t n = std::min(kBlock, V - b * kBlock);
  exp_block(x + b * kBlock, n, m, inv_t, block);
  double run = before;
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (block[i] > 0.f) last = i;
    run += block[i];
    if (block[i] > 0.f && run > target) return b * kBlock + i;
  }
  return last >= 0 ? b * kBlock + last : -1;
}

}  // namespace

// softmax_draw(logits [S, V] float32, inv_temperature [S] float32, uniforms [S] float64 in [0, 1)) -> [S] int64.
at::Tensor softmax_draw(const at::Tensor& logits, const at::Tensor& inv_temperature, const at::Tensor& uniforms) {
  const char* op = "softmax_draw";
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2, op,
              ": logits must be [S, V] float32 on the CPU");
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(inv_temperature.scalar_type() == at::kFloat && inv_temperature.numel() == S &&
                  uniforms.scalar_type() == at::kDouble && uniforms.numel() == S,
              op, ": inv_temperature [S] float32 and uniforms [S] float64");
  const at::Tensor x = logits.contiguous(), t = inv_temperature.contiguous(), u = uniforms.contiguous();
  at::Tensor out = at::empty({S}, logits.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op_out = out.data_ptr<int64_t>();
  const auto body = [&](int64_t begin, int64_t end) {
    std::vector<double> cum(static_cast<size_t>((V + kBlock - 1) / kBlock + 1));
    std::vector<float> block(static_cast<size_t>(kBlock));
    for (int64_t r = begin; r < end; ++r) op_out[r] = V ? draw_row(xp + r * V, V, tp[r], up[r], cum, block.data()) : -1;
  };
  if (S <= 1)
    body(0, S);
  else
    parallel_for(0, S, 1, body);
  return out;
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("softmax_draw(Tensor logits, Tensor inv_temperature, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("softmax_draw", &llminfer::softmax_draw); }
