// int8_group_linear_q8 / int4_group_linear_q8: int8-wo's and int4-wo's group-wise weights (groups of 32
// columns) times activations as two 8-bit digits per block of 32 columns, for any number of rows. Wrappers:
// llminfer/kernels/int8_group_linear.py.
//
// W[n, k] = c[n, k] * s[n, g] + z[n, g], codes c in [0, 255] (or [0, 15]), g = k / 32, and activations rounded
// per block of 32 columns as llama.cpp's Q8_0 does (d[m, b] = max|x| / 127, q = round(x / d)), plus a second
// digit for the remainder (kLowSteps below). Since a group and a block are the same 32 columns,
//   out[m, n] = sum_g (dot_g * d[m, g] * s[n, g] + z[n, g] * xsum[m, g]) + bias[n],
// with dot_g the sum of c * (q + r / 254) over the group (two exact int32 sums) and xsum[m, g] the group's sum
// of the float32 activations (group_sums, in double, rounded once).
//
// Why a second kernel for these weights: int8_group_linear.cpp widens the codes to int16 for vpdpwssd (32
// products an instruction plus a widening shuffle) and int4_linear_q8.cpp's scheme turns every 64-column chunk's
// int32 lanes into float (convert, multiply, FMA per row per chunk); either way the product is compute-bound past
// one row on a CPU that runs AVX-512 on 256-bit units (Zen 4): the bench model's 32-row LM head took ~41 ms.
//
// The layout: channels in blocks of L (16 on the AVX-512 VNNI build, 8 on the others), and within a block,
// group by group, 8 chunks of 4 columns, each chunk one vector: L channels' 4 code bytes side by side (the
// "VNNI" weight layout of GEMM libraries, and of llama.cpp's repacked CPU weights). Int32 lane l of a
// dot-product instruction then belongs to channel l: the row's 4 activation bytes are broadcast, and the
// lanes add up exact int32 group sums over the 8 chunks for L channels at once. The float work per group is
// one convert per digit and three FMAs for L outputs, and the lanes are the outputs, so no output needs a
// horizontal sum (in a layout where lanes were groups, that sum and the per-output float steps cost as much as
// the products on a 32-row LM head: 52 against 37 ms at 32 rows, 17 against 11 at 8, same run). The scale
// and the minimum are laid out the same way, [blocks, groups, L], in bfloat16 where every value of the layer is
// one (the quantizers round them so, unless the weight already lies on a grid, as a GGUF file's blocks do), else
// in float16 where every value is one (GGUF's fp16 block scales: Q8_0 under int8-wo), else in float32. 2 bytes
// a group each instead of 4 take the bench model's int8 LM head from 97 to 87 MB a step. The last block is
// padded with zero codes.
// 4-bit codes (int4-wo's groups of 32): each group's chunk j (j < 4) in the low nibbles and chunk j + 4 in the
// high ones of the same vector, so one load and two masks give two chunks.
//
// The integer step: vpdpbusd with the codes as the unsigned operand as stored, once per digit (AVX-512 VNNI,
// AVX-VNNI); on plain AVX2, which has no u8 x s8 dot product, vpmaddwd on codes widened to int16 and both digits
// folded into one int16 (kPlain below). Every output element is one fixed sequence whatever M, the threads or
// the tile, so a row's result does not depend on the batch.
#include "q8_activations.h"

#include <cstring>
#include <limits>

