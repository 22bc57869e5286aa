// The AVX2 / FMA / F16C kernels (x86-64; chosen at run time by cpu_features.h when the CPU has all
// three). Same functions as matvec_scalar.cpp (see matvec_kernels.h); 4-bit rows are decoded 32
// elements at a time in the nibble order load32 yields, which the prepared x follows.

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../../matvec_kernels.h"
#include "../../scratch.h"
#include "simd_avx2.h"

namespace flash::avx2 {

namespace {

// Dequantise 32 consecutive quantized values (as integers in float) starting at element k.
template <bool Q4>
FLASH_AVX2 inline void load32(const uint8_t* wr, int64_t k, __m256& w0, __m256& w1, __m256& w2,
                                     __m256& w3) {
  if constexpr (Q4) {
    // Byte j of the packed row holds elements 2j (low nibble) and 2j+1 (high). Zero-extending 8
    // bytes to 32-bit lanes, then masking / shifting, yields the even and the odd elements; x is
    // pre-permuted to match (q4_position). Cheaper than per-lane variable shifts on this core.
    const __m256i mask = _mm256_set1_epi32(0xf);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k / 2)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k / 2 + 8)));
    w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
    w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    w2 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
    w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  } else {
    const uint8_t* b = wr + k;
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8))));
    w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16))));
    w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 24))));
  }
}

template <int MB, int ST, bool Q4, bool PF, int CPG>
FLASH_AVX2 void q_fwd_avx2(const Problem& p, const float* x, const float* xsum, int m0, int i0, int i1) {
  // CPG 32-element chunks per group (group size 32 * CPG), unrolled. A row's scales are converted to
  // float 8 at a time into sc first (one broadcast load per group instead of a scalar half load,
  // convert and broadcast), and alternate groups feed two accumulators, so consecutive groups do not
  // wait on each other's FMA. In a stand-alone loop (one thread, weights cache-resident) this took
  // the 4-bit group-32 kernel from 9.6 to 10.5 GB/s, group 64 from 11.2 to 11.4: the loop is bound
  // by how many vector ops the FP pipes can issue, about 21 per 32 weights before, 18 now.
  constexpr int kSpan = 256;  // groups per pass over sc
  const int K = p.K, gs = 32 * CPG, G = K / gs;
  float sc[kSpan];
  for (int i = i0; i < i1; ++i) {
    int64_t r = row_of(p, i);
    if (bad_row(p, r)) {
      for (int m = 0; m < MB; ++m) store_out_simd(p.out, p.out_dtype, int64_t(m0 + m) * p.n + i, kNaN);
      continue;
    }
    const uint8_t* next = PF ? prefetch_next_row(p, i + 1, i1, 0, G) : nullptr;
    const uint8_t* wr = p.w + r * p.w_row_bytes;
    const int64_t sb = r * p.sb_row;
    __m256 acc0[MB], acc1[MB];
    for (int m = 0; m < MB; ++m) { acc0[m] = _mm256_setzero_ps(); acc1[m] = _mm256_setzero_ps(); }
    for (int gb = 0; gb < G; gb += kSpan) {
      const int ge = std::min(G, gb + kSpan);
      int g = gb;
      for (; g + 8 <= ge; g += 8) _mm256_storeu_ps(sc + (g - gb), load8s<ST>(p.scales, sb + g));
      for (; g < ge; ++g) sc[g - gb] = ldv<ST>(p.scales, sb + g);
      for (g = gb; g < ge; ++g) {
        // One x row: two partial sums keep the FMA dependency chains within a group short too. Four
        // rows (prompts): the rows are the independent chains, so one partial each (q1 is qa) and one
        // accumulator: 13 vector registers instead of 21, which would spill. The float32 summation
        // order then differs from the one-row loop's (both within the tests' accumulation bounds).
        constexpr bool kSplit = MB < 4;
        __m256 qa[MB], qb[MB];
        __m256* q1 = kSplit ? qb : qa;  // takes the 2nd and 4th 8-lane blocks
        for (int m = 0; m < MB; ++m) { qa[m] = _mm256_setzero_ps(); qb[m] = _mm256_setzero_ps(); }
        for (int c = 0; c < CPG; ++c) {
          const int64_t k = int64_t(g) * gs + c * 32;
          prefetch_line<PF>(next, Q4 ? k / 2 : k);
          __m256 w0, w1, w2, w3;
          load32<Q4>(wr, k, w0, w1, w2, w3);
          for (int m = 0; m < MB; ++m) {
            const float* xm = x + int64_t(m0 + m) * K + k;
            qa[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), qa[m]);
            q1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), q1[m]);
            qa[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), qa[m]);
            q1[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), q1[m]);
          }
        }
        const __m256 s = _mm256_broadcast_ss(sc + (g - gb));
        for (int m = 0; m < MB; ++m) {
          if constexpr (kSplit) {
            acc0[m] = _mm256_fmadd_ps(s, _mm256_add_ps(qa[m], qb[m]), acc0[m]);
            std::swap(acc0[m], acc1[m]);
          } else {
            acc0[m] = _mm256_fmadd_ps(s, qa[m], acc0[m]);
          }
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const float bacc = row_bias_dot<ST, true>(p, sb, xsum + int64_t(m0 + m) * G, G);
      store_out_simd(p.out, p.out_dtype, int64_t(m0 + m) * p.n + i, hsum(_mm256_add_ps(acc0[m], acc1[m])) + bacc);
    }
  }
}

