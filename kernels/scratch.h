// Per-call scratch buffers: grown on demand, never shrunk, one set per thread (thread_local vectors
// at the call sites), so warm calls allocate nothing.
#pragma once

#include <cstddef>
#include <vector>

namespace flash {

template <typename T>
inline T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace flash
