// ENDOR decode-matvec on the CPU: one token's FFN straight from the bundles as stored (see
// endor_decode.h: ffn_bundles). Each block is expanded into a scratch row that stays in L1, turned
// into float32 and used at once, so no decoded layer is written to memory and read back.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "endor_decode.h"
#include "thread_pool.h"
#include "vec.h"

namespace flash::endor {
namespace {

inline int64_t pad4(int64_t n) { return (n + 3) & ~int64_t(3); }

struct FfnJob {
  const uint8_t* flat;
  int64_t flat_bytes;
  const int64_t *starts, *lengths;
  int64_t count, per_chunk, K, D;
  int n_blocks, act;
  int kind, group_size;  // kHalf, or kQuant8 / kQuant4 with group_size stored values per scale
  bool bf16, up_bias;
  float threshold;
  const float* x;
  Isa isa;
  std::vector<float>* partial;  // [chunks][D]
  std::vector<int64_t>* bad;    // per chunk: first bad bundle or -1
};

// One block at flat[pos, end) of n elements: its bitmap, stored values (16-bit floats, or codes
// then float16 scales and biases) and bytes (-1 when it runs past end).
struct Block {
  const uint8_t* bitmap;
  const uint8_t* payload;
  int64_t nnz, bytes;
};

Block parse_block(const FfnJob& j, int64_t pos, int64_t end, int64_t n) {
  const int64_t nb = (n + 7) / 8;
  if (pos + pad4(nb) > end) return {nullptr, nullptr, 0, -1};
  const uint8_t* bitmap = j.flat + pos;
  const int64_t nnz = popcount_bits(bitmap, n);
  int64_t len = pad4(nb) + pad4(2 * nnz);
  if (j.kind != kHalf) {
    const int bits = j.kind == kQuant8 ? 8 : 4;
    len = pad4(nb) + pad4((nnz * bits + 7) / 8) + 2 * pad4(2 * ((nnz + j.group_size - 1) / j.group_size));
  }
  if (pos + len > end) return {nullptr, nullptr, 0, -1};
  return {bitmap, bitmap + pad4(nb), nnz, len};
}

// The block's stored values as 16-bit floats: the payload itself, or its codes dequantized into
// deq (float16, as the decode gives them).
const uint16_t* values_of(const FfnJob& j, const Block& blk, uint16_t* deq) {
  if (j.kind == kHalf) return reinterpret_cast<const uint16_t*>(blk.payload);
  const int bits = j.kind == kQuant8 ? 8 : 4;
  const int64_t code_bytes = pad4((blk.nnz * bits + 7) / 8);
  const int64_t groups = (blk.nnz + j.group_size - 1) / j.group_size;
  const auto* scales = reinterpret_cast<const uint16_t*>(blk.payload + code_bytes);
  const auto* biases = reinterpret_cast<const uint16_t*>(blk.payload + code_bytes + pad4(2 * groups));
#if FLASH_X86
  // (the SIMD dequants take 8 codes per scale; other group sizes go scalar, as in the decode)
  if (j.isa == Isa::avx512 && j.group_size % 8 == 0)
    avx512::endor_dequant(blk.payload, bits, scales, biases, j.group_size, blk.nnz, deq);
  else if (j.isa >= Isa::avx2 && j.group_size % 8 == 0)
    avx2::endor_dequant(blk.payload, bits, scales, biases, j.group_size, blk.nnz, deq);
  else
#endif
    scalar::endor_dequant(blk.payload, bits, scales, biases, j.group_size, blk.nnz, deq);
  return deq;
}

// The block expanded and converted into row (float32 [n]) in L1 scratch (AVX2 and scalar paths).
void block_row(const FfnJob& j, const Block& blk, const uint16_t* values, int64_t n, uint16_t* half, float* row) {
#if FLASH_X86
  if (j.isa >= Isa::avx2) {
    avx2::endor_expand16(blk.bitmap, values, blk.nnz, half, n);
    avx2::load_floats(half, j.bf16, n, row);
    return;
  }
#endif
  scalar::endor_expand16(blk.bitmap, values, blk.nnz, half, n);
  scalar::load_floats(half, j.bf16 ? DT_BF16 : DT_F16, n, row);
}

float block_dot(const FfnJob& j, const Block& blk, uint16_t* half, float* row, uint16_t* deq) {
  const uint16_t* values = values_of(j, blk, deq);
#if FLASH_X86
  if (j.isa == Isa::avx512) return avx512::endor_dot16(blk.bitmap, values, j.bf16, j.x, j.K);
#endif
  block_row(j, blk, values, j.K, half, row);
  return dot_f32(j.isa != Isa::scalar, j.x, row, static_cast<int>(j.K));
}

void block_axpy(const FfnJob& j, const Block& blk, float a, uint16_t* half, float* row, uint16_t* deq, float* y) {
  const uint16_t* values = values_of(j, blk, deq);
#if FLASH_X86
  if (j.isa == Isa::avx512) return avx512::endor_axpy16(blk.bitmap, values, j.bf16, a, y, j.D);
#endif
  block_row(j, blk, values, j.D, half, row);
  axpy_f32(j.isa != Isa::scalar, a, row, y, static_cast<int>(j.D));
}

// Bundle b's contribution added to y; false when its blocks do not add up to its length.
bool ffn_one(const FfnJob& j, int64_t b, uint16_t* half, float* row, uint16_t* deq, float* y) {
  int64_t pos = j.starts[b];
  const int64_t end = pos + j.lengths[b];
  if (pos < 0 || j.lengths[b] < 0 || end > j.flat_bytes) return false;
  const Block first = parse_block(j, pos, end, j.K);
  if (first.bytes < 0) return false;
  pos += first.bytes;
  const float f = block_dot(j, first, half, row, deq);
  float a;  // the neuron's activation times its up value (0: masked)
  if (j.n_blocks == 3) {
    const Block up = parse_block(j, pos, end, j.K);
    if (up.bytes < 0) return false;
    pos += up.bytes;
    const float u = block_dot(j, up, half, row, deq);
    const float act = j.act == 0 ? f / (1.0f + std::exp(-f)) : std::max(f, 0.0f);
    a = std::fabs(act) > j.threshold ? act * u : 0.0f;
  }
  const Block down = parse_block(j, pos, end, j.D);
  if (down.bytes < 0) return false;
  int64_t bundle_end = pos + down.bytes;
  if (j.n_blocks == 2) {
    float bias = 0.0f;
    if (j.up_bias) {  // the up row's bias: one raw 16-bit value after the down block, padded to 4 bytes
      if (bundle_end + 4 > end) return false;
      uint16_t h;
      std::memcpy(&h, j.flat + bundle_end, 2);
      bias = j.bf16 ? bf16_to_f32(h) : f16_to_f32(h);
      bundle_end += 4;
    }
    const float u = std::max(f + bias, 0.0f);
    a = u > j.threshold ? u : 0.0f;
  }
  // A masked neuron's down block is only walked over (its length checked), not expanded.
  if (a != 0.0f) block_axpy(j, down, a, half, row, deq, y);
  return bundle_end == end;
}

void ffn_chunk(const void* ctx, int chunk) {
  const FfnJob& j = *static_cast<const FfnJob*>(ctx);
  const int64_t width = std::max(j.K, j.D) + 64;
  std::vector<uint16_t> half(width), deq(width);
  std::vector<float> row(width);
  float* y = (*j.partial).data() + static_cast<int64_t>(chunk) * j.D;
  const int64_t b1 = std::min(j.count, (chunk + 1) * j.per_chunk);
  for (int64_t b = chunk * j.per_chunk; b < b1; ++b) {
    if (!ffn_one(j, b, half.data(), row.data(), deq.data(), y)) {
      (*j.bad)[chunk] = b;
      return;
    }
  }
}

}  // namespace

int64_t ffn_bundles(const uint8_t* flat, int64_t flat_bytes, const int64_t* starts, const int64_t* lengths,
                    int64_t count, int n_blocks, int64_t K, int64_t D, int kind, int group_size, bool bf16,
                    bool up_bias, int act, float threshold, const float* x, float* y, Isa isa, bool parallel) {
  std::fill(y, y + D, 0.0f);
  if (count <= 0) return -1;
  const int64_t chunks = parallel ? std::min<int64_t>(std::max<int64_t>(1, count / 128), 64) : 1;
  std::vector<float> partial(chunks * D, 0.0f);
  std::vector<int64_t> bad(chunks, -1);
  FfnJob job{flat, flat_bytes, starts, lengths, count, (count + chunks - 1) / chunks, K, D, n_blocks, act, kind,
             group_size, bf16, up_bias, threshold, x, isa, &partial, &bad};
  if (chunks == 1) ffn_chunk(&job, 0);
  else parallel_for(static_cast<int>(chunks), ffn_chunk, &job);
  for (int64_t c = 0; c < chunks; ++c)
    if (bad[c] >= 0) return bad[c];
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t i = 0; i < D; ++i) y[i] += partial[c * D + i];
  return -1;
}

}  // namespace flash::endor