template <int ST, bool Q4, bool PF>
FLASH_AVX2 void q_t_avx2(const Problem& p, int k0, int k1, float* acc) {
  // acc[m][k] collects sum_i (h*s)*q, four rows per pass so each accumulator load/store serves four
  // FMAs per lane (in row order, so the float32 summation order is unchanged); the bias part sum_i h*b
  // is constant within a group, so it is collected per group (bacc) and added once at the end. Rows
  // are decoded 32 elements at a time (load32); for 4 bits that is the nibble order of the forward
  // loop, so acc holds each 32-block in that order and is put back in natural order when stored.
  constexpr int R = 4;
  const int gs = p.group_size, len = k1 - k0, g0 = k0 / gs, ng = len / gs;
  float* bacc = acc + int64_t(p.M) * len;
  std::fill(acc, acc + int64_t(p.M) * (len + ng), 0.f);
  bool bad = false;
  int i = 0;
  while (i < p.n) {
    int nr = 0;
    const uint8_t* wr[R];
    int64_t sb[R];
    int idx[R];
    for (; nr < R && i < p.n; ++i) {
      int64_t r = row_of(p, i);
      if (bad_row(p, r)) { bad = true; continue; }
      wr[nr] = p.w + r * p.w_row_bytes;
      sb[nr] = r * p.sb_row;
      idx[nr++] = i;
    }
    const uint8_t* next[R];  // the next pass's rows (at most R; bad or missing ones: nullptr)
    for (int t = 0; t < R; ++t) next[t] = PF ? prefetch_next_row(p, i + t, p.n, g0, ng) : nullptr;
    for (int t = nr; t < R; ++t) { wr[t] = wr[0]; sb[t] = sb[0]; }  // padded rows get h = 0
    for (int g = g0; g < g0 + ng; ++g) {
      float s[R], b[R];
      for (int t = 0; t < R; ++t) { s[t] = ldv<ST>(p.scales, sb[t] + g); b[t] = ldv<ST>(p.biases, sb[t] + g); }
      for (int m = 0; m < p.M; ++m) {
        const float* hm = p.in + int64_t(m) * p.n;
        __m256 hs[R];
        float hb = 0.f;  // the pass's bias part, summed in a register (one read-modify-write of bacc)
        for (int t = 0; t < R; ++t) {
          const float h = t < nr ? hm[idx[t]] : 0.f;
          hs[t] = _mm256_set1_ps(h * s[t]);
          hb += h * b[t];
        }
        bacc[int64_t(m) * ng + (g - g0)] += hb;
        float* a = acc + int64_t(m) * len - k0;
        for (int64_t k = int64_t(g) * gs; k < int64_t(g + 1) * gs; k += 32) {
          if (PF && m == 0)
            for (int t = 0; t < R; ++t) prefetch_line<PF>(next[t], Q4 ? k / 2 : k);
          __m256 v0 = _mm256_loadu_ps(a + k), v1 = _mm256_loadu_ps(a + k + 8), v2 = _mm256_loadu_ps(a + k + 16),
                 v3 = _mm256_loadu_ps(a + k + 24);
          for (int t = 0; t < R; ++t) {
            __m256 w0, w1, w2, w3;
            load32<Q4>(wr[t], k, w0, w1, w2, w3);
            v0 = _mm256_fmadd_ps(hs[t], w0, v0);
            v1 = _mm256_fmadd_ps(hs[t], w1, v1);
            v2 = _mm256_fmadd_ps(hs[t], w2, v2);
            v3 = _mm256_fmadd_ps(hs[t], w3, v3);
          }
          _mm256_storeu_ps(a + k, v0);
          _mm256_storeu_ps(a + k + 8, v1);
          _mm256_storeu_ps(a + k + 16, v2);
          _mm256_storeu_ps(a + k + 24, v3);
        }
      }
    }
  }
  for (int m = 0; m < p.M; ++m)
    for (int j = 0; j < len; ++j) {
      const int nat = Q4 ? (j & ~31) + q4_natural(j & 31) : j;
      const float v = acc[int64_t(m) * len + j] + bacc[int64_t(m) * ng + j / gs];
      store_out_simd(p.out, p.out_dtype, int64_t(m) * p.K + k0 + nat, bad ? kNaN : v);
    }
}