namespace llminfer {
namespace {

constexpr int64_t kG = 32;                             // group = activation block
constexpr int64_t kL = LLMINFER_Q8_512 ? 16 : 8;       // lanes: channels per block
constexpr int64_t kChunks = kG / 4;                    // chunks per group (4 columns a lane each)

#if LLMINFER_Q8_512
using ivec = __m512i;
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec iload(const void* p) { return _mm512_loadu_si512(p); }
inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline facc fload_n(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline facc ffma(facc a, facc b, facc c) { return _mm512_fmadd_ps(a, b, c); }
inline facc fmul(facc a, facc b) { return _mm512_mul_ps(a, b); }
inline facc fset1(float a) { return _mm512_set1_ps(a); }
inline facc to_float(ivec v) { return _mm512_cvtepi32_ps(v); }
#else
using ivec = __m256i;
inline ivec izero() { return _mm256_setzero_si256(); }
inline ivec iload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec iadd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline facc fload_n(const float* p, int64_t n) {
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, mask);
}
inline facc ffma(facc a, facc b, facc c) { return _mm256_fmadd_ps(a, b, c); }
inline facc fmul(facc a, facc b) { return _mm256_mul_ps(a, b); }
inline facc fset1(float a) { return _mm256_set1_ps(a); }
inline facc to_float(ivec v) { return _mm256_cvtepi32_ps(v); }
#endif

inline ivec iset1(int32_t v) {
#if LLMINFER_Q8_512
  return _mm512_set1_epi32(v);
#else
  return _mm256_set1_epi32(v);
#endif
}
inline ivec ibroadcast(const int8_t* p) {  // 4 bytes to every int32 lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return iset1(v);
}
inline facc fload(const float* p) {
#if LLMINFER_Q8_512
  return _mm512_loadu_ps(p);
#else
  return _mm256_loadu_ps(p);
#endif
}
inline facc fadd(facc a, facc b) { return facc_add(a, b); }
// kL scales or minima (a block's, for one group) as float32: float32 as stored; float16 converted (F16C);
// bfloat16 (uint16_t) with the 16 bits moved to the top of each lane. All exact.
inline facc fload_param(const float* p) { return fload(p); }
inline facc fload_param(const at::Half* p) {
#if LLMINFER_Q8_512
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}
inline facc fload_param(const uint16_t* p) {
#if LLMINFER_Q8_512
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#endif
}

// The int32 lanes' update for one chunk: acc + (per lane) the sum of c * q over its 4 columns (VNNI builds; plain
// AVX2 takes group_q8_tile_plain below).
template <int Bits>
inline ivec dot_chunk(ivec acc, ivec c, ivec q) {
#if LLMINFER_Q8_512
  return _mm512_dpbusd_epi32(acc, c, q);
#elif LLMINFER_Q8_DP256
  return LLMINFER_DPBUSD256(acc, c, q);
#else
  static_assert(Bits < 0, "plain AVX2 has no u8 x s8 dot product: group_q8_tile_plain");
  return acc;
#endif
}

// The low and high nibbles of a vector of 4-bit code pairs, as bytes.
inline ivec low_nibbles(ivec v) {
#if LLMINFER_Q8_512
  return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
#else
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
#endif
}
inline ivec high_nibbles(ivec v) {
#if LLMINFER_Q8_512
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
#else
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
#endif
}

// 6-bit codes (int4-wo's LM head): bits 4-5 of chunk (v + 4 * half) come from the group's plane vector `half`,
// where chunk c of the half sits at bits 2c, 2c + 1 of each byte; moved to bits 4-5. The 16-bit shifts move
// bits across bytes only into positions the 0x30 mask drops.
template <int V>
inline ivec top_bits(ivec plane) {
#if LLMINFER_Q8_512
  const ivec moved = V < 2 ? _mm512_slli_epi16(plane, 4 - 2 * V) : _mm512_srli_epi16(plane, 2 * V - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
#else
  const ivec moved = V < 2 ? _mm256_slli_epi16(plane, 4 - 2 * V) : _mm256_srli_epi16(plane, 2 * V - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
#endif
}
inline ivec ior(ivec a, ivec b) {
#if LLMINFER_Q8_512
  return _mm512_or_si512(a, b);
#else
  return _mm256_or_si256(a, b);
#endif
}

// Plain AVX2 (no u8 x s8 dot-product instruction): the two digits folded into one int16, 254 q + r (at most
// 254 * 127 + 127 = 32385), times the codes widened to int16 on vpmaddwd: 2 instructions per 16 columns for both
// digits, where vpmaddubsw needed the sign trick (xor, abs, sign, maddubs, madd, add) for each digit. A lane's
// group sum stays within 16 * 255 * 32385 < 2^31; it is exact in int32 and rounded once to float32 (exactly
// while below 2^24), then divided by 254 (exact for a sum of first digits alone).
constexpr bool kPlain = !LLMINFER_Q8_512 && !LLMINFER_Q8_DP256;

// Activation rows, each value as two 8-bit digits: x ~ d * (q + r / kLowSteps) with d = max|x| / 127 per
// block of 32 columns (llama.cpp's Q8_0: q = round(x / d) in [-127, 127]) and
// r = round((x - q * d) / (d / kLowSteps)) in [-127, 127], the rounding error of q on a 254 times finer grid.
// One digit alone (8-bit activations, what llama.cpp multiplies with) moved the trained SmolLM2's top-1 token
// at 7 % of positions against fp32; with both the activations are within d / 508 of x, finer than the wide
// kernel's 14 bits per row wherever a block's max|x| is below its row's.
constexpr float kLowSteps = 254.f;

struct GroupRows {
  std::vector<int8_t> q;       // [M, K]  first digit
  std::vector<int8_t> r;       // [M, K]  second digit
  std::vector<float> d;        // [M, groups]
  std::vector<float> xsum;     // [M, groups]  the group's sum of the float32 activations
  std::vector<int16_t> w;      // [M, K]  254 q + r (plain AVX2)
};

// Four vectors of 8 int32 in [-127, 127] as 32 int8 in their order (the packs interleave 128-bit lanes; the
// permutation puts the 4-byte pieces back).
inline __m256i narrow_to_int8(const __m256i v[4]) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline __m256i clamp127(__m256i v) {
  return _mm256_min_epi32(_mm256_max_epi32(v, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
}

// One block of 32 activations as its two digits (int8, column order), and its d. A block
// holding a NaN or an infinity gets d = NaN and both digits 0, which makes the row's outputs NaN. (cvtps
// rounds to nearest even in the default MXCSR mode, as torch.round does.)
inline void block_digits(const float* xb, __m256i& q8, __m256i& r8, float& d) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  int unordered = 0;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]));
    unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));  // max_ps drops NaNs
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  q8 = r8 = _mm256_setzero_si256();
  if (unordered || !std::isfinite(m)) {
    d = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  d = m > 0.f ? m / 127.f : 0.f;
  if (!(m > 0.f)) return;
  const __m256 vd = _mm256_set1_ps(d);
  const float step = d / kLowSteps;
  const bool finite_step = std::isfinite(step) && step > 0.f;
  const __m256 vstep = _mm256_set1_ps(step);
  __m256i qi[4], ri[4];
  for (int i = 0; i < 4; ++i) {
    qi[i] = clamp127(_mm256_cvtps_epi32(_mm256_div_ps(v[i], vd)));
    const __m256 rest = _mm256_sub_ps(v[i], _mm256_mul_ps(_mm256_cvtepi32_ps(qi[i]), vd));
    ri[i] = finite_step ? clamp127(_mm256_cvtps_epi32(_mm256_div_ps(rest, vstep))) : _mm256_setzero_si256();
  }
  q8 = narrow_to_int8(qi);
  r8 = narrow_to_int8(ri);
}

GroupRows pack_rows(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / kG;
  GroupRows g;
  g.xsum = group_sums(x, M, K, kG);
  g.q.assign(static_cast<size_t>(M * K), 0);
  g.r.assign(static_cast<size_t>(M * K), 0);
  g.d.assign(static_cast<size_t>(M * groups), 0.f);
  if (kPlain) g.w.assign(static_cast<size_t>(M * K), 0);
  parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t grp = 0; grp < groups; ++grp) {
        __m256i q8, r8;
        const int64_t i = m * groups + grp;
        block_digits(x + m * K + grp * kG, q8, r8, g.d[i]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(g.q.data() + m * K + grp * kG), q8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(g.r.data() + m * K + grp * kG), r8);
        if (kPlain) {
          const __m128i q_lo = _mm256_castsi256_si128(q8), q_hi = _mm256_extracti128_si256(q8, 1);
          const __m128i r_lo = _mm256_castsi256_si128(r8), r_hi = _mm256_extracti128_si256(r8, 1);
          const __m256i steps = _mm256_set1_epi16(static_cast<int16_t>(kLowSteps));
          int16_t* w = g.w.data() + m * K + grp * kG;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), _mm256_add_epi16(
              _mm256_mullo_epi16(_mm256_cvtepi8_epi16(q_lo), steps), _mm256_cvtepi8_epi16(r_lo)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 16), _mm256_add_epi16(
              _mm256_mullo_epi16(_mm256_cvtepi8_epi16(q_hi), steps), _mm256_cvtepi8_epi16(r_hi)));
        }
      }
  });
  return g;
}

