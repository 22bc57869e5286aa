// The AVX-512 forward kernels of quantized rows (x86-64; chosen at run time by cpu_features.h, Isa::avx512):
// flash::avx512::fwd_rows for the problems avx512_fwd (matvec_kernels.h) names: 4- and 8-bit affine
// rows, group sizes 32 / 64 / 128, float32 / float16 / bfloat16 scales, 1-5 x rows, dense or gathered
// rows; x exact float, or int8 (Problem::q8_activations) on CPUs with AVX512_VNNI. Everything else
// (prompt tiles, int8 activations without VNNI, half rows, the transposed kernels, quantize_x,
// dot_tiles) runs the avx2 kernels.
// Exact x: sums are float32 in 16 lanes: 8-bit rows as the avx2 loop (sum_g s_g * sum(q x) + sum_g
// b_g * sum_g(x)); 4-bit rows as sum(x * (s q + b)) with each weight dequantized once (one rounding,
// as mx.dequantize), so they differ from the avx2 kernel's by float32 rounding. A 4-bit 32-element
// block is 16 packed bytes widened to 16 dwords, its low nibbles the even elements and its high
// nibbles the odd ones, so x is prepared per 32-block as [0,2,..,30][1,3,..,31] (q4_natural16).
// int8 x (vpdpbusd): outputs identical to the avx2 int8 kernel's, bit for bit (same int32 dot
// products, same float32 operations in the same order; see q_fwd_i8).

#include <immintrin.h>

#include <algorithm>

#include "../../matvec_kernels.h"
#include "simd_avx2.h"

// Every function here is only called when cpu_features found AVX-512 F/BW/VL (Isa::avx512); the
// FLASH_AVX512_VNNI ones only when it found AVX512_VNNI too (has_avx512_vnni, via avx512_fwd).
#define FLASH_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define FLASH_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

namespace flash::avx512 {

namespace {

// Mask of the first n (<= 16 meaningful) lanes.
FLASH_AVX512 inline __mmask16 first_lanes(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// Lanes `lanes` of 16 scale-like values of dtype ST from element i, as float32 (others 0, not read).
template <int ST>
FLASH_AVX512 inline __m512 load16s(const void* base, int64_t i, __mmask16 lanes) {
  if constexpr (ST == DT_F32) {
    return _mm512_maskz_loadu_ps(lanes, static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(lanes, static_cast<const uint16_t*>(base) + i);
    if constexpr (ST == DT_F16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// The 8-bit values of the 32-element block at element k as float: elements k..k+15, k+16..k+31.
FLASH_AVX512 inline void load32_q8(const uint8_t* wr, int64_t k, __m512& w0, __m512& w1) {
  w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k))));
  w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16))));
}

// sum_g b_g * xsum_g over a row's G groups, in 16 lanes.
template <int ST>
FLASH_AVX512 inline __m512 row_bias_dot(const Problem& p, int64_t sb, const float* xsum, int G) {
  __m512 acc = _mm512_setzero_ps();
  for (int g = 0; g < G; g += 16) {
    const __mmask16 lanes = first_lanes(G - g);
    acc = _mm512_fmadd_ps(load16s<ST>(p.biases, sb + g, lanes), _mm512_maskz_loadu_ps(lanes, xsum + g), acc);
  }
  return acc;
}

// A row's scales (and 4-bit: biases) of groups [gb, ge) as float32, 16 at a time, into sc / bc.
template <int ST>
FLASH_AVX512 inline void convert_groups(const void* src, int64_t sb, int gb, int ge, float* dst) {
  for (int g = gb; g < ge; g += 16) _mm512_store_ps(dst + (g - gb), load16s<ST>(src, sb + g, first_lanes(ge - g)));
}

constexpr int kSpan = 256;  // groups per pass over a row's converted scales

// Outputs are summed across lanes 16 rows at a time: a row's 16-lane sum goes into sums[m][j] (j: its
// place among the batch's rows, an out-of-range row's all NaN), and flush_rows sums each of the 16
// across its lanes with one 16 x 16 transpose-add (about 3 vector ops per row; a horizontal sum per
// row and a store per output were over a third of the time of a 576-wide row) and stores them with
// one store_floats call per x row.
FLASH_AVX512 inline __m512 lane_sums16(const float (*v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j) {  // per 128-bit block: [v0 0+2, v1 0+2, v0 1+3, v1 1+3] of rows 2j, 2j+1
    const __m512 x = _mm512_load_ps(v[2 * j]), y = _mm512_load_ps(v[2 * j + 1]);
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int j = 0; j < 4; ++j)  // per 128-bit block: the block's sums of rows 4j .. 4j+3
    b[j] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * j], a[2 * j + 1], 0x44), _mm512_shuffle_ps(a[2 * j], a[2 * j + 1], 0xee));
  for (int j = 0; j < 2; ++j)  // blocks: rows 8j..8j+3 over blocks 0+1 and 2+3, rows 8j+4..8j+7 the same
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88), _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

