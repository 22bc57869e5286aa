// The scalar reference of copy_rows (memcpy per row) and its dispatch (row_copy.h).
#include "row_copy.h"

#include <cstring>

namespace flash {

void scalar::copy_rows(const uint8_t* flat, const int64_t* starts, int64_t length, uint8_t* dest,
                       int64_t dest_stride, const int64_t* slots, int64_t count) {
  for (int64_t b = 0; b < count; ++b) std::memcpy(dest + slots[b] * dest_stride, flat + starts[b], length);
}

void copy_rows(const uint8_t* flat, const int64_t* starts, int64_t length, uint8_t* dest,
               int64_t dest_stride, const int64_t* slots, int64_t count, Isa isa) {
#if FLASH_X86
  if (isa >= Isa::avx2) return avx2::copy_rows(flat, starts, length, dest, dest_stride, slots, count);
#else
  (void)isa;
#endif
  scalar::copy_rows(flat, starts, length, dest, dest_stride, slots, count);
}

}  // namespace flash