// Rows [m0, m0 + MT) times channel blocks [b0, b0 + NT) (block_bytes of codes each; s and z the blocks'
// [groups, kL] parameters): acc[m][j] holds the kL outputs of row m0 + m, block b0 + j, before the bias.
template <int Bits, int MT, int NT, typename P>
inline void group_q8_tile(const GroupRows& r, int64_t m0, const uint8_t* codes, int64_t block_bytes, int64_t K,
                          const P* s, const P* z, facc (&acc)[MT][NT]) {
  const int64_t groups = K / kG;
  constexpr int64_t kGroupBytes = kChunks * kL * 4 * Bits / 8;  // one group of a block's codes
  const facc inv_steps = fset1(1.f / kLowSteps);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = fzero();
  for (int64_t g = 0; g < groups; ++g) {
    ivec isum[MT][NT], isum_r[MT][NT];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NT; ++j) isum[m][j] = isum_r[m][j] = izero();
    auto chunk = [&](int64_t ch, const ivec (&c)[NT]) __attribute__((always_inline)) {
      for (int m = 0; m < MT; ++m) {
        const int64_t at = (m0 + m) * K + g * kG + ch * 4;
        const ivec q = ibroadcast(r.q.data() + at), qr = ibroadcast(r.r.data() + at);
        for (int j = 0; j < NT; ++j) {
          isum[m][j] = dot_chunk<Bits>(isum[m][j], c[j], q);
          isum_r[m][j] = dot_chunk<Bits>(isum_r[m][j], c[j], qr);
        }
      }
    };
    if constexpr (Bits == 6) {  // 4 vectors of nibble pairs (as 4-bit codes), then the 2 plane vectors
      ivec plane[2][NT];
      for (int j = 0; j < NT; ++j)
        for (int half = 0; half < 2; ++half) {
          const uint8_t* pp = codes + j * block_bytes + g * kGroupBytes + (4 + half) * kL * 4;
          _mm_prefetch(reinterpret_cast<const char*>(pp + NT * block_bytes), _MM_HINT_T0);
          plane[half][j] = iload(pp);
        }
      auto pair = [&](auto vc) __attribute__((always_inline)) {
        constexpr int v = decltype(vc)::value;
        ivec low[NT], high[NT];
        for (int j = 0; j < NT; ++j) {
          const uint8_t* cp = codes + j * block_bytes + g * kGroupBytes + v * kL * 4;
          _mm_prefetch(reinterpret_cast<const char*>(cp + NT * block_bytes), _MM_HINT_T0);
          const ivec c = iload(cp);
          low[j] = ior(low_nibbles(c), top_bits<v>(plane[0][j]));
          high[j] = ior(high_nibbles(c), top_bits<v>(plane[1][j]));
        }
        chunk(v, low);
        chunk(v + kChunks / 2, high);
      };
      pair(std::integral_constant<int, 0>{});
      pair(std::integral_constant<int, 1>{});
      pair(std::integral_constant<int, 2>{});
      pair(std::integral_constant<int, 3>{});
    }
    for (int64_t v = 0; Bits != 6 && v < kChunks * Bits / 8; ++v) {
      ivec c[NT];
      for (int j = 0; j < NT; ++j) {
        const uint8_t* cp = codes + j * block_bytes + g * kGroupBytes + v * kL * 4;
        _mm_prefetch(reinterpret_cast<const char*>(cp + NT * block_bytes), _MM_HINT_T0);  // the next tile's
        c[j] = iload(cp);
      }
      if constexpr (Bits == 8) {
        chunk(v, c);
      } else {
        ivec high[NT];
        for (int j = 0; j < NT; ++j) {
          high[j] = high_nibbles(c[j]);
          c[j] = low_nibbles(c[j]);
        }
        chunk(v, c);
        chunk(v + kChunks / 2, high);
      }
    }
    for (int j = 0; j < NT; ++j) {
      const facc sj = fload_param(s + (j * groups + g) * kL), zj = fload_param(z + (j * groups + g) * kL);
      for (int m = 0; m < MT; ++m) {
        const int64_t i = (m0 + m) * groups + g;
        const facc dot = ffma(to_float(isum_r[m][j]), inv_steps, to_float(isum[m][j]));  // q + r / 254, summed
        acc[m][j] = ffma(dot, fmul(sj, fset1(r.d[i])), acc[m][j]);
        acc[m][j] = ffma(zj, fset1(r.xsum[i]), acc[m][j]);
      }
    }
  }
}

