// Paged decode attention: one query token per sequence, K/V read in place from the block pool.
//
//   query  [B, H, D]      float32, any strides for B and H, D contiguous
//   k, v   [H_kv, num_blocks, block_size, D]   float32 or bfloat16 (widened exactly to float32 as they are
//                                              read), contiguous (llminfer's head-major pool)
//   block_tables [B, W]   int64, contiguous; ctx_lens [B] int64 (tokens of context, >= 1)
//   out    [B, H, D]      float32, contiguous
//
// Query head h reads K/V head h / (H / H_kv) (grouped-query attention in HF's repeat_kv order). Each
// (sequence, K/V head) is one task: scores for its G query heads over the whole context, an exact
// softmax (max subtracted, fp32), then the probability-weighted sum of V in context order. A row's
// result does not depend on the batch, the padding of the block table or the thread count.
// Wrapper: llminfer/backends/attention.py.
#include "common.h"

namespace llminfer {
namespace {

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  vec acc0 = vzero(), acc1 = vzero();
  int64_t i = 0;
  for (; i + 2 * kLanes <= d; i += 2 * kLanes) {
    acc0 = vfma(vload(a + i), vload(b + i), acc0);
    acc1 = vfma(vload(a + i + kLanes), vload(b + i + kLanes), acc1);
  }
  for (; i + kLanes <= d; i += kLanes) acc0 = vfma(vload(a + i), vload(b + i), acc0);
  if (i < d) acc1 = vfma(vload_half(a + i), vload_half(b + i), acc1);  // AVX-512: the last 8
  return lane_sum(vadd(acc0, acc1));
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t d) {
  const vec a = vset1(alpha);
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) vstore(y + i, vfma(a, vload(x + i), vload(y + i)));
  if (i < d) vstore_half(y + i, vfma(a, vload_half(x + i), vload_half(y + i)));  // AVX-512: the last 8
}

// The attention of every (sequence, K/V head) task for K/V caches of element type T (float or bf16).
template <typename T>
void paged_decode_attention_impl(const float* q, int64_t sq_b, int64_t sq_h, const T* kc, const T* vc,
                                 const int64_t* tables, const int64_t* lens, int64_t B, int64_t H, int64_t H_kv,
                                 int64_t num_blocks, int64_t block_size, int64_t D, int64_t W, float sc, float* o) {
  const int64_t G = H / H_kv;
  parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H_kv, h = task % H_kv;
      const int64_t L = lens[b];
      scores.resize(static_cast<size_t>(G * L));
      const T* head_k = kc + h * num_blocks * block_size * D;
      const T* head_v = vc + h * num_blocks * block_size * D;
      for (int64_t t = 0; t < L; ++t) {
        const T* kt = head_k + (tables[b * W + t / block_size] * block_size + t % block_size) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(q + b * sq_b + (h * G + g) * sq_h, kt, D) * sc;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        float mx = s[0];
        for (int64_t t = 1; t < L; ++t) mx = std::max(mx, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - mx);
          total += s[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      float* ob = o + (b * H + h * G) * D;
      std::fill(ob, ob + G * D, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* vt = head_v + (tables[b * W + t / block_size] * block_size + t % block_size) * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + t], vt, ob + g * D, D);
      }
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.stride(2) == 1,
              "paged_decode_attention: query must be float32 [B, H, D] with D contiguous");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && (kv_type == at::kFloat || kv_type == at::kBFloat16) && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == kv_type && v_cache.is_contiguous(),
              "paged_decode_attention: k/v caches must be contiguous float32 or bfloat16 [H_kv, blocks, block_size, D]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "paged_decode_attention: block_tables must be contiguous int64 [B, W]");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous(),
              "paged_decode_attention: ctx_lens must be contiguous int64 [B]");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t H_kv = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t W = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0, "paged_decode_attention: head_dim must match and be a multiple of 8");
  TORCH_CHECK(H_kv > 0 && H % H_kv == 0, "paged_decode_attention: query heads must be a multiple of K/V heads");
  TORCH_CHECK(block_tables.size(0) == B && ctx_lens.size(0) == B, "paged_decode_attention: batch sizes differ");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * block_size, "paged_decode_attention: context length ", lens[b],
                " out of range for a block table of ", W, " blocks");
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tables[b * W + j] >= 0 && tables[b * W + j] < num_blocks, "paged_decode_attention: block id ",
                  tables[b * W + j], " out of range");
  }
  at::Tensor out = at::empty({B, H, D}, query.options().memory_format(at::MemoryFormat::Contiguous));
  const float sc = static_cast<float>(scale);
  if (kv_type == at::kFloat) {
    paged_decode_attention_impl(query.data_ptr<float>(), query.stride(0), query.stride(1), k_cache.data_ptr<float>(),
                                v_cache.data_ptr<float>(), tables, lens, B, H, H_kv, num_blocks, block_size, D, W, sc,
                                out.data_ptr<float>());
  } else {
    paged_decode_attention_impl(query.data_ptr<float>(), query.stride(0), query.stride(1),
                                k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), tables, lens, B,
                                H, H_kv, num_blocks, block_size, D, W, sc, out.data_ptr<float>());
  }
  return out;
}

