// int8_group_linear_q8: int8-wo's group-wise weights (groups of 32 columns) times 8-bit activation blocks of 32
// columns, for any number of rows. Wrapper: llminfer/kernels/int8_group_linear.py.
//
// W[n, k] = c[n, k] * s[n, g] + z[n, g], codes c in [0, 255], g = k / 32, and activations rounded per block of
// 32 columns as llama.cpp's Q8_0 does (q8_activations.h: d[m, b] = max|x| / 127, q = round(x / d)). Since a
// group and a block are the same 32 columns,
//   out[m, n] = sum_g (dot_g * d[m, g] * s[n, g] + z[n, g] * xsum[m, g]) + bias[n],
// with dot_g the exact integer sum of c * q over the group and xsum[m, g] the group's sum of the float32
// activations (group_sums, in double, rounded once).
//
// Why a second kernel for these weights: int8_group_linear.cpp widens the codes to int16 for vpdpwssd (32
// products an instruction plus a widening shuffle) and int4_linear_q8.cpp's scheme turns every 64-column chunk's
// int32 lanes into float (convert, multiply, FMA per row per chunk); either way the product is compute-bound past
// one row on a CPU that runs AVX-512 on 256-bit units (Zen 4): the bench model's 32-row LM head took ~41 ms.
// Here the codes are stored so that every int32 lane of a dot-product instruction belongs to one group for a
// whole run of L groups (L = 16 lanes on the AVX-512 VNNI build, 8 on the others): a "super-block" of 32 * L
// columns is 8 chunks, chunk j holding columns 32l + 4j .. 32l + 4j + 3 in lane l. So the lanes add up exact
// int32 group sums over the 8 chunks, and the float work is one convert and two FMAs per row per super-block
// instead of per chunk. (pack_int8_group_q8 below; a last super-block of ng < L groups is 8 chunks of 4 * ng
// bytes, so the packed codes are exactly as large as the row-major ones.)
//
// The u8 x s8 step: vpdpbusd with the codes as the unsigned operand as stored (AVX-512 VNNI, AVX-VNNI); on plain
// AVX2 vpmaddubsw with the sign trick turned round, |c - 128| (at most 128) unsigned and q with the sign of
// c - 128 (|q| <= 127, so its negation cannot overflow; pairs stay within 2 * 128 * 127 < 2^15), and
// 128 * sum(q) of the group added back once per super-block. Every output element is one fixed sequence
// whatever M, the threads or the tile, so a row's result does not depend on the batch.
#include "q8_activations.h"

#include <cstring>
#include <limits>

namespace llminfer {
namespace {

constexpr int64_t kG = 32;                             // group = activation block
constexpr int64_t kL = LLMINFER_Q8_512 ? 16 : 8;       // lanes: groups per super-block
constexpr int64_t kSuper = kG * kL;                    // columns per super-block
constexpr int64_t kChunks = kG / 4;                    // chunks per super-block (4 columns a lane each)

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

// The chunk of 4 * ng code bytes at p as a full vector (zero bytes in the lanes past ng).
inline ivec load_codes(const uint8_t* p, int64_t ng) {
#if LLMINFER_Q8_512
  return ng == kL ? iload(p) : _mm512_maskz_loadu_epi8((ng * 4 >= 64) ? ~0ull : ((1ull << (ng * 4)) - 1), p);
#else
  if (ng == kL) return iload(p);
  alignas(32) uint8_t buf[32] = {};
  std::memcpy(buf, p, static_cast<size_t>(ng * 4));
  return iload(buf);
#endif
}

// The int32 lanes' update for one chunk: acc + (per lane) the sum of c * q over its 4 columns (on plain AVX2
// with 8-bit codes the sum of (c - 128) * q, the rest added by the caller; 4-bit codes, at most 15, go into
// vpmaddubsw as they are: pairs stay within 2 * 15 * 127).
template <int Bits>
inline ivec dot_chunk(ivec acc, ivec c, ivec q) {
#if LLMINFER_Q8_512
  return _mm512_dpbusd_epi32(acc, c, q);
#elif LLMINFER_Q8_DP256
  return LLMINFER_DPBUSD256(acc, c, q);
#else
  if constexpr (Bits == 4)
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c, q), _mm256_set1_epi16(1)));
  const __m256i centred = _mm256_xor_si256(c, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(q, centred));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
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

// How far ahead of the codes being read to prefetch: eight 512-column channels.
constexpr int64_t kPrefetchBytes = 4096;

// plain AVX2 adds 128 * sum(q) back for 8-bit codes
template <int Bits>
constexpr bool kOffset = Bits == 8 && !LLMINFER_Q8_512 && !LLMINFER_Q8_DP256;

