// Paged decode attention: one query token per sequence, K/V read in place from the block pool.
//
//   query  [B, H, D]      float32, any strides for B and H, D contiguous
//   k, v   [H_kv, num_blocks, block_size, D]   float32 or bfloat16 (widened exactly to float32 as they are
//                                              read), contiguous (llminfer's head-major pool)
//   block_tables [B, W]   int64, W contiguous, any stride for B (0: every row reads one table, as the rows of a
//                         prefill chunk do); ctx_lens [B] int64 (tokens of context, >= 1)
//   out    [B, H, D]      float32, contiguous
//
// Query head h reads K/V head h / (H / H_kv) (grouped-query attention in HF's repeat_kv order). Each
// (sequence, K/V head) is one task: scores for its G query heads over the whole context (four keys a pass), a
// softmax (max subtracted, fp32, vectorised exponentials), then the probability-weighted sum of V in context order
// (accumulated in registers). Every value is one fixed sequence of operations given its row's context length, and
// no value depends on its neighbours in a vector or a pass. So a row's
// result does not depend on the batch, the padding of the block table or the thread count. So a prefill
// chunk's rows, run here each with its own causal context length, get the bits a decode step at the same
// position gets, whatever the chunk's size or the cached prefix before it.
// Wrapper: llminfer/backends/attention.py.
#include "common.h"

#include <limits>

