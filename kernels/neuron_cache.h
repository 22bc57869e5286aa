// One neuron-cache update (mlx_flash/sparse/neuron_cache.py, NeuronCache.update with read=False) in
// one call: the bookkeeping of a sparse layer's decode step without a numpy call per step of it.
#pragma once

#include <cstdint>

namespace flash {

// The cache's state, updated in place: ids[capacity] (neuron of each row, -1 unused),
// slot_of[n_neurons] (row of each neuron, -1 absent), last_active[capacity], num_used;
// rows[c] + r * row_bytes[c]: row r of component c (swap-delete copies whole rows).
struct CacheState {
  int64_t* ids;
  int64_t* slot_of;
  int64_t* last_active;
  int64_t capacity;
  int64_t n_neurons;
  int64_t num_used;
  uint8_t** rows;
  const int64_t* row_bytes;
  int64_t components;
};

// What one update did (CacheUpdate's counters); overflow / fill / fill_slots are written to the
// caller's arrays (room for every active neuron), their lengths here.
struct CacheResult {
  int64_t needed, hits, evicted, rows_moved, n_fill, n_overflow, window;
};

// Make the cache hold the sorted unique neurons active[0..k) at `step`: neurons last active
// `window` or more steps ago leave; if survivors and new neurons do not fit, the oldest survivors
// not active now leave too (oldest first, row order among equals); the leaving rows are
// swap-deleted (the last live rows move into the holes, in row order); new neurons that fit
// claim rows num_used.. in id order (fill, fill_slots: the caller reads them), the rest overflow.
// scratch: 2 * capacity int64. Exactly NeuronCache.update(read=False)'s result, row for row.
CacheResult cache_update(CacheState& s, const int64_t* active, int64_t k, int64_t step, int64_t window,
                         int64_t* overflow, int64_t* fill, int64_t* fill_slots, int64_t* scratch);

}  // namespace flash