// Activation rows in the packed order, each value as two 8-bit digits: x ~ d * (q + r / kLowSteps) with
// d = max|x| / 127 per block of 32 columns (llama.cpp's Q8_0: q = round(x / d) in [-127, 127]) and
// r = round((x - q * d) / (d / kLowSteps)) in [-127, 127], the rounding error of q on a 254 times finer grid.
// One digit alone (8-bit activations, what llama.cpp multiplies with) moved the trained SmolLM2's top-1 token
// at 7 % of positions against fp32; with both the activations are within d / 508 of x, finer than the wide
// kernel's 14 bits per row wherever a block's max|x| is below its row's. Per row and super-block: 8 chunks of
// kL lanes of 4 bytes (zero past the row's last group) for each digit, and per lane its block's d, xsum and
// (plain AVX2) 128 * the digits' sums.
constexpr float kLowSteps = 254.f;

struct GroupRows {
  int64_t supers = 0;
  std::vector<int8_t> q;       // [M, supers, kChunks, kL * 4]  first digit
  std::vector<int8_t> r;       // [M, supers, kChunks, kL * 4]  second digit
  std::vector<float> d;        // [M, supers, kL]
  std::vector<float> xsum;     // [M, supers, kL]
  std::vector<int32_t> off;    // [M, supers, kL]  128 * sum of q
  std::vector<int32_t> off_r;  // [M, supers, kL]  128 * sum of r
};

// 8 int32 lanes' sum.
inline int32_t lane_sum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Four vectors of 8 int32 in [-127, 127] as 32 int8 in their order (the packs interleave 128-bit lanes; the
// permutation puts the 4-byte pieces back).
inline __m256i narrow_to_int8(const __m256i v[4]) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline __m256i clamp127(__m256i v) {
  return _mm256_min_epi32(_mm256_max_epi32(v, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
}

// One block of 32 activations as its two digits (int8, column order), its d and the digits' sums. A block
// holding a NaN or an infinity gets d = NaN and both digits 0, which makes the row's outputs NaN. (cvtps
// rounds to nearest even in the default MXCSR mode, as torch.round does.)
inline void block_digits(const float* xb, __m256i& q8, __m256i& r8, float& d, int32_t& sum_q, int32_t& sum_r) {
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
  sum_q = sum_r = 0;
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
  sum_q = lane_sum_epi32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
  sum_r = lane_sum_epi32(_mm256_add_epi32(_mm256_add_epi32(ri[0], ri[1]), _mm256_add_epi32(ri[2], ri[3])));
}

GroupRows pack_rows(const float* x, int64_t M, int64_t K) {
  const std::vector<float> sums = group_sums(x, M, K, kG);
  const int64_t groups = K / kG;
  GroupRows g;
  g.supers = (groups + kL - 1) / kL;
  const int64_t per_row = g.supers * kSuper;
  g.q.assign(static_cast<size_t>(M * per_row), 0);
  g.r.assign(static_cast<size_t>(M * per_row), 0);
  g.d.assign(static_cast<size_t>(M * g.supers * kL), 0.f);
  g.xsum.assign(static_cast<size_t>(M * g.supers * kL), 0.f);
  g.off.assign(static_cast<size_t>(M * g.supers * kL), 0);
  g.off_r.assign(static_cast<size_t>(M * g.supers * kL), 0);
  parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t grp = 0; grp < groups; ++grp) {
        const int64_t sb = grp / kL, l = grp % kL;
        __m256i q8, r8;
        float d;
        int32_t total, total_r;
        block_digits(x + m * K + grp * kG, q8, r8, d, total, total_r);
        alignas(32) uint32_t qw[kChunks], rw[kChunks];  // 4 columns (one lane's bytes) per chunk
        _mm256_store_si256(reinterpret_cast<__m256i*>(qw), q8);
        _mm256_store_si256(reinterpret_cast<__m256i*>(rw), r8);
        const int64_t at = m * per_row + sb * kSuper + l * 4;
        for (int64_t j = 0; j < kChunks; ++j) {
          std::memcpy(g.q.data() + at + j * kL * 4, &qw[j], 4);
          std::memcpy(g.r.data() + at + j * kL * 4, &rw[j], 4);
        }
        const int64_t i = (m * g.supers + sb) * kL + l;
        g.d[i] = d;
        g.xsum[i] = sums[m * groups + grp];
        g.off[i] = 128 * total;
        g.off_r[i] = 128 * total_r;
      }
  });
  return g;
}