namespace llminfer {
namespace {

#if LLMINFER_KERNEL_AVX512
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline __m256 fold256(vec v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
inline vec vround(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2(vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline vec zero_below(vec y, vec x, vec lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), y); }
#else
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline __m256 fold256(vec v) { return v; }
inline vec vround(vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2(vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vec zero_below(vec y, vec x, vec lo) { return _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ)); }
#endif

// The sums of four accumulators' lanes, [a, b, c, d]: pairwise adds within each vector, so a sum depends only on
// its own accumulator (never on which key shares the instruction).
inline __m128 lane_sums4(vec a, vec b, vec c, vec d) {
  const __m256 ab = _mm256_hadd_ps(fold256(a), fold256(b));  // [a01 a23 b01 b23 | a45 a67 b45 b67]
  const __m256 cd = _mm256_hadd_ps(fold256(c), fold256(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a0..3 b0..3 c0..3 d0..3 | a4..7 b4..7 c4..7 d4..7]
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// e^x for x <= 0: 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 in two parts, Cody and Waite), e^r by
// its Taylor polynomial to r^7 / 7! (|r| <= 0.347: relative error below 2e-7); 0 below -87.33, where e^x leaves
// float's normal range. The softmax's exponentials, 8 or 16 at a time instead of one std::exp call each.
inline vec vexp_nonpositive(vec x) {
  const vec lo = vset1(-87.33f);
  const vec xc = vmax(x, lo);
  const vec n = vround(vmul(xc, vset1(1.44269504f)));
  vec r = vfma(n, vset1(-0.693359375f), xc);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vec p = vset1(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = vfma(p, r, vset1(c));
  return zero_below(vmul(p, vpow2(n)), x, lo);
}

// The scores of query heads q[0..G) (stride sq_h) against keys t in [0, L), four keys a pass, times sc, into
// s[g * Lp + t]. A score is one fixed sequence: FMAs over D in one accumulator, then lane_sums4.
template <typename T, typename KeyRow>
inline void scores_of(const float* q, int64_t sq_h, int64_t G, int64_t L, int64_t Lp, int64_t D, float sc,
                      KeyRow&& key_row, float* s) {
  const int64_t nd = D / kLanes;
  const bool half = D % kLanes != 0;  // AVX-512 with D % 16 == 8: the last 8
  const __m128 scale = _mm_set1_ps(sc);
  for (int64_t t0 = 0; t0 < L; t0 += 4) {
    const T* k[4];
    for (int64_t i = 0; i < 4; ++i) k[i] = key_row(t0 + i < L ? t0 + i : t0);  // past L: a real row, dropped
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * sq_h;
      vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
      for (int64_t j = 0; j < nd; ++j) {
        const vec x = vload(qg + j * kLanes);
        a0 = vfma(x, vload(k[0] + j * kLanes), a0);
        a1 = vfma(x, vload(k[1] + j * kLanes), a1);
        a2 = vfma(x, vload(k[2] + j * kLanes), a2);
        a3 = vfma(x, vload(k[3] + j * kLanes), a3);
      }
      if (half) {
        const vec x = vload_half(qg + nd * kLanes);
        a0 = vfma(x, vload_half(k[0] + nd * kLanes), a0);
        a1 = vfma(x, vload_half(k[1] + nd * kLanes), a1);
        a2 = vfma(x, vload_half(k[2] + nd * kLanes), a2);
        a3 = vfma(x, vload_half(k[3] + nd * kLanes), a3);
      }
      alignas(16) float out[4];
      _mm_store_ps(out, _mm_mul_ps(lane_sums4(a0, a1, a2, a3), scale));
      for (int64_t i = 0; i < 4 && t0 + i < L; ++i) s[g * Lp + t0 + i] = out[i];
    }
  }
}

// s[0..L) <- softmax(s[0..L)) in place, max subtracted; s[L..Lp) (Lp a multiple of kLanes) is scratch.
inline void softmax_in_place(float* s, int64_t L, int64_t Lp) {
  std::fill(s + L, s + Lp, -std::numeric_limits<float>::infinity());
  vec m = vload(s);
  for (int64_t t = kLanes; t < Lp; t += kLanes) m = vmax(m, vload(s + t));
  alignas(64) float lanes[kLanes];
  vstore(lanes, m);
  const vec mx = vset1(*std::max_element(lanes, lanes + kLanes));
  vec total = vzero();
  for (int64_t t = 0; t < Lp; t += kLanes) {
    const vec e = vexp_nonpositive(vsub(vload(s + t), mx));
    vstore(s + t, e);
    total = vadd(total, e);
  }
  const vec inv = vset1(1.f / lane_sum(total));
  for (int64_t t = 0; t < Lp; t += kLanes) vstore(s + t, vmul(vload(s + t), inv));
}

// o[0..D) <- sum over t in [0, L) of p[t] * V[t], in context order, one FMA an element a key: in registers,
// 4 vectors of D at a time.
template <typename T, typename ValueRow>
inline void weighted_sum(const float* p, int64_t L, int64_t D, ValueRow&& value_row, float* o) {
  int64_t d0 = 0;
  for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) {
    vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t t = 0; t < L; ++t) {
      const T* v = value_row(t) + d0;
      const vec pt = vset1(p[t]);
      a0 = vfma(pt, vload(v), a0);
      a1 = vfma(pt, vload(v + kLanes), a1);
      a2 = vfma(pt, vload(v + 2 * kLanes), a2);
      a3 = vfma(pt, vload(v + 3 * kLanes), a3);
    }
    vstore(o + d0, a0);
    vstore(o + d0 + kLanes, a1);
    vstore(o + d0 + 2 * kLanes, a2);
    vstore(o + d0 + 3 * kLanes, a3);
  }
  for (; d0 < D; d0 += kLanes) {  // the rest of D, a vector (or, on AVX-512, the last 8) at a time
    const bool half = d0 + kLanes > D;
    vec a = vzero();
    for (int64_t t = 0; t < L; ++t) {
      const vec pt = vset1(p[t]);
      a = vfma(pt, half ? vload_half(value_row(t) + d0) : vload(value_row(t) + d0), a);
    }
    if (half) {
      vstore_half(o + d0, a);
    } else {
      vstore(o + d0, a);
    }
  }
}

// The attention of every (sequence, K/V head) task for K/V caches of element type T (float or bf16).
template <typename T>
void paged_decode_attention_impl(const float* q, int64_t sq_b, int64_t sq_h, const T* kc, const T* vc,
                                 const int64_t* tables, int64_t st_b, const int64_t* lens, int64_t B, int64_t H,
                                 int64_t H_kv, int64_t num_blocks, int64_t block_size, int64_t D, float sc, float* o) {
  const int64_t G = H / H_kv;
  // Head-major tasks: one thread's consecutive tasks read one K/V head (a prefill chunk's rows share it, and
  // its blocks then stay in L2).
  parallel_for(0, B * H_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;  // element offset of each context slot within a head
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / B, b = task % B;
      const int64_t L = lens[b], Lp = (L + kLanes - 1) / kLanes * kLanes;
      scores.resize(static_cast<size_t>(G * Lp));
      offsets.resize(static_cast<size_t>(L));
      const int64_t* table = tables + b * st_b;
      for (int64_t t0 = 0, j = 0; t0 < L; t0 += block_size, ++j) {
        const int64_t base = table[j] * block_size * D;
        for (int64_t i = 0; i < block_size && t0 + i < L; ++i) offsets[t0 + i] = base + i * D;
      }
      const T* head_k = kc + h * num_blocks * block_size * D;
      const T* head_v = vc + h * num_blocks * block_size * D;
      const int64_t* off = offsets.data();
      scores_of<T>(q + b * sq_b + h * G * sq_h, sq_h, G, L, Lp, D, sc, [&](int64_t t) { return head_k + off[t]; },
                   scores.data());
      for (int64_t g = 0; g < G; ++g) {
        softmax_in_place(scores.data() + g * Lp, L, Lp);
        weighted_sum<T>(scores.data() + g * Lp, L, D, [&](int64_t t) { return head_v + off[t]; },
                        o + (b * H + h * G + g) * D);
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
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  (block_tables.stride(1) == 1 || block_tables.size(1) <= 1) && block_tables.stride(0) >= 0,
              "paged_decode_attention: block_tables must be int64 [B, W] with W contiguous");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous(),
              "paged_decode_attention: ctx_lens must be contiguous int64 [B]");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t H_kv = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t W = block_tables.size(1), st_b = block_tables.stride(0);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0, "paged_decode_attention: head_dim must match and be a multiple of 8");
  TORCH_CHECK(H_kv > 0 && H % H_kv == 0, "paged_decode_attention: query heads must be a multiple of K/V heads");
  TORCH_CHECK(block_tables.size(0) == B && ctx_lens.size(0) == B, "paged_decode_attention: batch sizes differ");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * block_size, "paged_decode_attention: context length ", lens[b],
                " out of range for a block table of ", W, " blocks");
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tables[b * st_b + j] >= 0 && tables[b * st_b + j] < num_blocks, "paged_decode_attention: block id ",
                  tables[b * st_b + j], " out of range");
  }
  at::Tensor out = at::empty({B, H, D}, query.options().memory_format(at::MemoryFormat::Contiguous));
  const float sc = static_cast<float>(scale);
  if (kv_type == at::kFloat) {
    paged_decode_attention_impl(query.data_ptr<float>(), query.stride(0), query.stride(1), k_cache.data_ptr<float>(),
                                v_cache.data_ptr<float>(), tables, st_b, lens, B, H, H_kv, num_blocks, block_size, D, sc,
                                out.data_ptr<float>());
  } else {
    paged_decode_attention_impl(query.data_ptr<float>(), query.stride(0), query.stride(1),
                                k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), tables, st_b, lens,
                                B, H, H_kv, num_blocks, block_size, D, sc, out.data_ptr<float>());
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
