// The matvec kernels' internal interface: matvec.cpp prepares x and splits the rows / columns over
// the pool, then calls one ISA's kernels on each chunk. matvec_scalar.cpp (the reference, any CPU)
// and arch/x86/matvec_avx2.cpp (AVX2 / FMA / F16C) define the same functions in namespaces
// flash::scalar and flash::avx2; arch/x86/matvec_avx512.cpp defines fwd_rows in flash::avx512 for
// the cases avx512_fwd names (the rest run the avx2 functions). All sums are float32.
#pragma once

#include <cstdint>
#include <limits>

#include "cpu_features.h"
#include "matvec.h"

namespace flash {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// x rows from which the forward kernels run as tiles (fwd_tiles) on the SIMD path.
constexpr int kTileMinRows = 6;

inline bool bad_row(const Problem& p, int64_t r) { return r < 0 || r >= p.N; }
inline int64_t row_of(const Problem& p, int i) { return p.rows ? int64_t(p.rows[i]) : int64_t(i); }

// The 4-bit forward SIMD loop consumes a 32-element block as [0,2,..,14][1,3,..,15][16,..,30][17,..,31];
// natural index of permuted position p:
inline int q4_natural(int p) { return (p >> 4) * 16 + 2 * (p & 7) + ((p >> 3) & 1); }
// The AVX-512 loop (16 lanes) consumes it as [0,2,..,30][1,3,..,31]:
inline int q4_natural16(int p) { return 2 * (p & 15) + (p >> 4); }

// Gathered rows are not where the hardware prefetcher looks, and on dense rows it alone leaves the
// quantized one-row loop waiting on memory (the loop's compute between lines hides its streams).
// The SIMD loops prefetch the next row's weights line by line as they stream the current row at
// the same offset (one row of compute ahead; a whole row at once overflows the core's
// outstanding-miss slots), and its scales / biases of groups [g0, g0 + ng) when they start a row.
[[gnu::always_inline]] inline void prefetch_span(const void* start, int64_t bytes) {
  const char* s = static_cast<const char*>(start);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(s + o, 0, 3);
}

// Returns the next row's weights (nullptr: none). Always inlined: a call per row weighs on short rows.
[[gnu::always_inline]] inline const uint8_t* prefetch_next_row(const Problem& p, int next, int end, int g0 = 0, int ng = 0) {
  if (next >= end) return nullptr;
  const int64_t r = row_of(p, next);
  if (bad_row(p, r)) return nullptr;
  if (ng > 0) {
    const int es = p.sb_dtype == DT_F32 ? 4 : 2;
    prefetch_span(static_cast<const char*>(p.scales) + (r * p.sb_row + g0) * es, int64_t(ng) * es);
    prefetch_span(static_cast<const char*>(p.biases) + (r * p.sb_row + g0) * es, int64_t(ng) * es);
  }
  return p.w + r * p.w_row_bytes;
}

// Prefetch the line at byte offset `off` of a row (nullptr: nothing) once per 64 bytes streamed.
// PF (gathered rows) is a template flag so the dense loops carry no trace of it.
template <bool PF>
inline void prefetch_line(const uint8_t* row, int64_t off) {
  if constexpr (PF)
    if (row && (off & 63) == 0) __builtin_prefetch(row + off, 0, 3);
}

// x rounded to int8 per 32-block: xq [M, K] natural order, xd [M, K/32] block scales.
struct Q8X {
  const int8_t* xq;
  const float* xd;
};

// x of one forward problem, prepared as its kernels read it (matvec.cpp: prepare).
struct FwdInput {
  const float* x;                 // x [M, K]; 4-bit on the SIMD path: each 32-block in q4_natural order
  const float* xsum;              // quantized, not tiles: per-group sums of x [M, K / group_size]
  Q8X q8{nullptr, nullptr};       // q8_activations only
  const int8_t* xperm = nullptr;  // q8_activations, 4-bit SIMD: xq arranged per 64-chunk (avx512: 128)
  const int32_t* xoff4 = nullptr; // q8_activations, 8-bit, avx512: -128 * sum of each 4 xq [M, K / 4]
  bool tiles = false;             // several x rows: register tiles (exact float, also with q8_activations)
};

// Integer dot of one 32-block of a quantized row (natural order) with xq. 8-bit rows use q - 128
// (a signed byte, as the SIMD path needs) and fold 128*s into the bias term (which uses the
// rounded x's block sums, like everything else on this path).
inline int32_t q_block_dot(const uint8_t* wr, int64_t k, const int8_t* xq, bool q4) {
  int32_t s = 0;
  for (int j = 0; j < 32; ++j) {
    const int64_t e = k + j;
    const int q = q4 ? ((wr[e >> 1] >> ((e & 1) * 4)) & 0xf) : int(wr[e]) - 128;
    s += q * int32_t(xq[e]);
  }
  return s;
}

// One ISA's kernels:
// - fwd_rows: outputs of rows [i0, i1) of problem p for every x row (Problem::out).
// - t_cols: columns [k0, k1) of the transposed problem p (whole groups); acc: float scratch of
//   M * (k1 - k0 + (k1 - k0) / group_size + 1).
// - quantize_x: x blocks of 32 -> int8 (round half to even of x / d, d = max|x| / 127), the block
//   scales xd and the blocks' integer sums qsum.
// - dot_tiles: as flash::dot_tiles.
namespace scalar {
void fwd_rows(const Problem& p, const FwdInput& in, int i0, int i1);
void t_cols(const Problem& p, int k0, int k1, float* acc);
void quantize_x(const float* in, int64_t blocks, int8_t* xq, float* xd, int32_t* qsum);
void dot_tiles(const float* x, int M, const float* w, int n, int K, float* out, int ld);
}  // namespace scalar

#if FLASH_X86
namespace avx2 {
void fwd_rows(const Problem& p, const FwdInput& in, int i0, int i1);
void t_cols(const Problem& p, int k0, int k1, float* acc);
void quantize_x(const float* in, int64_t blocks, int8_t* xq, float* xd, int32_t* qsum);
void dot_tiles(const float* x, int M, const float* w, int n, int K, float* out, int ld);  // K % 8 == 0
}  // namespace avx2

// The forward problems the avx512 kernels take: quantized rows, one-row loops (fewer than
// kTileMinRows x rows), exact float x, or int8 x (in.q8 set) on CPUs with AVX512_VNNI. Prompts
// (tiles) and float16 / bfloat16 rows run the avx2 kernels; matvec.cpp prepares x for the kernel
// that will run (exact 4-bit: q4_natural16 here; int8: xperm per 128-chunk and xoff4).
inline bool avx512_fwd(const Problem& p, const FwdInput& in) {
  return (p.fmt == FMT_Q4 || p.fmt == FMT_Q8) && !in.tiles && (!in.q8.xq || has_avx512_vnni());
}
namespace avx512 {
void fwd_rows(const Problem& p, const FwdInput& in, int i0, int i1);  // avx512_fwd(p, in) only
}  // namespace avx512
#endif

}  // namespace flash