template <int MB, bool BF, bool PF>
FLASH_AVX2 void h_fwd_avx2(const Problem& p, const float* x, int m0, int i0, int i1) {
  const int K = p.K;
  // Lines of the row about 4 KiB ahead are requested while this one is summed: one row ahead (or
  // the hardware prefetcher alone) left lm_head-sized matvecs at ~60% of a plain streaming read.
  const int ahead = int(std::max<int64_t>(1, 4096 / std::max<int64_t>(1, p.w_row_bytes)));
  for (int i = i0; i < i1; ++i) {
    int64_t r = row_of(p, i);
    if (bad_row(p, r)) {
      for (int m = 0; m < MB; ++m) store_out_simd(p.out, p.out_dtype, int64_t(m0 + m) * p.n + i, kNaN);
      continue;
    }
    const uint8_t* next = PF ? prefetch_next_row(p, i + ahead, i1) : nullptr;
    const uint16_t* wr = reinterpret_cast<const uint16_t*>(p.w + r * p.w_row_bytes);
    __m256 a0[MB], a1[MB];
    float tail[MB];
    for (int m = 0; m < MB; ++m) { a0[m] = _mm256_setzero_ps(); a1[m] = _mm256_setzero_ps(); tail[m] = 0.f; }
    int k = 0;
    for (; k + 16 <= K; k += 16) {
      prefetch_line<PF>(next, 2 * int64_t(k));
      __m256 w0 = load8h<BF>(wr + k), w1 = load8h<BF>(wr + k + 8);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + int64_t(m0 + m) * K + k;
        a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), a0[m]);
        a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), a1[m]);
      }
    }
    for (; k + 8 <= K; k += 8) {
      __m256 w0 = load8h<BF>(wr + k);
      for (int m = 0; m < MB; ++m) a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + int64_t(m0 + m) * K + k), a0[m]);
    }
    for (; k < K; ++k) {
      float w = ldh<BF>(wr, k);
      for (int m = 0; m < MB; ++m) tail[m] += w * x[int64_t(m0 + m) * K + k];
    }
    for (int m = 0; m < MB; ++m)
      store_out_simd(p.out, p.out_dtype, int64_t(m0 + m) * p.n + i, hsum(_mm256_add_ps(a0[m], a1[m])) + tail[m]);
  }
}

