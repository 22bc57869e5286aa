// ENDOR decoding: the batch driver (bundle walk, length checks, dispatch to one ISA) and the
// scalar reference row kernels. The AVX2 row kernels: arch/x86/endor_decode_avx2.cpp.
#include "endor_decode.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "thread_pool.h"

namespace flash {

namespace scalar {

int64_t endor_expand16(const uint8_t* bitmap, const uint16_t* values, int64_t /*nnz*/, uint16_t* dst,
                       int64_t n) {
  int64_t k = 0;
  for (int64_t j = 0; j < n; ++j) dst[j] = (bitmap[j >> 3] >> (j & 7)) & 1 ? values[k++] : uint16_t(0);
  return k;
}

int64_t endor_expand32(const uint8_t* bitmap, const uint32_t* values, int64_t /*nnz*/, uint32_t* dst,
                       int64_t n) {
  int64_t k = 0;
  for (int64_t j = 0; j < n; ++j) dst[j] = (bitmap[j >> 3] >> (j & 7)) & 1 ? values[k++] : 0u;
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

// crc32 tables for slicing by 8: table[0] is the bytewise table, table[k][i] the crc of byte i
// followed by k zero bytes.
struct Crc32Tables {
  uint32_t t[8][256];
  constexpr Crc32Tables() : t{} {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (int i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
};
constexpr Crc32Tables kCrc32;

}  // namespace
}  // namespace endor

namespace endor {

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

}  // namespace endor

uint32_t scalar::endor_crc32_raw(uint32_t state, const uint8_t* p, int64_t n) {
  const auto& t = endor::kCrc32.t;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts (x86-64, arm64)
    const uint32_t lo = static_cast<uint32_t>(w) ^ state, hi = static_cast<uint32_t>(w >> 32);
    state = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
            t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n) state = t[0][(state ^ *p++) & 0xff] ^ (state >> 8);
  return state;
}

namespace endor {
namespace {

struct Kernels {
  decltype(&scalar::endor_expand16) expand16 = scalar::endor_expand16;
  decltype(&scalar::endor_expand32) expand32 = scalar::endor_expand32;
  decltype(&scalar::endor_dequant) dequant = scalar::endor_dequant;
  bool simd = false;
};

Kernels kernels_for(Isa isa) {
#if FLASH_X86
  if (isa == Isa::avx512) return {avx512::endor_expand16, avx512::endor_expand32, avx512::endor_dequant, true};
  if (isa == Isa::avx2) return {avx2::endor_expand16, scalar::endor_expand32, avx2::endor_dequant, true};
#else
  (void)isa;
#endif
  return {};
}

// Decodes one bundle into its rows; false when its blocks do not add up to its length.
bool decode_one(const uint8_t* flat, int64_t pos, int64_t end, int64_t slot, const Role* roles, int n_roles,
                const Kernels& k, std::vector<uint16_t>& scratch) {
  for (int r = 0; r < n_roles; ++r) {
    const Role& role = roles[r];
    uint8_t* out = role.dest + slot * role.row_bytes;
    if (role.kind == kRaw) {
      if (pos + role.row_bytes > end) return false;
      std::memcpy(out, flat + pos, role.row_bytes);
      pos += pad4(role.row_bytes);
      continue;
    }
    const int64_t n = role.n, nb = (n + 7) / 8;
    if (pos + pad4(nb) > end) return false;
    const uint8_t* bitmap = flat + pos;
    const int64_t nnz = popcount_bits(bitmap, n);
    const uint8_t* payload = bitmap + pad4(nb);
    int64_t len = pad4(nb);
    if (role.kind == kHalf || role.kind == kFloat) {
      len += pad4(nnz * (role.kind == kHalf ? 2 : 4));
      if (pos + len > end) return false;
      if (role.kind == kHalf) {
        k.expand16(bitmap, reinterpret_cast<const uint16_t*>(payload), nnz, reinterpret_cast<uint16_t*>(out), n);
      } else {
        k.expand32(bitmap, reinterpret_cast<const uint32_t*>(payload), nnz, reinterpret_cast<uint32_t*>(out), n);
      }
    } else {
      const int bits = role.kind == kQuant8 ? 8 : 4;
      const int64_t groups = (nnz + role.group_size - 1) / role.group_size;
      const int64_t code_bytes = pad4((nnz * bits + 7) / 8);
      len += code_bytes + 2 * pad4(2 * groups);
      if (pos + len > end) return false;
      const auto* scales = reinterpret_cast<const uint16_t*>(payload + code_bytes);
      const auto* biases = reinterpret_cast<const uint16_t*>(payload + code_bytes + pad4(2 * groups));
      if (static_cast<int64_t>(scratch.size()) < nnz + 8) scratch.resize(nnz + 8);
      // The AVX2 dequant takes 8 codes per scale: group sizes that are not multiples of 8 go scalar.
      (k.simd && role.group_size % 8 == 0 ? k.dequant : scalar::endor_dequant)(
          payload, bits, scales, biases, role.group_size, nnz, scratch.data());
      k.expand16(bitmap, scratch.data(), nnz, reinterpret_cast<uint16_t*>(out), n);
    }
    pos += len;
  }
  return pos == end;
}

struct Batch {
  const uint8_t* flat;
  int64_t flat_bytes;
  const int64_t *starts, *lengths, *slots;  // slots null: check only
  int64_t count, per_chunk;
  const Role* roles;
  int n_roles;
  Kernels kernels;
  Isa isa;
  const uint32_t* crcs;
  std::vector<BadBundle>* bad;  // per chunk
};

void run_chunk(const void* ctx, int chunk) {
  const Batch& j = *static_cast<const Batch*>(ctx);
  std::vector<uint16_t> scratch;
  const int64_t b1 = std::min(j.count, (chunk + 1) * j.per_chunk);
  for (int64_t b = chunk * j.per_chunk; b < b1; ++b) {
    const int64_t pos = j.starts[b], len = j.lengths[b];
    if (pos < 0 || len < 0 || pos + len > j.flat_bytes) {
      (*j.bad)[chunk] = {b, kLayout};
      return;
    }
    if (j.crcs && crc32(0, j.flat + pos, len, j.isa) != j.crcs[b]) {
      (*j.bad)[chunk] = {b, kCrc};
      return;
    }
    if (j.slots && !decode_one(j.flat, pos, pos + len, j.slots[b], j.roles, j.n_roles, j.kernels, scratch)) {
      (*j.bad)[chunk] = {b, kLayout};
      return;
    }
  }
}

}  // namespace

uint32_t crc32(uint32_t crc, const uint8_t* data, int64_t n, Isa isa) {
#if FLASH_X86
  if (isa == Isa::avx512) return ~avx512::endor_crc32_raw(~crc, data, n);
  if (isa == Isa::avx2) return ~avx2::endor_crc32_raw(~crc, data, n);
#else
  (void)isa;
#endif
  return ~scalar::endor_crc32_raw(~crc, data, n);
}

BadBundle decode_bundles(const uint8_t* flat, int64_t flat_bytes, const int64_t* starts,
                         const int64_t* lengths, const int64_t* slots, int64_t count, const Role* roles,
                         int n_roles, Isa isa, const uint32_t* crcs, bool parallel) {
  const Kernels k = kernels_for(isa);
  if (count <= 0) return {};
  // ~64 bundles per chunk (a few hundred KB): chunks are claimed from one counter, so a thread
  // that is descheduled on a shared machine leaves its share to the others.
  const int64_t chunks = parallel ? std::min<int64_t>(std::max<int64_t>(1, count / 64), 4096) : 1;
  std::vector<BadBundle> bad(chunks);
  Batch job{flat, flat_bytes, starts, lengths, slots, count, (count + chunks - 1) / chunks, roles, n_roles,
            k, isa, crcs, &bad};
  if (chunks == 1) run_chunk(&job, 0);
  else parallel_for(static_cast<int>(chunks), run_chunk, &job);
  for (const BadBundle& b : bad)
    if (b.index >= 0) return b;  // chunks cover increasing bundle ranges: the first is the earliest
  return {};
}

BadBundle check_bundles(const uint8_t* flat, int64_t flat_bytes, const int64_t* starts, const int64_t* lengths,
                        int64_t count, const uint32_t* crcs, Isa isa, bool parallel) {
  return decode_bundles(flat, flat_bytes, starts, lengths, nullptr, count, nullptr, 0, isa, crcs, parallel);
}

}  // namespace endor
}  // namespace flash
