// screen_candidates: the argmax screen's second half (llminfer/kernels/argmax_screen.py) in one pass per row:
// find the tokens whose approximate logit reaches the row's threshold and overwrite each with its float32
// score dot(x[r], weight[j]), read from the fp32 weight. Replaces a compare over [R, V], a scan, two gathers
// of candidate rows and a scatter, which allocated and copied about 4 KB per candidate.
//
// A candidate's score is one fixed sequence of operations (vector FMAs over d in order, then lane_sum), so a
// row's scores do not depend on R, the threads or which other tokens are candidates.
#include "common.h"

#include <atomic>

namespace llminfer {
namespace {

// float32 dot product of x and w (d % 8 == 0), the fixed sequence above.
inline float dot_row(const float* x, const float* w, int64_t d) {
  vec acc = vzero();
  int64_t k = 0;
  for (; k + kLanes <= d; k += kLanes) acc = vfma(vload(x + k), vload(w + k), acc);
  if (k < d) acc = vfma(vload_half(x + k), vload_half(w + k), acc);
  return lane_sum(acc);
}

// The candidates of one row: returns their count, or -1 past `max_candidates` (the row is then left as it
// was up to the candidate where it stopped; the caller discards the logits).
int64_t score_row(float* logits, int64_t V, float threshold, const float* weight, const float* x, int64_t d,
                  int64_t max_candidates) {
  int64_t count = 0;
  int64_t j = 0;
#if LLMINFER_KERNEL_AVX512
  const __m512 t = _mm512_set1_ps(threshold);
  for (; j + 16 <= V; j += 16) {
    uint32_t hits = _mm512_cmp_ps_mask(_mm512_loadu_ps(logits + j), t, _CMP_GE_OQ);
#else
  const __m256 t = _mm256_set1_ps(threshold);
  for (; j + 8 <= V; j += 8) {
    uint32_t hits = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(logits + j), t, _CMP_GE_OQ)));
#endif
    while (hits) {
      const int64_t c = j + __builtin_ctz(hits);
      hits &= hits - 1;
      if (++count > max_candidates) return -1;
      logits[c] = dot_row(x, weight + c * d, d);
    }
  }
  for (; j < V; ++j) {
    if (logits[j] >= threshold) {
      if (++count > max_candidates) return -1;
      logits[j] = dot_row(x, weight + j * d, d);
    }
  }
  return count;
}

}  // namespace

// screen_candidates(logits [R, V] float32 (in place), threshold [R] float32, weight [V, d] float32, x [R, d]
// float32, max_candidates): the total number of candidates, or -1 where a row has more than max_candidates.
int64_t screen_candidates(const at::Tensor& logits, const at::Tensor& threshold, const at::Tensor& weight,
                          const at::Tensor& x, int64_t max_candidates) {
  const char* op = "screen_candidates";
  for (const at::Tensor* t : {&logits, &threshold, &weight, &x})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(), op,
                ": contiguous float32 CPU tensors only");
  TORCH_CHECK(logits.dim() == 2 && weight.dim() == 2 && x.dim() == 2 && threshold.dim() == 1, op,
              ": logits [R, V], threshold [R], weight [V, d], x [R, d]");
  const int64_t R = logits.size(0), V = logits.size(1), d = weight.size(1);
  TORCH_CHECK(weight.size(0) == V && x.size(0) == R && x.size(1) == d && threshold.size(0) == R, op,
              ": shapes disagree (logits [R, V], threshold [R], weight [V, d], x [R, d])");
  TORCH_CHECK(d % 8 == 0, op, ": d must be a multiple of 8, got ", d);
  TORCH_CHECK(max_candidates >= 0, op, ": max_candidates must be >= 0, got ", max_candidates);
  float* lp = logits.data_ptr<float>();
  const float* tp = threshold.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  std::atomic<int64_t> total{0};
  std::atomic<bool> too_many{false};
  parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end && !too_many.load(std::memory_order_relaxed); ++r) {
      const int64_t n = score_row(lp + r * V, V, tp[r], wp, xp + r * d, d, max_candidates);
      if (n < 0) too_many.store(true, std::memory_order_relaxed);
      else total.fetch_add(n, std::memory_order_relaxed);
    }
  });
  return too_many.load() ? -1 : total.load();
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("screen_candidates(Tensor(a!) logits, Tensor threshold, Tensor weight, Tensor x, int max_candidates) -> int");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) { m.impl("screen_candidates", &llminfer::screen_candidates); }