template <bool BF>
FLASH_AVX2 void h_t_avx2(const Problem& p, int k0, int k1, float* acc) {
  // Four rows per pass over the accumulators, as in q_t_avx2.
  constexpr int R = 4;
  const int len = k1 - k0;
  std::fill(acc, acc + int64_t(p.M) * len, 0.f);
  bool bad = false;
  int i = 0;
  while (i < p.n) {
    int nr = 0;
    const uint16_t* wr[R];
    int idx[R];
    for (; nr < R && i < p.n; ++i) {
      int64_t r = row_of(p, i);
      if (bad_row(p, r)) { bad = true; continue; }
      wr[nr] = reinterpret_cast<const uint16_t*>(p.w + r * p.w_row_bytes) + k0;
      idx[nr++] = i;
    }
    if (const uint8_t* next = p.rows ? prefetch_next_row(p, i, p.n) : nullptr)  // gathered half rows: its first 512 bytes measured best
      prefetch_span(next + 2 * int64_t(k0), std::min<int64_t>(512, 2 * int64_t(len)));
    for (int t = nr; t < R; ++t) wr[t] = wr[0];
    for (int m = 0; m < p.M; ++m) {
      const float* hm = p.in + int64_t(m) * p.n;
      float h[R];
      for (int t = 0; t < R; ++t) h[t] = t < nr ? hm[idx[t]] : 0.f;
      const __m256 h0 = _mm256_set1_ps(h[0]), h1 = _mm256_set1_ps(h[1]), h2 = _mm256_set1_ps(h[2]),
                   h3 = _mm256_set1_ps(h[3]);
      float* a = acc + int64_t(m) * len;
      int j = 0;
      for (; j + 8 <= len; j += 8) {
        __m256 v = _mm256_loadu_ps(a + j);
        v = _mm256_fmadd_ps(h0, load8h<BF>(wr[0] + j), v);
        v = _mm256_fmadd_ps(h1, load8h<BF>(wr[1] + j), v);
        v = _mm256_fmadd_ps(h2, load8h<BF>(wr[2] + j), v);
        v = _mm256_fmadd_ps(h3, load8h<BF>(wr[3] + j), v);
        _mm256_storeu_ps(a + j, v);
      }
      for (; j < len; ++j)
        for (int t = 0; t < nr; ++t) a[j] += h[t] * ldh<BF>(wr[t], j);
    }
  }
  for (int m = 0; m < p.M; ++m)
    for (int j = 0; j < len; ++j)
      store_out_simd(p.out, p.out_dtype, int64_t(m) * p.K + k0 + j, bad ? kNaN : acc[int64_t(m) * len + j]);
}

template <int ST, bool Q4, bool PF, int CPG>
FLASH_AVX2 void q_fwd_avx2_rows(const Problem& p, const float* x, const float* xsum, int i0, int i1) {
  // One weight row per pass, also for a single x row: streaming from memory, interleaving two rows
  // measured 1.45x slower (8-bit, 49152x576: 7.3-8.3 vs 11.6 GB/s on one thread).
  int m0 = 0;
  for (; m0 + 4 <= p.M; m0 += 4) q_fwd_avx2<4, ST, Q4, PF, CPG>(p, x, xsum, m0, i0, i1);
  switch (p.M - m0) {
    case 1: q_fwd_avx2<1, ST, Q4, PF, CPG>(p, x, xsum, m0, i0, i1); break;
    case 2: q_fwd_avx2<2, ST, Q4, PF, CPG>(p, x, xsum, m0, i0, i1); break;
    case 3: q_fwd_avx2<3, ST, Q4, PF, CPG>(p, x, xsum, m0, i0, i1); break;
    default: break;
  }
}