#if !LLMINFER_Q8_512 && !LLMINFER_Q8_DP256
// group_q8_tile on plain AVX2 (kPlain above), one block of 8 channels: each 32-byte chunk widens to two vectors
// of 16 int16 (channels 0-3 and 4-7, 4 columns each); vpmaddwd with the row's 4 int16 values broadcast gives
// each channel two int32 lanes, added pairwise (vphaddd) and put in channel order once per group.
template <int Bits, int MT, int NT, typename P>
inline void group_q8_tile_plain(const GroupRows& r, int64_t m0, const uint8_t* codes, int64_t block_bytes,
                                int64_t K, const P* s, const P* z, facc (&acc)[MT][NT]) {
  static_assert(NT == 1, "plain AVX2 tiles are one block wide (16 registers)");
  const int64_t groups = K / kG;
  constexpr int64_t kGroupBytes = kChunks * kL * 4 * Bits / 8;
  const __m256 steps = _mm256_set1_ps(kLowSteps);
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  for (int m = 0; m < MT; ++m) acc[m][0] = fzero();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i lo[MT], hi[MT];
    for (int m = 0; m < MT; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
    auto chunk = [&](int64_t ch, __m256i c) __attribute__((always_inline)) {
      const __m256i c_lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(c));
      const __m256i c_hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(c, 1));
      for (int m = 0; m < MT; ++m) {
        int64_t four;  // the row's 4 int16 values of this chunk
        std::memcpy(&four, r.w.data() + (m0 + m) * K + g * kG + ch * 4, 8);
        const __m256i a = _mm256_set1_epi64x(four);
        lo[m] = _mm256_add_epi32(lo[m], _mm256_madd_epi16(c_lo, a));
        hi[m] = _mm256_add_epi32(hi[m], _mm256_madd_epi16(c_hi, a));
      }
    };
    if constexpr (Bits == 6) {
      const __m256i plane0 = iload(codes + g * kGroupBytes + 4 * kL * 4);
      const __m256i plane1 = iload(codes + g * kGroupBytes + 5 * kL * 4);
      auto pair = [&](auto vc) __attribute__((always_inline)) {
        constexpr int v = decltype(vc)::value;
        const uint8_t* cp = codes + g * kGroupBytes + v * kL * 4;
        _mm_prefetch(reinterpret_cast<const char*>(cp + block_bytes), _MM_HINT_T0);
        const __m256i c = iload(cp);
        chunk(v, ior(low_nibbles(c), top_bits<v>(plane0)));
        chunk(v + kChunks / 2, ior(high_nibbles(c), top_bits<v>(plane1)));
      };
      pair(std::integral_constant<int, 0>{});
      pair(std::integral_constant<int, 1>{});
      pair(std::integral_constant<int, 2>{});
      pair(std::integral_constant<int, 3>{});
    }
    for (int64_t v = 0; Bits != 6 && v < kChunks * Bits / 8; ++v) {
      const uint8_t* cp = codes + g * kGroupBytes + v * kL * 4;
      _mm_prefetch(reinterpret_cast<const char*>(cp + block_bytes), _MM_HINT_T0);  // the next tile's
      const __m256i c = iload(cp);
      if constexpr (Bits == 8) {
        chunk(v, c);
      } else {
        chunk(v, low_nibbles(c));
        chunk(v + kChunks / 2, high_nibbles(c));
      }
    }
    const facc sj = fload_param(s + g * kL), zj = fload_param(z + g * kL);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (m0 + m) * groups + g;
      const __m256i total = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo[m], hi[m]), order);
      const facc dot = _mm256_div_ps(to_float(total), steps);  // q + r / 254, summed
      acc[m][0] = ffma(dot, fmul(sj, fset1(r.d[i])), acc[m][0]);
      acc[m][0] = ffma(zj, fset1(r.xsum[i]), acc[m][0]);
    }
  }
}
#endif