// Rows [m0, m0 + MT) times channels [n0, n0 + NT) (packed codes, row_bytes each): sums[m * NT + j] before the
// bias. Several channels at once keep independent dot-product chains in flight (one row alone would otherwise
// wait on each channel's chain of 8 dependent vpdpbusd). Bits = 4: a super-block's codes are 4 vectors, the
// low nibbles chunks 0-3 and the high ones chunks 4-7.
template <int Bits, int MT, int NT>
inline void group_q8_tile(const GroupRows& r, int64_t m0, const uint8_t* codes, int64_t row_bytes, int64_t K,
                          const float* s, const float* z, float* sums) {
  const int64_t groups = K / kG;
  facc acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = fzero();
  for (int64_t sb = 0; sb < r.supers; ++sb) {
    const int64_t g0 = sb * kL, ng = std::min<int64_t>(kL, groups - g0);
    ivec isum[MT][NT], isum_r[MT][NT];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NT; ++j) isum[m][j] = isum_r[m][j] = izero();
    auto chunk = [&](int64_t ch, const ivec (&c)[NT]) __attribute__((always_inline)) {
      for (int m = 0; m < MT; ++m) {
        const int64_t at = ((m0 + m) * r.supers + sb) * kSuper + ch * kL * 4;
        const ivec q = iload(r.q.data() + at), qr = iload(r.r.data() + at);
        for (int j = 0; j < NT; ++j) {
          isum[m][j] = dot_chunk<Bits>(isum[m][j], c[j], q);
          isum_r[m][j] = dot_chunk<Bits>(isum_r[m][j], c[j], qr);
        }
      }
    };
    const uint8_t* base = codes + g0 * kG * Bits / 8;
    for (int64_t v = 0; v < kChunks * Bits / 8; ++v) {
      ivec c[NT];
      for (int j = 0; j < NT; ++j) {
        const uint8_t* cp = base + j * row_bytes + v * ng * 4;
        _mm_prefetch(reinterpret_cast<const char*>(cp + kPrefetchBytes), _MM_HINT_T0);
        c[j] = load_codes(cp, ng);
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
    const facc inv_steps = fset1(1.f / kLowSteps);
    for (int m = 0; m < MT; ++m) {
      const int64_t i = ((m0 + m) * r.supers + sb) * kL;
      const facc d = fload_n(r.d.data() + i, kL), xs = fload_n(r.xsum.data() + i, kL);
      for (int j = 0; j < NT; ++j) {
        ivec total = isum[m][j], total_r = isum_r[m][j];
        if constexpr (kOffset<Bits>) {
          total = iadd(total, iload(r.off.data() + i));
          total_r = iadd(total_r, iload(r.off_r.data() + i));
        }
        const facc dot = ffma(to_float(total_r), inv_steps, to_float(total));  // q + r / 254, summed
        acc[m][j] = ffma(dot, fmul(d, fload_n(s + j * groups + g0, ng)), acc[m][j]);
        acc[m][j] = ffma(fload_n(z + j * groups + g0, ng), xs, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) sums[m * NT + j] = facc_sum(acc[m][j]);
}

// 2 x 2 tiles: measured on a Zen 4 (AVX-512 VNNI) against 4 x 1 and 2 x 4, the 32-row LM head product took
// 28 / 23 / 22 ms, and 2 x 2 was also the fastest at one and two rows (2 x 4: twice as slow at two rows).
constexpr int kTileRows = 2;
constexpr int kTileCols = 2;

template <int Bits, int MT>
inline void group_q8_cols(const GroupRows& r, int64_t m0, int64_t cols, const uint8_t* codes, int64_t row_bytes,
                          int64_t K, const float* s, const float* z, float* sums) {
  if (cols == 2) group_q8_tile<Bits, MT, 2>(r, m0, codes, row_bytes, K, s, z, sums);
  else group_q8_tile<Bits, MT, 1>(r, m0, codes, row_bytes, K, s, z, sums);
}

// out = x @ W.T + bias for codes of Bits bits (row_bytes = K * Bits / 8 per channel).
template <int Bits>
void group_linear_q8(const float* x, int64_t M, int64_t K, const uint8_t* codes, int64_t N, const float* scale,
                     const float* zero, const float* bias, float* out) {
  const GroupRows r = pack_rows(x, M, K);
  const int64_t groups = K / kG, row_bytes = K * Bits / 8;
  for_each_tile(M, N, kTileRows, kTileCols, row_bytes, [&](int64_t m, int64_t rows, int64_t n, int64_t cols) {
    float sums[kTileRows * kTileCols];
    const uint8_t* cn = codes + n * row_bytes;
    const float* sn = scale + n * groups;
    const float* zn = zero + n * groups;
    if (rows == 2) group_q8_cols<Bits, 2>(r, m, cols, cn, row_bytes, K, sn, zn, sums);
    else group_q8_cols<Bits, 1>(r, m, cols, cn, row_bytes, K, sn, zn, sums);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        out[(m + i) * N + n + j] = bias ? sums[i * cols + j] + bias[n + j] : sums[i * cols + j];
  });
}

// The checked arguments of either op; returns N.
int64_t check_group_q8_args(const char* op, const at::Tensor& x, const at::Tensor& codes, int64_t bits,
                            const at::Tensor& scale, const at::Tensor& zero, const char* zero_name) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(K > 0 && K % kG == 0, op, ": K must be a positive multiple of 32, got ", K);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) == K * bits / 8,
              op, ": codes must be a contiguous uint8 [N, ", bits == 8 ? "K" : "K / 2", "] tensor");
  const int64_t N = codes.size(0);
  check_group_params(op, scale, zero, N, K / kG, zero_name);
  return N;
}

}  // namespace

