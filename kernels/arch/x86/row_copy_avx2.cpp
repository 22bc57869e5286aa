// copy_rows for AVX2 (the scalar reference: row_copy.cpp): streaming stores into whole, aligned
// 64-byte lines; rows that are not (odd lengths or addresses) go through memcpy.
#include <immintrin.h>

#include <cstring>

#include "../../row_copy.h"

namespace flash::avx2 {

FLASH_AVX2 void copy_rows(const uint8_t* flat, const int64_t* starts, int64_t length, uint8_t* dest,
                          int64_t dest_stride, const int64_t* slots, int64_t count) {
  bool streamed = false;
  for (int64_t b = 0; b < count; ++b) {
    const uint8_t* src = flat + starts[b];
    uint8_t* dst = dest + slots[b] * dest_stride;
    if ((reinterpret_cast<uintptr_t>(dst) & 63) != 0 || (length & 63) != 0) {
      std::memcpy(dst, src, length);
      continue;
    }
    streamed = true;
    for (int64_t i = 0; i < length; i += 64) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), lo);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), hi);
    }
  }
  if (streamed) _mm_sfence();  // streaming stores are weakly ordered: visible before we return
}

}  // namespace flash::avx2