// Tiles: on AVX-512 (32 registers) 4 rows x 2 blocks (16 int32 sums, 8 float accumulators) where the step has
// 4 rows or more, on AVX2 (16 registers) 2 x 2 from 2 rows; below that 2 or 1 rows x 1 block. One block at a
// time reads the codes as one sequential stream: the bench model's int8 LM head at one row took 2.4-2.7 ms so,
// against 3.1-3.2 with 4 blocks a tile (4 streams 8 KB apart), as fast as the wide kernel (Zen 4).
constexpr int kTileRows = LLMINFER_Q8_512 || kPlain ? 4 : 2;
constexpr int kTileBlocks = kPlain ? 1 : 2;
constexpr int kRowBlocks = 1;

// The outputs of rows [m0, m0 + MT) and blocks [b0, b0 + NT), with the bias, into out [M, N].
template <int Bits, int MT, int NT, typename P>
inline void group_q8_store(const GroupRows& r, int64_t m0, int64_t b0, const uint8_t* codes, int64_t block_bytes,
                           int64_t K, const P* s, const P* z, const float* bias, int64_t N, float* out) {
  facc acc[MT][NT];
  const int64_t groups = K / kG;
#if LLMINFER_Q8_512 || LLMINFER_Q8_DP256
  group_q8_tile<Bits, MT, NT, P>(r, m0, codes + b0 * block_bytes, block_bytes, K, s + b0 * groups * kL,
                              z + b0 * groups * kL, acc);
#else
  group_q8_tile_plain<Bits, MT, NT, P>(r, m0, codes + b0 * block_bytes, block_bytes, K, s + b0 * groups * kL,
                                    z + b0 * groups * kL, acc);
#endif
  for (int j = 0; j < NT; ++j) {
    const int64_t n0 = (b0 + j) * kL, valid = std::min<int64_t>(kL, N - n0);
    const facc bj = bias ? fload_n(bias + n0, valid) : fzero();
    for (int m = 0; m < MT; ++m) {
      float* o = out + (m0 + m) * N + n0;
      const facc v = bias ? fadd(acc[m][j], bj) : acc[m][j];
      if (valid == kL) {
#if LLMINFER_Q8_512
        _mm512_storeu_ps(o, v);
#else
        _mm256_storeu_ps(o, v);
#endif
      } else {
        alignas(64) float t[kL];
#if LLMINFER_Q8_512
        _mm512_store_ps(t, v);
#else
        _mm256_store_ps(t, v);
#endif
        std::memcpy(o, t, static_cast<size_t>(valid) * sizeof(float));
      }
    }
  }
}