// int8_group_linear_q8(x [M, K] float32, codes [N, K] uint8 from pack_int8_group_q8, scale [N, K / 32] float32,
// minimum [N, K / 32] float32, bias [N] float32 or None) -> [M, N] float32.
at::Tensor int8_group_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& minimum, const c10::optional<at::Tensor>& bias) {
  const char* op = "int8_group_linear_q8";
  const int64_t N = check_group_q8_args(op, x, codes, 8, scale, minimum, "minimum");
  const float* bias_p = optional_bias(op, bias, N);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  group_linear_q8<8>(x.data_ptr<float>(), M, x.size(1), codes.data_ptr<uint8_t>(), N, scale.data_ptr<float>(),
                     minimum.data_ptr<float>(), bias_p, out.data_ptr<float>());
  return out;
}

// int4_group_linear_q8(x [M, K] float32, codes [N, K / 2] uint8 from pack_int4_group_q8, scale [N, K / 32]
// float32, zero [N, K / 32] float32, bias [N] float32 or None) -> [M, N] float32: W[n, k] = c * scale + zero
// with codes c in [0, 15], two to a byte: in each super-block, the codes of chunk j (j < 4) in the low nibbles
// and those of chunk j + 4 in the high ones of the same bytes (so one load and two masks give two chunks).
at::Tensor int4_group_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                                const at::Tensor& zero, const c10::optional<at::Tensor>& bias) {
  const char* op = "int4_group_linear_q8";
  const int64_t N = check_group_q8_args(op, x, codes, 4, scale, zero, "zero");
  const float* bias_p = optional_bias(op, bias, N);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  group_linear_q8<4>(x.data_ptr<float>(), M, x.size(1), codes.data_ptr<uint8_t>(), N, scale.data_ptr<float>(),
                     zero.data_ptr<float>(), bias_p, out.data_ptr<float>());
  return out;
}

// Groups per super-block in this build (16 on AVX-512 VNNI, else 8).
int64_t group_q8_lanes() { return kL; }

// The permutation of one row's columns into the packed order: position p of a packed row holds column
// source_column(p). Exposed so the Python side packs and unpacks with one index (pack: packed = codes[:, index]).
at::Tensor int8_group_q8_order(int64_t K) {
  TORCH_CHECK(K > 0 && K % kG == 0, "int8_group_q8_order: K must be a positive multiple of 32, got ", K);
  at::Tensor index = at::empty({K}, at::kLong);
  int64_t* p = index.data_ptr<int64_t>();
  const int64_t groups = K / kG;
  for (int64_t g0 = 0; g0 < groups; g0 += kL) {
    const int64_t ng = std::min<int64_t>(kL, groups - g0);
    for (int64_t j = 0; j < kChunks; ++j)
      for (int64_t l = 0; l < ng; ++l)
        for (int64_t b = 0; b < 4; ++b) p[g0 * kG + (j * ng + l) * 4 + b] = (g0 + l) * kG + 4 * j + b;
  }
  return index;
}

}  // namespace llminfer

TORCH_LIBRARY_FRAGMENT(llminfer_cpu, m) {
  m.def("int8_group_linear_q8(Tensor x, Tensor codes, Tensor scale, Tensor minimum, Tensor? bias=None) -> Tensor");
  m.def("int4_group_linear_q8(Tensor x, Tensor codes, Tensor scale, Tensor zero, Tensor? bias=None) -> Tensor");
  m.def("int8_group_q8_order(int K) -> Tensor", &llminfer::int8_group_q8_order);
  m.def("group_q8_lanes() -> int", &llminfer::group_q8_lanes);
}

TORCH_LIBRARY_IMPL(llminfer_cpu, CPU, m) {
  m.impl("int8_group_linear_q8", &llminfer::int8_group_linear_q8);
  m.impl("int4_group_linear_q8", &llminfer::int4_group_linear_q8);
}
