// ENDOR decoding: bitmap + packed non-zeros -> dense destination rows, as bundles land in memory.
// The block format and the decode rule are specified in mlx_flash/pack/bitmap.py (the numpy twin).
// endor_decode.cpp holds the batch driver and the scalar reference (namespace flash::scalar);
// arch/x86/endor_decode_avx2.cpp the same functions for AVX2 (namespace flash::avx2), and
// arch/x86/endor_decode_avx512.cpp for AVX-512 + VBMI2 + VPCLMULQDQ (namespace flash::avx512).
#pragma once

#include <cstdint>

#include "cpu_features.h"

namespace flash::endor {

// How one role (component) of a bundle is stored.
enum Kind : int {
  kRaw = 0,     // not encoded: `row_bytes` bytes copied as they are (padded to 4 in the bundle)
  kHalf = 1,    // float16 / bfloat16 non-zeros
  kFloat = 2,   // float32 non-zeros
  kQuant8 = 3,  // 8-bit affine codes of the non-zeros -> float16
  kQuant4 = 4,  // 4-bit affine codes of the non-zeros -> float16
};

struct Role {
  uint8_t* dest;      // row 0 of the destination matrix
  int64_t row_bytes;  // bytes between destination rows (= bytes of one decoded row)
  int64_t n;          // elements per row (kRaw: unused)
  int kind;
  int group_size;     // quantized kinds: stored values per scale/bias
};

// Why a bundle was rejected.
enum Fault : int {
  kNone = 0,
  kCrc = 1,     // its bytes' crc32 differs from the expected one (corrupt bytes)
  kLayout = 2,  // its blocks do not add up to its length (bitmap popcount vs stored non-zeros,
                // truncated bundle) or it lies outside `flat`
};

struct BadBundle {
  int64_t index = -1;  // first rejected bundle (call order), -1 when every bundle decoded
  int fault = kNone;
};

// Checks and decodes bundle b (bytes flat[starts[b], starts[b] + lengths[b])) into row slots[b] of
// every role, in role order, with `isa`'s kernels: crc32 of the bundle against crcs[b] first (when
// crcs is not null), then the blocks' lengths against the bundle's. Bundles are split over the
// kernels' thread pool when `parallel`; the caller holds no lock (call with the GIL released).
// Returns the first rejected bundle; rows of other bundles may or may not be written then.
BadBundle decode_bundles(const uint8_t* flat, int64_t flat_bytes, const int64_t* starts,
                         const int64_t* lengths, const int64_t* slots, int64_t count, const Role* roles,
                         int n_roles, Isa isa, const uint32_t* crcs, bool parallel);

// crc32 of every bundle b (flat[starts[b], starts[b] + lengths[b])) against crcs[b], as
// decode_bundles does before decoding, without decoding: the first mismatch (kCrc) or bundle outside
// `flat` (kLayout). Same threading and GIL rule as decode_bundles.
BadBundle check_bundles(const uint8_t* flat, int64_t flat_bytes, const int64_t* starts, const int64_t* lengths,
                        int64_t count, const uint32_t* crcs, Isa isa, bool parallel);

// One token's FFN straight from ENDOR bundles of 16-bit payloads (kind kHalf: float16, or bfloat16
// when bf16) or 8/4-bit codes (kind kQuant8 / kQuant4, group_size values per float16 scale and bias),
// decode-matvec: bundle b (flat[starts[b], starts[b] + lengths[b])) holds n_blocks blocks, gate and
// up rows of K elements (n_blocks 3) or the up row alone (2), then the down column of D elements:
//   y[D] = sum_b a_b * down_b,  a_b = act(gate_b . x) * (up_b . x) masked to 0 unless |act| > threshold
//   (act 0: silu, 1: relu), or (n_blocks 2) a_b = relu(up_b . x + bias_b) masked to 0 unless
//   > threshold, bias_b the raw 16-bit value after the down block when up_bias, else 0.
// x: float32 [K]; y: float32 [D] (written). Bundles are split over the kernels' thread pool when
// `parallel` (call with the GIL released). Returns the first bundle whose blocks do not add up to
// its length (y is then undefined), -1 when all do.
int64_t ffn_bundles(const uint8_t* flat, int64_t flat_bytes, const int64_t* starts, const int64_t* lengths,
                    int64_t count, int n_blocks, int64_t K, int64_t D, int kind, int group_size, bool bf16,
                    bool up_bias, int act, float threshold, const float* x, float* y, Isa isa, bool parallel);

// Set bits among the first n of a bitmap (bit j = byte j / 8, bit j % 8): a block's stored values.
int64_t popcount_bits(const uint8_t* bitmap, int64_t n);

// zlib's crc32 (polynomial 0xEDB88320, the value Python's zlib.crc32 gives): continue `crc` over n
// bytes with `isa`'s kernel.
uint32_t crc32(uint32_t crc, const uint8_t* data, int64_t n, Isa isa);

}  // namespace flash::endor

