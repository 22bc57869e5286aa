// CPU matvec kernels on MLX weight layouts; no MLX dependency (tested through the extension).
#pragma once

#include <cstdint>

#include "dtype.h"

namespace flash {

enum WeightFormat : int { FMT_Q4 = 0, FMT_Q8 = 1, FMT_F16 = 2, FMT_BF16 = 3 };

// One matvec problem. Row r of W starts at w + r * w_row_bytes.
// Forward:    out[m, i] = dot(W[row(i)], x[m])          x [M, K], out [M, n]
// Transposed: out[m, k] = sum_i h[m, i] * W[row(i), k]    h [M, n], out [M, K]
// row(i) = rows[i] when rows != nullptr, else i (a prefix of W).
struct Problem {
  int fmt = FMT_F16;
  int sb_dtype = DT_F16;  // dtype of scales / biases (quantized formats)
  int group_size = 64;
  int M = 1, K = 0, n = 0, N = 0;  // N: rows in W (for index checks)
  const uint8_t* w = nullptr;
  int64_t w_row_bytes = 0;
  const void* scales = nullptr;
  const void* biases = nullptr;
  int64_t sb_row = 0;  // scale/bias elements per row
  const int32_t* rows = nullptr;
  const float* in = nullptr;  // x [M, K] (forward) or h [M, n] (transposed), float32, contiguous
  void* out = nullptr;        // [M, n] (forward) or [M, K] (transposed), out_dtype, contiguous
  int out_dtype = DT_F32;
  // Quantized forward only: round x to int8 per 32-element block (scale max|x|/127, as llama.cpp's
  // q8 activations) and use integer dot products. Faster, but x carries that rounding error. Applies
  // to fewer than 6 x rows (decode); prompts run the exact float tiles, faster there.
  bool q8_activations = false;
};

// Runs the problem on the calling thread plus the persistent pool. Rows outside [0, N) give NaN.
void matvec(const Problem& p);
void matvec_t(const Problem& p);

// Several forward problems in one pool dispatch (fused q/k/v, gate/up). Without an epilogue the
// rows of all problems are split into chunks by bytes. With one, the problems must have equal n and
// M ("paired"): each chunk computes rows [i0, i1) of every problem, then calls epilogue(ctx, i0, i1)
// on the same thread (e.g. SwiGLU of gate and up rows i0..i1).
constexpr int kMaxProblems = 4;
using RowEpilogue = void (*)(const void* ctx, int i0, int i1);
void matvec_many(const Problem* ps, int count, RowEpilogue epilogue = nullptr, const void* epilogue_ctx = nullptr);

// Any number of forward problems in one pool dispatch (a layer's experts: their gate and up
// projections, then their down projections). Rows are split into chunks by bytes as matvec_many's
// split mode does; problems reading the same x (in, M, K, format, group size, q8) share its
// preparation. A row's result depends on its problem only, never on the others or their order.
void matvec_batch(const Problem* ps, int count);

// out[m * ld + i] = x[m] . w[i] for m < M, i < n (float32 rows of K; the SIMD path reads w's rows
// in blocks of 4, so w must hold a multiple of 4 rows, zero past n). Register tiles of 3 x 4 dots,
// the prompt matvecs' kernel (attention scores use it for blocks of queries).
void dot_tiles(const float* x, int M, const float* w, int n, int K, float* out, int ld);

}  // namespace flash