template <int ST, bool Q4, bool PF>
FLASH_AVX2 void q_fwd_avx2_groups(const Problem& p, const float* x, const float* xsum, int i0, int i1) {
  switch (p.group_size) {  // the ops check it is 32, 64 or 128
    case 32: q_fwd_avx2_rows<ST, Q4, PF, 1>(p, x, xsum, i0, i1); break;
    case 64: q_fwd_avx2_rows<ST, Q4, PF, 2>(p, x, xsum, i0, i1); break;
    default: q_fwd_avx2_rows<ST, Q4, PF, 4>(p, x, xsum, i0, i1); break;
  }
}

// Prompts (p.M >= kTileMinRows x rows): each weight row is turned into float once per block of x
// rows (TILE_NR rows at a time, into a small panel: s*q + b for quantized weights, in the order
// load32 yields and the prepared x follows; the float value of half weights), then a TILE_MR x
// TILE_NR register tile of dot products runs over K: 12 FMAs per 3 x loads and 4 panel loads, where
// the one-row loops convert every weight again for each x row. Sums are float32 as everywhere, in
// another order.
constexpr int TILE_MR = 3, TILE_NR = 4;
thread_local std::vector<float> tl_panel;

// Panel row of quantized weight row r: w = s*q + b (one float32 rounding, as the reference's).
template <int ST, bool Q4>
FLASH_AVX2 void panel_row_q(const Problem& p, int64_t r, float* dst) {
  const int gs = p.group_size;
  const uint8_t* wr = p.w + r * p.w_row_bytes;
  for (int k = 0; k < p.K; k += gs) {
    const int64_t g = r * p.sb_row + k / gs;
    const __m256 s = _mm256_set1_ps(ldv<ST>(p.scales, g)), b = _mm256_set1_ps(ldv<ST>(p.biases, g));
    for (int c = k; c < k + gs; c += 32) {
      __m256 w0, w1, w2, w3;
      load32<Q4>(wr, c, w0, w1, w2, w3);
      _mm256_storeu_ps(dst + c, _mm256_fmadd_ps(w0, s, b));
      _mm256_storeu_ps(dst + c + 8, _mm256_fmadd_ps(w1, s, b));
      _mm256_storeu_ps(dst + c + 16, _mm256_fmadd_ps(w2, s, b));
      _mm256_storeu_ps(dst + c + 24, _mm256_fmadd_ps(w3, s, b));
    }
  }
}

template <bool BF>
FLASH_AVX2 void panel_row_h(const Problem& p, int64_t r, float* dst) {
  const uint16_t* wr = reinterpret_cast<const uint16_t*>(p.w + r * p.w_row_bytes);
  for (int k = 0; k < p.K; k += 8) _mm256_storeu_ps(dst + k, load8h<BF>(wr + k));
}

// Dot products of x rows m0 .. m0+2 (of M, each K floats, K a multiple of 8) with the 4 panel rows,
// into out[(m0 + a) * ld + col + j] (dtype out_dtype) for the ones that exist: x rows past M are read
// again as the last row, and panel rows past n_left (zero padding, another thread's rows) not stored.
FLASH_AVX2 void tile_dots(const float* x, int M, int K, const float* panel, int m0, int n_left, void* out,
                                 int out_dtype, int64_t ld, int64_t col) {
  const float* xr[TILE_MR];
  for (int a = 0; a < TILE_MR; ++a) xr[a] = x + int64_t(std::min(m0 + a, M - 1)) * K;
  __m256 acc[TILE_MR][TILE_NR];
  for (int a = 0; a < TILE_MR; ++a)
    for (int j = 0; j < TILE_NR; ++j) acc[a][j] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 8) {
    __m256 w[TILE_NR];
    for (int j = 0; j < TILE_NR; ++j) w[j] = _mm256_loadu_ps(panel + int64_t(j) * K + k);
    for (int a = 0; a < TILE_MR; ++a) {
      const __m256 xv = _mm256_loadu_ps(xr[a] + k);
      for (int j = 0; j < TILE_NR; ++j) acc[a][j] = _mm256_fmadd_ps(xv, w[j], acc[a][j]);
    }
  }
  for (int a = 0; a < TILE_MR && m0 + a < M; ++a)
    for (int j = 0; j < TILE_NR && j < n_left; ++j)
      store_out_simd(out, out_dtype, int64_t(m0 + a) * ld + col + j, hsum(acc[a][j]));
}