// out = x @ W.T + bias for codes of Bits bits in the blocked layout above.
template <int Bits, typename P>
void group_linear_q8(const float* x, int64_t M, int64_t K, const uint8_t* codes, int64_t N, const P* scale,
                     const P* zero, const float* bias, float* out) {
  const GroupRows r = pack_rows(x, M, K);
  const int64_t blocks = (N + kL - 1) / kL, block_bytes = K * kL * Bits / 8;
  const bool many = M >= kTileRows;
  const int64_t per_tile = many ? kTileBlocks : kRowBlocks;
  const int64_t tiles = (blocks + per_tile - 1) / per_tile;
  const int64_t grain = std::max<int64_t>(1, 64 * 1024 / (per_tile * block_bytes));
  parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * per_tile, nb = std::min(per_tile, blocks - b0);
      auto rows_of = [&](auto mt, int64_t m0) {
        constexpr int MT = decltype(mt)::value;
        if (many && nb == kTileBlocks) {
          group_q8_store<Bits, MT, kTileBlocks, P>(r, m0, b0, codes, block_bytes, K, scale, zero, bias, N, out);
        } else if (!many && nb == kRowBlocks) {
          group_q8_store<Bits, MT, kRowBlocks, P>(r, m0, b0, codes, block_bytes, K, scale, zero, bias, N, out);
        } else {
          for (int64_t b = b0; b < b0 + nb; ++b)
            group_q8_store<Bits, MT, 1, P>(r, m0, b, codes, block_bytes, K, scale, zero, bias, N, out);
        }
      };
      int64_t m = 0;
      if (many)
        for (; m + kTileRows <= M; m += kTileRows) rows_of(std::integral_constant<int, kTileRows>{}, m);
      else
        for (; m + 2 <= M; m += 2) rows_of(std::integral_constant<int, 2>{}, m);
      for (; m < M; ++m) rows_of(std::integral_constant<int, 1>{}, m);
    }
  });
}

// The checked arguments of either op.
void check_group_q8_args(const char* op, const at::Tensor& x, const at::Tensor& codes, int64_t bits,
                         const at::Tensor& scale, const at::Tensor& zero, int64_t N, const char* zero_name) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(K > 0 && K % kG == 0, op, ": K must be a positive multiple of 32, got ", K);
  TORCH_CHECK(N >= 0, op, ": out_features must be >= 0, got ", N);
  const int64_t blocks = (N + kL - 1) / kL;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(0) == blocks && codes.size(1) == K * kL * bits / 8,
              op, ": codes must be a contiguous uint8 [ceil(N / ", kL, "), ", kL * bits / 8,
              " * K] tensor from the op's pack function, got ", codes.sizes(), " for N = ", N, ", K = ", K);
  for (const at::Tensor* t : {&scale, &zero})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->scalar_type() == scale.scalar_type() &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16 ||
                     t->scalar_type() == at::kHalf) && t->is_contiguous() &&
                    t->size(0) == blocks && t->size(1) == K / kG * kL,
                op, ": scale and ", zero_name, " must be contiguous [ceil(N / ", kL, "), K / 32 * ", kL,
                "] tensors of one dtype, float32, bfloat16 or float16, from pack_group_q8_params, got ", t->scalar_type(),
                " ", t->sizes());
}