template <int MB>
FLASH_AVX512 inline void flush_rows(const Problem& p, int m0, float (*sums)[16][16], int first, int count) {
  alignas(64) float t[16];
  for (int m = 0; m < MB; ++m) {
    _mm512_store_ps(t, lane_sums16(sums[m]));
    store_floats(p.out, p.out_dtype, int64_t(m0 + m) * p.n + first, count, t);
  }
}

// Row i (of [i0, i1)) starts: the 16-row batch it closes is flushed; an out-of-range row's sums are
// NaN (false); else wr = its weights, next = the next row's (prefetched; none: its own), sb = its
// scales' offset.
template <int MB>
FLASH_AVX512 inline bool start_row(const Problem& p, int m0, float (*sums)[16][16], int i0, int i, int i1, int G,
                                   const uint8_t*& wr, const uint8_t*& next, int64_t& sb) {
  const int j = (i - i0) % 16;
  if (j == 0 && i > i0) flush_rows<MB>(p, m0, sums, i - 16, 16);
  const int64_t r = row_of(p, i);
  if (bad_row(p, r)) {
    for (int m = 0; m < MB; ++m) _mm512_store_ps(sums[m][j], _mm512_set1_ps(kNaN));
    return false;
  }
  wr = p.w + r * p.w_row_bytes;
  next = prefetch_next_row(p, i + 1, i1, 0, G);
  if (!next) next = wr;
  sb = r * p.sb_row;
  return true;
}

// 4-bit rows [i0, i1) for x rows m0 .. m0 + MB - 1; CPG 32-element blocks per group. A group's 16
// possible weights s*q + b (one float32 rounding each, as mx.dequantize's) are one register, and
// vpermps picks each lane's weight by the low 4 bits of its index: a block's 16 packed bytes widened
// to dwords index the even elements as they are and the odd ones shifted by 4. That is 6 vector ops
// per 32 weights (avx2: 14 plus a scale FMA per group and the bias dot). Blocks alternate between
// two pairs of accumulators so the FMA chains of consecutive blocks do not wait on each other.
template <int MB, int ST, int CPG>
FLASH_AVX512 void q4_fwd(const Problem& p, const float* x, int m0, int i0, int i1) {
  const int K = p.K, G = K / (32 * CPG);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float sc[kSpan], bc[kSpan], sums[MB][16][16];
  for (int i = i0; i < i1; ++i) {
    const int j = (i - i0) % 16;
    const uint8_t *wr, *next;
    int64_t sb;
    if (!start_row<MB>(p, m0, sums, i0, i, i1, G, wr, next, sb)) continue;
    __m512 a0[MB], a1[MB], b0[MB], b1[MB];
    for (int m = 0; m < MB; ++m) a0[m] = a1[m] = b0[m] = b1[m] = _mm512_setzero_ps();
    for (int gb = 0; gb < G; gb += kSpan) {
      const int ge = std::min(G, gb + kSpan);
      convert_groups<ST>(p.scales, sb, gb, ge, sc);
      convert_groups<ST>(p.biases, sb, gb, ge, bc);
      __m512 table = iota;
      // Block blk (of the row) into accumulators lo / hi; new_group: blk starts a group.
      auto block = [&](int64_t blk, bool new_group, __m512* lo, __m512* hi) FLASH_AVX512 {
        if (new_group) {
          const int g = int(blk / CPG) - gb;
          table = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[g]), _mm512_set1_ps(bc[g]));
        }
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + blk * 16)));
        const __m512 w0 = _mm512_permutexvar_ps(q, table), w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
        for (int m = 0; m < MB; ++m) {
          const float* xm = x + int64_t(m0 + m) * K + blk * 32;
          lo[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), lo[m]);
          hi[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), hi[m]);
        }
      };
      // Four blocks (one 64-byte line of weights, one prefetch, no branch) per step: the loop's scalar
      // work (addresses, the prefetch test) per block otherwise competes with its 6 vector ops for
      // issue slots. Spans start at multiples of 256 groups, so steps start at group boundaries.
      const int64_t e = int64_t(ge) * CPG;
      int64_t blk = int64_t(gb) * CPG;
      for (; blk + 4 <= e; blk += 4) {
        __builtin_prefetch(next + blk * 16, 0, 3);
        block(blk, true, a0, a1);
        block(blk + 1, CPG == 1, b0, b1);
        block(blk + 2, CPG <= 2, a0, a1);
        block(blk + 3, CPG == 1, b0, b1);
      }
      for (; blk < e; ++blk) block(blk, blk % CPG == 0, blk % 2 ? b0 : a0, blk % 2 ? b1 : a1);
    }
    for (int m = 0; m < MB; ++m)
      _mm512_store_ps(sums[m][j], _mm512_add_ps(_mm512_add_ps(a0[m], a1[m]), _mm512_add_ps(b0[m], b1[m])));
  }
  if (i1 > i0) flush_rows<MB>(p, m0, sums, i1 - 1 - (i1 - 1 - i0) % 16, (i1 - 1 - i0) % 16 + 1);
}

