// Copying staged direct-I/O reads out to their destination rows (io.loader's staged path).
#pragma once

#include <cstdint>

#include "cpu_features.h"

namespace flash {

// dest + slots[b] * dest_stride <- flat + starts[b], `length` bytes, for b in 0..count-1.
// The avx2 version writes rows of whole 64-byte lines at 64-byte aligned addresses with streaming
// stores (no read-for-ownership of destination lines nobody reads before the copy: about a third
// less memory traffic, which is what bounds a copy out of freshly read memory); others use memcpy.
void copy_rows(const uint8_t* flat, const int64_t* starts, int64_t length, uint8_t* dest,
               int64_t dest_stride, const int64_t* slots, int64_t count, Isa isa);

namespace scalar {
void copy_rows(const uint8_t* flat, const int64_t* starts, int64_t length, uint8_t* dest,
               int64_t dest_stride, const int64_t* slots, int64_t count);
}
#if FLASH_X86
namespace avx2 {
void copy_rows(const uint8_t* flat, const int64_t* starts, int64_t length, uint8_t* dest,
               int64_t dest_stride, const int64_t* slots, int64_t count);
}
#endif

}  // namespace flash