// Rows [i0, i1) of every x row by tiles; fill(r, dst) writes weight row r's K floats.
template <class Fill>
FLASH_AVX2 void fwd_tiles(const Problem& p, const float* x, int i0, int i1, Fill fill) {
  const int K = p.K;
  float* panel = scratch(tl_panel, size_t(TILE_NR) * K);
  // x rows per block: about 192 KiB of x stays in L2 while the panels of [i0, i1) pass by.
  const int mb = std::max(TILE_MR, int((192 << 10) / (int64_t(K) * 4)) / TILE_MR * TILE_MR);
  for (int m0 = 0; m0 < p.M; m0 += mb) {
    const int m1 = std::min(p.M, m0 + mb);
    for (int i = i0; i < i1; i += TILE_NR) {
      for (int j = 0; j < TILE_NR; ++j) {
        float* dst = panel + int64_t(j) * K;
        const int64_t r = i + j < i1 ? row_of(p, i + j) : 0;
        if (i + j >= i1) std::fill(dst, dst + K, 0.f);
        else if (bad_row(p, r)) std::fill(dst, dst + K, kNaN);
        else fill(r, dst);
      }
      for (int m = m0; m < m1; m += TILE_MR) tile_dots(x, p.M, K, panel, m, i1 - i, p.out, p.out_dtype, p.n, i);
    }
  }
}

