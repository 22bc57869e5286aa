// ENDOR decoding: the batch driver (bundle walk, length checks, dispatch to one ISA) and the
// scalar reference row kernels. The AVX2 row kernels: arch/x86/endor_decode_avx2.cpp.
#include "endor_decode.h"

#include <cstring>
#include <vector>

#include "dtype.h"

namespace flash {

namespace scalar {

int64_t endor_expand16(const uint8_t* bitmap, const uint16_t* values, int64_t /*nnz*/, uint16_t* dst,
                       int64_t n) {
  int64_t k = 0;
  for (int64_t j = 0; j < n; ++j) dst[j] = (bitmap[j >> 3] >> (j & 7)) & 1 ? values[k++] : uint16_t(0);
  return k;
}

void endor_dequant(const uint8_t* codes, int bits, const uint16_t* scales, const uint16_t* biases,
                   int group_size, int64_t nnz, uint16_t* out) {
  for (int64_t i = 0; i < nnz; ++i) {
    const int q = bits == 8 ? codes[i] : (codes[i >> 1] >> ((i & 1) * 4)) & 15;
    const float prod = f16_to_f32(scales[i / group_size]) * static_cast<float>(q);
    out[i] = f32_to_f16(prod + f16_to_f32(biases[i / group_size]));
  }
}

}  // namespace scalar

namespace endor {
namespace {

inline int64_t pad4(int64_t n) { return (n + 3) & ~int64_t(3); }

int64_t popcount_bits(const uint8_t* bitmap, int64_t n) {
  const int64_t full = n / 8;
  int64_t c = 0, i = 0;
  for (; i + 8 <= full; i += 8) {
    uint64_t w;
    std::memcpy(&w, bitmap + i, 8);
    c += __builtin_popcountll(w);
  }
  for (; i < full; ++i) c += __builtin_popcount(bitmap[i]);
  if (n % 8) c += __builtin_popcount(bitmap[full] & ((1u << (n % 8)) - 1));
  return c;
}

void expand32(const uint8_t* bitmap, const uint32_t* values, uint32_t* dst, int64_t n) {
  int64_t k = 0;
  for (int64_t j = 0; j < n; ++j) dst[j] = (bitmap[j >> 3] >> (j & 7)) & 1 ? values[k++] : 0u;
}

}  // namespace

int64_t decode_bundles(const uint8_t* flat, int64_t flat_bytes, const int64_t* starts,
                       const int64_t* lengths, const int64_t* slots, int64_t count, const Role* roles,
                       int n_roles, Isa isa) {
  auto expand16 = scalar::endor_expand16;
  auto dequant = scalar::endor_dequant;
  bool simd = false;
#if FLASH_X86
  if (isa == Isa::avx2) {
    expand16 = avx2::endor_expand16;
    dequant = avx2::endor_dequant;
    simd = true;
  }
#else
  (void)isa;
#endif
  std::vector<uint16_t> scratch;
  for (int64_t b = 0; b < count; ++b) {
    int64_t pos = starts[b];
    const int64_t end = pos + lengths[b];
    if (pos < 0 || lengths[b] < 0 || end > flat_bytes) return b;
    for (int r = 0; r < n_roles; ++r) {
      const Role& role = roles[r];
      uint8_t* out = role.dest + slots[b] * role.row_bytes;
      if (role.kind == kRaw) {
        if (pos + role.row_bytes > end) return b;
        std::memcpy(out, flat + pos, role.row_bytes);
        pos += pad4(role.row_bytes);
        continue;
      }
      const int64_t n = role.n, nb = (n + 7) / 8;
      if (pos + pad4(nb) > end) return b;
      const uint8_t* bitmap = flat + pos;
      const int64_t nnz = popcount_bits(bitmap, n);
      const uint8_t* payload = bitmap + pad4(nb);
      int64_t len = pad4(nb);
      if (role.kind == kHalf || role.kind == kFloat) {
        len += pad4(nnz * (role.kind == kHalf ? 2 : 4));
        if (pos + len > end) return b;
        if (role.kind == kHalf) {
          expand16(bitmap, reinterpret_cast<const uint16_t*>(payload), nnz, reinterpret_cast<uint16_t*>(out), n);
        } else {
          expand32(bitmap, reinterpret_cast<const uint32_t*>(payload), reinterpret_cast<uint32_t*>(out), n);
        }
      } else {
        const int bits = role.kind == kQuant8 ? 8 : 4;
        const int64_t groups = (nnz + role.group_size - 1) / role.group_size;
        const int64_t code_bytes = pad4((nnz * bits + 7) / 8);
        len += code_bytes + 2 * pad4(2 * groups);
        if (pos + len > end) return b;
        const auto* scales = reinterpret_cast<const uint16_t*>(payload + code_bytes);
        const auto* biases = reinterpret_cast<const uint16_t*>(payload + code_bytes + pad4(2 * groups));
        if (static_cast<int64_t>(scratch.size()) < nnz + 8) scratch.resize(nnz + 8);
        // The AVX2 dequant takes 8 codes per scale: group sizes that are not multiples of 8 go scalar.
        (simd && role.group_size % 8 == 0 ? dequant : scalar::endor_dequant)(
            payload, bits, scales, biases, role.group_size, nnz, scratch.data());
        expand16(bitmap, scratch.data(), nnz, reinterpret_cast<uint16_t*>(out), n);
      }
      pos += len;
    }
    if (pos != end) return b;
  }
  return -1;
}

}  // namespace endor
}  // namespace flash