// kv_cache_write: a step's new keys and values into their slots of the pool, what two index_copy_ calls and
// their dtype conversions did (four dispatches and a view each per layer, at batch 1 more than the copy).
//   k_cache, v_cache [H_kv, num_blocks, block_size, D]  float32 or bfloat16, contiguous (written in place)
//   key, value       [H_kv, T, D]  float32 or the cache's dtype, D contiguous (a bfloat16 cache gets each
//                                  float32 value rounded to nearest even, as Tensor.to rounds it)
//   slot_mapping     [T] int64: token t goes to slot (block * block_size + offset) slot_mapping[t]
namespace {

template <typename In, typename Out>
void write_rows(const In* src, int64_t s_head, int64_t s_tok, Out* dst, const int64_t* slots, int64_t H_kv,
                int64_t T, int64_t slots_per_head, int64_t D) {
  for (int64_t h = 0; h < H_kv; ++h)
    for (int64_t t = 0; t < T; ++t) {
      const In* from = src + h * s_head + t * s_tok;
      Out* to = dst + (h * slots_per_head + slots[t]) * D;
      for (int64_t i = 0; i < D; ++i) to[i] = static_cast<Out>(from[i]);
    }
}

void write_one(const at::Tensor& cache, const at::Tensor& fresh, const int64_t* slots, int64_t T) {
  const int64_t H_kv = cache.size(0), D = cache.size(3), per_head = cache.size(1) * cache.size(2);
  if (cache.scalar_type() == at::kFloat) {
    write_rows(fresh.data_ptr<float>(), fresh.stride(0), fresh.stride(1), cache.data_ptr<float>(), slots, H_kv, T,
               per_head, D);
  } else if (fresh.scalar_type() == at::kFloat) {
    write_rows(fresh.data_ptr<float>(), fresh.stride(0), fresh.stride(1), cache.data_ptr<c10::BFloat16>(), slots,
               H_kv, T, per_head, D);
  } else {
    write_rows(fresh.data_ptr<c10::BFloat16>(), fresh.stride(0), fresh.stride(1), cache.data_ptr<c10::BFloat16>(),
               slots, H_kv, T, per_head, D);
  }
}

}  // namespace

void kv_cache_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slot_mapping) {
  const char* op = "kv_cache_write";
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              op, ": caches must be contiguous [H_kv, blocks, block_size, D] float32 or bfloat16 of one shape");
  const int64_t H_kv = k_cache.size(0), D = k_cache.size(3), slots_per_head = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), op,
              ": slot_mapping must be a contiguous int64 vector");
  const int64_t T = slot_mapping.size(0);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == H_kv && t->size(1) == T && t->size(2) == D && t->stride(2) == 1, op,
                ": key/value ", t->sizes(), " must be [", H_kv, ", ", T, ", ", D, "] with D contiguous");
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == k_cache.scalar_type(), op,
                ": key/value must be float32 or the cache's dtype");
  }
  TORCH_CHECK(k_cache.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() &&
                  slot_mapping.device().is_cpu(), op, ": CPU tensors only");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_per_head, op, ": slot ", slots[t], " out of range");
  write_one(k_cache, key, slots, T);
  write_one(v_cache, value, slots, T);
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor ctx_lens, float scale) -> Tensor");
  m.def("kv_cache_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) {
  m.impl("paged_decode_attention", &llminfer::paged_decode_attention);
  m.impl("kv_cache_write", &llminfer::kv_cache_write);
}