// Either op: checked arguments, the output allocated, the product.
template <int Bits>
at::Tensor run_group_q8(const char* op, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& zero, int64_t N, const c10::optional<at::Tensor>& bias,
                        const char* zero_name) {
  check_group_q8_args(op, x, codes, Bits, scale, zero, N, zero_name);
  const float* bias_p = optional_bias(op, bias, N);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (scale.scalar_type() == at::kHalf)
    group_linear_q8<Bits>(x.data_ptr<float>(), M, x.size(1), codes.data_ptr<uint8_t>(), N,
                          scale.data_ptr<at::Half>(), zero.data_ptr<at::Half>(), bias_p, out.data_ptr<float>());
  else if (scale.scalar_type() == at::kBFloat16)
    group_linear_q8<Bits>(x.data_ptr<float>(), M, x.size(1), codes.data_ptr<uint8_t>(), N,
                          reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>()),
                          reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>()), bias_p, out.data_ptr<float>());
  else
    group_linear_q8<Bits>(x.data_ptr<float>(), M, x.size(1), codes.data_ptr<uint8_t>(), N, scale.data_ptr<float>(),
                          zero.data_ptr<float>(), bias_p, out.data_ptr<float>());
  return out;
}

}  // namespace

// int8_group_linear_q8(x [M, K] float32, codes uint8 [ceil(N / L), L * K] from pack_int8_group_q8, scale and
// minimum [ceil(N / L), K / 32 * L] from pack_group_q8_params (both float32, bfloat16 or float16), N, bias [N]
// float32 or None)
// -> [M, N] float32.
at::Tensor int8_group_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& minimum, int64_t out_features,
                                const c10::optional<at::Tensor>& bias) {
  return run_group_q8<8>("int8_group_linear_q8", x, codes, scale, minimum, out_features, bias, "minimum");
}

// int4_group_linear_q8: the same for 4-bit codes c in [0, 15], W[n, k] = c * scale + zero (see the layout above).
at::Tensor int4_group_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& zero, int64_t out_features, const c10::optional<at::Tensor>& bias) {
  return run_group_q8<4>("int4_group_linear_q8", x, codes, scale, zero, out_features, bias, "zero");
}

// int6_group_linear_q8: the same for 6-bit codes c in [0, 63], W[n, k] = c * scale + minimum (int4-wo's LM head;
// per group of a block, the low 4 bits as the 4-bit codes' 4 vectors, then 2 vectors of the top 2 bits: see
// top_bits above).
at::Tensor int6_group_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& minimum, int64_t out_features,
                                const c10::optional<at::Tensor>& bias) {
  return run_group_q8<6>("int6_group_linear_q8", x, codes, scale, minimum, out_features, bias, "minimum");
}

// Channels per block in this build (16 on AVX-512 VNNI, else 8): what the Python pack functions lay out.
int64_t group_q8_lanes() { return kL; }

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("int8_group_linear_q8(Tensor x, Tensor codes, Tensor scale, Tensor minimum, int out_features, "
        "Tensor? bias=None) -> Tensor");
  m.def("int4_group_linear_q8(Tensor x, Tensor codes, Tensor scale, Tensor zero, int out_features, "
        "Tensor? bias=None) -> Tensor");
  m.def("int6_group_linear_q8(Tensor x, Tensor codes, Tensor scale, Tensor minimum, int out_features, "
        "Tensor? bias=None) -> Tensor");
  m.def("group_q8_lanes() -> int", &llminfer::group_q8_lanes);
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) {
  m.impl("int8_group_linear_q8", &llminfer::int8_group_linear_q8);
  m.impl("int4_group_linear_q8", &llminfer::int4_group_linear_q8);
  m.impl("int6_group_linear_q8", &llminfer::int6_group_linear_q8);
}
