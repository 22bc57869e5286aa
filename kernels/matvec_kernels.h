// The matvec kernels' internal interface: matvec.cpp prepares x and splits the rows / columns over
// the pool, then calls one ISA's kernels on each chunk. matvec_scalar.cpp (the reference, any CPU)
// and arch/x86/matvec_avx2.cpp (AVX2 / FMA / F16C) define the same functions in namespaces
// flash::scalar and flash::avx2. All sums are float32.
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
  const int8_t* xperm = nullptr;  // q8_activations, 4-bit SIMD: xq arranged per 64-chunk
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
#endif

}  // namespace flash