// One ISA's row kernels, the same functions in flash::scalar and flash::avx2:
//   endor_expand16: dst[j] = next stored 16-bit value where bit j is set, else 0; returns the
//     values consumed (the bitmap's popcount over n bits); `values` holds nnz of them.
//   endor_expand32: the same for 32-bit values.
//   endor_dequant: out[i] = float16(float32(scale[g]) * code_i + float32(bias[g])), g = i / group_size,
//     codes of `bits` (8, or 4 two per byte low nibble first); the product is exact in float32
//     (11-bit scale x 8-bit code), so a fused multiply-add would give the same result.
//   endor_crc32_raw: the crc32 register (no pre/post inversion) after n more bytes: scalar slicing
//     by 8, AVX2 PCLMULQDQ folding, AVX-512 VPCLMULQDQ folding.
namespace flash::scalar {
int64_t endor_expand16(const uint8_t* bitmap, const uint16_t* values, int64_t nnz, uint16_t* dst, int64_t n);
int64_t endor_expand32(const uint8_t* bitmap, const uint32_t* values, int64_t nnz, uint32_t* dst, int64_t n);
void endor_dequant(const uint8_t* codes, int bits, const uint16_t* scales, const uint16_t* biases,
                   int group_size, int64_t nnz, uint16_t* out);
uint32_t endor_crc32_raw(uint32_t state, const uint8_t* data, int64_t n);
}  // namespace flash::scalar

namespace flash::avx2 {
int64_t endor_expand16(const uint8_t* bitmap, const uint16_t* values, int64_t nnz, uint16_t* dst, int64_t n);
void endor_dequant(const uint8_t* codes, int bits, const uint16_t* scales, const uint16_t* biases,
                   int group_size, int64_t nnz, uint16_t* out);
uint32_t endor_crc32_raw(uint32_t state, const uint8_t* data, int64_t n);
}  // namespace flash::avx2

namespace flash::avx512 {
int64_t endor_expand16(const uint8_t* bitmap, const uint16_t* values, int64_t nnz, uint16_t* dst, int64_t n);
int64_t endor_expand32(const uint8_t* bitmap, const uint32_t* values, int64_t nnz, uint32_t* dst, int64_t n);
void endor_dequant(const uint8_t* codes, int bits, const uint16_t* scales, const uint16_t* biases,
                   int group_size, int64_t nnz, uint16_t* out);
uint32_t endor_crc32_raw(uint32_t state, const uint8_t* data, int64_t n);
// Decode-matvec pieces (endor_ffn.cpp): x . row and y += a * row of one 16-bit block's n elements
// (float16, or bfloat16 when bf16), expanded in registers, never stored.
float endor_dot16(const uint8_t* bitmap, const uint16_t* values, bool bf16, const float* x, int64_t n);
void endor_axpy16(const uint8_t* bitmap, const uint16_t* values, bool bf16, float a, float* y, int64_t n);
}  // namespace flash::avx512