// 8-bit rows [i0, i1) for x rows m0 .. m0 + MB - 1; CPG 32-element blocks per group. As the avx2 loop:
// a row's scales converted into sc first, two partial sums per group, alternate groups on two
// accumulators, the biases through x's group sums; 6 vector ops per 32 weights (avx2: 12).
template <int MB, int ST, int CPG>
FLASH_AVX512 void q8_fwd(const Problem& p, const float* x, const float* xsum, int m0, int i0, int i1) {
  const int K = p.K, gs = 32 * CPG, G = K / gs;
  alignas(64) float sc[kSpan], sums[MB][16][16];
  for (int i = i0; i < i1; ++i) {
    const int j = (i - i0) % 16;
    const uint8_t *wr, *next;
    int64_t sb;
    if (!start_row<MB>(p, m0, sums, i0, i, i1, G, wr, next, sb)) continue;
    __m512 acc0[MB], acc1[MB];
    for (int m = 0; m < MB; ++m) { acc0[m] = _mm512_setzero_ps(); acc1[m] = _mm512_setzero_ps(); }
    for (int gb = 0; gb < G; gb += kSpan) {
      const int ge = std::min(G, gb + kSpan);
      convert_groups<ST>(p.scales, sb, gb, ge, sc);
      for (int g = gb; g < ge; ++g) {
        __m512 qa[MB], qb[MB];
        for (int m = 0; m < MB; ++m) { qa[m] = _mm512_setzero_ps(); qb[m] = _mm512_setzero_ps(); }
        for (int c = 0; c < CPG; ++c) {
          const int64_t k = int64_t(g) * gs + c * 32;
          __builtin_prefetch(next + k, 0, 3);  // each half line: cheaper than testing which half
          __m512 w0, w1;
          load32_q8(wr, k, w0, w1);
          for (int m = 0; m < MB; ++m) {
            const float* xm = x + int64_t(m0 + m) * K + k;
            qa[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), qa[m]);
            qb[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), qb[m]);
          }
        }
        const __m512 s = _mm512_set1_ps(sc[g - gb]);
        for (int m = 0; m < MB; ++m) {
          acc0[m] = _mm512_fmadd_ps(s, _mm512_add_ps(qa[m], qb[m]), acc0[m]);
          std::swap(acc0[m], acc1[m]);
        }
      }
    }
    for (int m = 0; m < MB; ++m)
      _mm512_store_ps(sums[m][j], _mm512_add_ps(_mm512_add_ps(acc0[m], acc1[m]),
                                                row_bias_dot<ST>(p, sb, xsum + int64_t(m0 + m) * G, G)));
  }
  if (i1 > i0) flush_rows<MB>(p, m0, sums, i1 - 1 - (i1 - 1 - i0) % 16, (i1 - 1 - i0) % 16 + 1);
}

template <int MB, int ST, bool Q4, int CPG>
FLASH_AVX512 void q_fwd(const Problem& p, const float* x, const float* xsum, int m0, int i0, int i1) {
  if constexpr (Q4) q4_fwd<MB, ST, CPG>(p, x, m0, i0, i1);
  else q8_fwd<MB, ST, CPG>(p, x, xsum, m0, i0, i1);
}