template <bool BF, bool PF>
FLASH_AVX2 void h_fwd_avx2_rows(const Problem& p, const float* x, int i0, int i1) {
  int m0 = 0;
  for (; m0 + 4 <= p.M; m0 += 4) h_fwd_avx2<4, BF, PF>(p, x, m0, i0, i1);
  switch (p.M - m0) {
    case 1: h_fwd_avx2<1, BF, PF>(p, x, m0, i0, i1); break;
    case 2: h_fwd_avx2<2, BF, PF>(p, x, m0, i0, i1); break;
    case 3: h_fwd_avx2<3, BF, PF>(p, x, m0, i0, i1); break;
    default: break;
  }
}
// int8-activation forward (Problem::q8_activations), one x row at a time. 4-bit: a 64-element chunk
// is two 32-blocks A, B in 32 packed bytes; masking / shifting gives the even elements of A then B
// (low nibbles) and the odd ones (high nibbles), so x is pre-arranged as xe / xo per chunk (xperm).
// maddubs (u8 x s8 -> pairwise s16, at most 15*127*2) then madd (-> s32) gives per-lane partial
// sums; lanes 0-3 belong to A, 4-7 to B, each scaled by its block's s*d. 8-bit: q - 128 as s8 with
// the abs/sign trick (at most 128*127*2 per pair); the +128 part is folded into the bias term.
template <int ST, bool Q4, bool PF>
FLASH_AVX2 void q_fwd_i8_avx2(const Problem& p, const Q8X& xa, const int8_t* xperm, const float* xsum, int i0,
                                     int i1) {
  const int K = p.K, gs = p.group_size, G = K / gs, B = K / 32, bpg = gs / 32;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), bias8 = _mm256_set1_epi8(char(0x80));
  float sd[4096 / 32 + 8];  // per-block s*d of the current row (K <= 4096 here; larger K: chunks below)
  for (int i = i0; i < i1; ++i) {
    const int64_t r = row_of(p, i);
    for (int m = 0; m < p.M; ++m) {
      if (bad_row(p, r)) { store_out_simd(p.out, p.out_dtype, int64_t(m) * p.n + i, kNaN); continue; }
      const uint8_t* next = PF && m == 0 ? prefetch_next_row(p, i + 1, i1, 0, G) : nullptr;
      const uint8_t* wr = p.w + r * p.w_row_bytes;
      const int64_t sb = r * p.sb_row;
      const float* xd = xa.xd + int64_t(m) * B;
      const int8_t* xq = xa.xq + int64_t(m) * K;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      float tail = 0.f;
      // Blocks are handled in spans of at most 4096 elements so sd stays on the stack.
      for (int64_t k0 = 0; k0 < K; k0 += 4096) {
        const int64_t k1 = std::min<int64_t>(K, k0 + 4096);
        const int b0 = int(k0 / 32), nb = int((k1 - k0) / 32);
        int b = 0;
        if (bpg == 1) {
          for (; b + 8 <= nb; b += 8)
            _mm256_storeu_ps(sd + b, _mm256_mul_ps(load8s<ST>(p.scales, sb + b0 + b), _mm256_loadu_ps(xd + b0 + b)));
        } else if (bpg == 2 || bpg == 4) {  // 8 blocks take 8 / bpg scales, each repeated bpg times
          const __m256i rep = bpg == 2 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3) : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
          for (; b + 8 <= nb && (b0 + b) / bpg + 8 <= p.K / gs; b += 8)
            _mm256_storeu_ps(sd + b, _mm256_mul_ps(_mm256_permutevar8x32_ps(load8s<ST>(p.scales, sb + (b0 + b) / bpg), rep),
                                                   _mm256_loadu_ps(xd + b0 + b)));
        }
        for (; b < nb; ++b) sd[b] = ldv<ST>(p.scales, sb + (b0 + b) / bpg) * xd[b0 + b];
        if constexpr (Q4) {
          const int8_t* xp = xperm + int64_t(m) * K;
          int64_t k = k0;
          for (; k + 64 <= k1; k += 64) {
            prefetch_line<PF>(next, k / 2);
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k / 2));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + k));
            const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + k + 32));
            const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xe), ones),
                                                 _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xo), ones));
            const float* sc = sd + (k - k0) / 32;
            const __m256 scv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sc)), _mm_broadcast_ss(sc + 1), 1);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scv, acc0);
            std::swap(acc0, acc1);
          }
          if (k < k1)  // a last lone 32-block
            tail += sd[(k - k0) / 32] * float(q_block_dot(wr, k, xq, true));
        } else {
          for (int64_t k = k0; k < k1; k += 32) {
            prefetch_line<PF>(next, k);
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k)), bias8);
            const __m256i x8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
            const __m256i s32 =
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x8, q)), ones);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_broadcast_ss(sd + (k - k0) / 32), acc0);
            std::swap(acc0, acc1);
          }
        }
      }
      const float bacc = row_bias_dot<ST, Q4>(p, sb, xsum + int64_t(m) * G, G);
      store_out_simd(p.out, p.out_dtype, int64_t(m) * p.n + i, hsum(_mm256_add_ps(acc0, acc1)) + tail + bacc);
    }
  }
}
// f(A, B) with two run-time flags as std::bool_constant arguments, so each kernel variant is one
// template instance (e.g. 4-bit or not x gathered rows or not) picked at a single call site.
template <class F>
void with_flags(bool a, bool b, F&& f) {
  if (a) b ? f(std::true_type{}, std::true_type{}) : f(std::true_type{}, std::false_type{});
  else b ? f(std::false_type{}, std::true_type{}) : f(std::false_type{}, std::false_type{});
}

template <int ST>
void q_fwd_range(const Problem& p, const FwdInput& in, int i0, int i1) {
  if (in.tiles) {
    with_flags(p.fmt == FMT_Q4, false, [&](auto q4, auto) {
      fwd_tiles(p, in.x, i0, i1, [&](int64_t r, float* dst) { panel_row_q<ST, decltype(q4)::value>(p, r, dst); });
    });
    return;
  }
  if (in.q8.xq) {
    with_flags(p.fmt == FMT_Q4, p.rows != nullptr, [&](auto q4, auto pf) {
      q_fwd_i8_avx2<ST, decltype(q4)::value, decltype(pf)::value>(p, in.q8, in.xperm, in.xsum, i0, i1);
    });
    return;
  }
  // Prefetching on dense rows too: between two lines of a row the one-row loop computes long enough
  // that the hardware prefetcher alone keeps too few misses in flight on weights streamed from memory.
  with_flags(p.fmt == FMT_Q4, true, [&](auto q4, auto pf) {
    q_fwd_avx2_groups<ST, decltype(q4)::value, decltype(pf)::value>(p, in.x, in.xsum, i0, i1);
  });
}

template <int ST>
void q_t_range(const Problem& p, int k0, int k1, float* acc) {
  with_flags(p.fmt == FMT_Q4, p.rows != nullptr, [&](auto q4, auto pf) {
    q_t_avx2<ST, decltype(q4)::value, decltype(pf)::value>(p, k0, k1, acc);
  });
}

}  // namespace

void fwd_rows(const Problem& p, const FwdInput& in, int i0, int i1) {
  if (p.fmt == FMT_Q4 || p.fmt == FMT_Q8) {
    switch (p.sb_dtype) {
      case DT_F16: q_fwd_range<DT_F16>(p, in, i0, i1); break;
      case DT_BF16: q_fwd_range<DT_BF16>(p, in, i0, i1); break;
      default: q_fwd_range<DT_F32>(p, in, i0, i1);
    }
    return;
  }
  const bool bf = p.fmt == FMT_BF16;
  if (in.tiles) {
    if (bf) fwd_tiles(p, in.x, i0, i1, [&](int64_t r, float* dst) { panel_row_h<true>(p, r, dst); });
    else fwd_tiles(p, in.x, i0, i1, [&](int64_t r, float* dst) { panel_row_h<false>(p, r, dst); });
    return;
  }
  // Prefetching on dense rows too (as the quantized rows do): see h_fwd_avx2.
  with_flags(bf, true, [&](auto is_bf, auto pf) {
    h_fwd_avx2_rows<decltype(is_bf)::value, decltype(pf)::value>(p, in.x, i0, i1);
  });
}

void t_cols(const Problem& p, int k0, int k1, float* acc) {
  if (p.fmt == FMT_Q4 || p.fmt == FMT_Q8) {
    switch (p.sb_dtype) {
      case DT_F16: q_t_range<DT_F16>(p, k0, k1, acc); break;
      case DT_BF16: q_t_range<DT_BF16>(p, k0, k1, acc); break;
      default: q_t_range<DT_F32>(p, k0, k1, acc);
    }
    return;
  }
  if (p.fmt == FMT_BF16) h_t_avx2<true>(p, k0, k1, acc);
  else h_t_avx2<false>(p, k0, k1, acc);
}

// The same with AVX2: cvtps_epi32 rounds half to even (the default MXCSR mode), as nearbyint does.
FLASH_AVX2 void quantize_x(const float* in, int64_t blocks, int8_t* xq, float* xd, int32_t* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = in + b * 32;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h), d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    xd[b] = d;
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    qsum[b] = _mm_cvtsi128_si32(s);
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * 32), _mm256_permutevar8x32_epi32(p16, order));
  }
}
FLASH_AVX2 void dot_tiles(const float* x, int M, const float* w, int n, int K, float* out, int ld) {
  for (int i = 0; i < n; i += TILE_NR)
    for (int m = 0; m < M; m += TILE_MR)
      tile_dots(x, M, K, w + int64_t(i) * K, m, n - i, out, DT_F32, ld, i);
}

}  // namespace flash::avx2