template <int ST, bool Q4, int CPG>
FLASH_AVX512 void q_fwd_rows(const Problem& p, const float* x, const float* xsum, int i0, int i1) {
  int m0 = 0;
  for (; m0 + 4 <= p.M; m0 += 4) q_fwd<4, ST, Q4, CPG>(p, x, xsum, m0, i0, i1);
  switch (p.M - m0) {
    case 1: q_fwd<1, ST, Q4, CPG>(p, x, xsum, m0, i0, i1); break;
    case 2: q_fwd<2, ST, Q4, CPG>(p, x, xsum, m0, i0, i1); break;
    case 3: q_fwd<3, ST, Q4, CPG>(p, x, xsum, m0, i0, i1); break;
    default: break;
  }
}

template <int ST, bool Q4>
void q_fwd_groups(const Problem& p, const FwdInput& in, int i0, int i1) {
  switch (p.group_size) {  // the ops check it is 32, 64 or 128
    case 32: q_fwd_rows<ST, Q4, 1>(p, in.x, in.xsum, i0, i1); break;
    case 64: q_fwd_rows<ST, Q4, 2>(p, in.x, in.xsum, i0, i1); break;
    default: q_fwd_rows<ST, Q4, 4>(p, in.x, in.xsum, i0, i1); break;
  }
}

// int8-activation forward (Problem::q8_activations; only on CPUs with AVX512_VNNI), rows [i0, i1) for
// the MB x rows, each output the avx2 kernel's (q_fwd_i8_avx2) bit for bit: the same int32 partial
// sums (one per 8 weights of 4-bit rows, per 4 of 8-bit ones), each scaled by its block's s*d into the
// same float32 lane. The avx2 kernel alternates two 8-lane accumulators between consecutive steps
// (4-bit: 64-element chunks; 8-bit: 32-blocks); here one 16-lane step takes two of them, so its low
// half is the avx2 even accumulator, its high half the odd one, and a last odd step the low half only.
// Weights are read once for all MB x rows. 4-bit: a 128-element chunk is 64 packed bytes, low
// nibbles the even elements and high nibbles the odd ones, so x is arranged per 128-chunk as its even
// elements then its odd ones (xperm; a last 64-chunk as avx2's). 8-bit: vpdpbusd takes q unsigned,
// so each lane starts at -128 times its 4 x's sum (xoff4) to give the avx2 kernel's sum of (q - 128) x.
template <int MB, int ST, bool Q4>
FLASH_AVX512_VNNI void q_fwd_i8(const Problem& p, const FwdInput& in, int i0, int i1) {
  const int K = p.K, G = K / p.group_size, B = K / 32, shift = p.group_size == 32 ? 0 : p.group_size == 64 ? 1 : 2;
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i block_group = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), shift);
  // the block (of 16) of each lane of a step's int32 sums: a step takes 4 blocks (4-bit) or 2 (8-bit)
  const __m512i first_step = Q4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i next_step = _mm512_set1_epi32(Q4 ? 4 : 2);
  for (int i = i0; i < i1; ++i) {
    const int64_t r = row_of(p, i);
    if (bad_row(p, r)) {
      for (int m = 0; m < MB; ++m) avx2::store_out_simd(p.out, p.out_dtype, int64_t(m) * p.n + i, kNaN);
      continue;
    }
    const uint8_t* wr = p.w + r * p.w_row_bytes;
    const uint8_t* next = prefetch_next_row(p, i + 1, i1, 0, G);
    if (!next) next = wr;
    const int64_t sb = r * p.sb_row;
    __m512 acc[MB];
    float tail[MB];
    for (int m = 0; m < MB; ++m) { acc[m] = _mm512_setzero_ps(); tail[m] = 0.f; }
    // 16 blocks at a time: their s*d in a register (one rounding, as the avx2 kernel's), each step's
    // 16 lanes of it picked by vpermps; whole steps, then at the row's end a last odd 64-chunk (4-bit)
    // or 32-block (8-bit) into the low half, then (4-bit) a lone 32-block as avx2's scalar tail.
    for (int b = 0; b < B; b += 16) {
      const int blocks = std::min(16, B - b), g = b >> shift, groups = ((b + blocks - 1) >> shift) - g + 1;
      const __m512 s = _mm512_permutexvar_ps(block_group, load16s<ST>(p.scales, sb + g, first_lanes(groups)));
      __m512 sd[MB];
      for (int m = 0; m < MB; ++m) sd[m] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(first_lanes(blocks), in.q8.xd + int64_t(m) * B + b));
      __m512i lanes = first_step;
      int64_t k = int64_t(b) * 32;
      const int64_t ke = k + 32 * blocks;
      if constexpr (Q4) {
        for (; k + 128 <= ke; k += 128, lanes = _mm512_add_epi32(lanes, next_step)) {
          __builtin_prefetch(next + k / 2, 0, 3);
          const __m512i v = _mm512_loadu_si512(wr + k / 2);
          const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int m = 0; m < MB; ++m) {
            const int8_t* xp = in.xperm + int64_t(m) * K + k;
            const __m512i s32 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp)), hi,
                                                    _mm512_loadu_si512(xp + 64));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32), _mm512_permutexvar_ps(lanes, sd[m]), acc[m]);
          }
        }
        if (k + 64 <= ke) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k / 2));
          const __m256i lo = _mm256_and_si256(v, _mm512_castsi512_si256(low)),
                        hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm512_castsi512_si256(low));
          for (int m = 0; m < MB; ++m) {
            const int8_t* xp = in.xperm + int64_t(m) * K + k;
            const __m256i s32 = _mm256_dpbusd_epi32(
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp))), hi,
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32)));
            acc[m] = _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(_mm256_cvtepi32_ps(s32)), _mm512_permutexvar_ps(lanes, sd[m]),
                                           acc[m], 0xff);
          }
          k += 64;
        }
        if (k < ke) {
          const __m512i lone = _mm512_set1_epi32(int(k / 32) - b);
          for (int m = 0; m < MB; ++m)
            tail[m] += _mm512_cvtss_f32(_mm512_permutexvar_ps(lone, sd[m])) * float(q_block_dot(wr, k, in.q8.xq + int64_t(m) * K, true));
        }
      } else {
        for (; k + 64 <= ke; k += 64, lanes = _mm512_add_epi32(lanes, next_step)) {
          __builtin_prefetch(next + k, 0, 3);
          const __m512i q = _mm512_loadu_si512(wr + k);
          for (int m = 0; m < MB; ++m) {
            const int64_t at = int64_t(m) * K + k;
            const __m512i s32 = _mm512_dpbusd_epi32(_mm512_loadu_si512(in.xoff4 + at / 4), q, _mm512_loadu_si512(in.q8.xq + at));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32), _mm512_permutexvar_ps(lanes, sd[m]), acc[m]);
          }
        }
        if (k < ke) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k));
          for (int m = 0; m < MB; ++m) {
            const int64_t at = int64_t(m) * K + k;
            const __m256i s32 = _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.xoff4 + at / 4)), q,
                                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.q8.xq + at)));
            acc[m] = _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(_mm256_cvtepi32_ps(s32)), _mm512_permutexvar_ps(lanes, sd[m]),
                                           acc[m], 0xff);
          }
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(acc[m]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m]), 1)));
      const float bacc = avx2::row_bias_dot<ST, Q4>(p, sb, in.xsum + int64_t(m) * G, G);
      avx2::store_out_simd(p.out, p.out_dtype, int64_t(m) * p.n + i, avx2::hsum(v) + tail[m] + bacc);
    }
  }
}

template <int ST, bool Q4>
void q_fwd_i8_rows(const Problem& p, const FwdInput& in, int i0, int i1) {
  switch (p.M) {  // fewer than kTileMinRows x rows
    case 1: q_fwd_i8<1, ST, Q4>(p, in, i0, i1); break;
    case 2: q_fwd_i8<2, ST, Q4>(p, in, i0, i1); break;
    case 3: q_fwd_i8<3, ST, Q4>(p, in, i0, i1); break;
    case 4: q_fwd_i8<4, ST, Q4>(p, in, i0, i1); break;
    default: q_fwd_i8<5, ST, Q4>(p, in, i0, i1); break;
  }
}

template <int ST>
void q_fwd_range(const Problem& p, const FwdInput& in, int i0, int i1) {
  if (in.q8.xq) {
    if (p.fmt == FMT_Q4) q_fwd_i8_rows<ST, true>(p, in, i0, i1);
    else q_fwd_i8_rows<ST, false>(p, in, i0, i1);
  } else if (p.fmt == FMT_Q4) {
    q_fwd_groups<ST, true>(p, in, i0, i1);
  } else {
    q_fwd_groups<ST, false>(p, in, i0, i1);
  }
}

}  // namespace

void fwd_rows(const Problem& p, const FwdInput& in, int i0, int i1) {
  switch (p.sb_dtype) {
    case DT_F16: q_fwd_range<DT_F16>(p, in, i0, i1); break;
    case DT_BF16: q_fwd_range<DT_BF16>(p, in, i0, i1); break;
    default: q_fwd_range<DT_F32>(p, in, i0, i1);
  }
}

}  // namespace flash::avx512
