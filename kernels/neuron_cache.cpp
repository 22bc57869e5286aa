// neuron_cache.h: NeuronCache.update(read=False) in one call (portable: index work and row memcpy).
#include "neuron_cache.h"

#include <algorithm>
#include <cstring>

namespace flash {

namespace {

// Swap-delete rows `gone` (ascending, unique, < num_used), as NeuronCache.delete does.
int64_t swap_delete(CacheState& s, const int64_t* gone, int64_t count, int64_t* is_gone) {
  if (count == 0) return 0;
  const int64_t n_after = s.num_used - count;
  for (int64_t r = n_after; r < s.num_used; ++r) is_gone[r - n_after] = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (gone[i] >= n_after) is_gone[gone[i] - n_after] = 1;
    s.slot_of[s.ids[gone[i]]] = -1;
  }
  int64_t moved = 0, mover = n_after;
  for (int64_t i = 0; i < count && gone[i] < n_after; ++i) {  // holes in row order, movers in row order
    while (is_gone[mover - n_after]) ++mover;
    const int64_t hole = gone[i];
    for (int64_t c = 0; c < s.components; ++c)
      std::memcpy(s.rows[c] + hole * s.row_bytes[c], s.rows[c] + mover * s.row_bytes[c], s.row_bytes[c]);
    s.ids[hole] = s.ids[mover];
    s.last_active[hole] = s.last_active[mover];
    s.slot_of[s.ids[hole]] = hole;
    ++mover;
    ++moved;
  }
  for (int64_t r = n_after; r < s.num_used; ++r) s.ids[r] = -1;
  s.num_used = n_after;
  return moved;
}

}  // namespace

CacheResult cache_update(CacheState& s, const int64_t* active, int64_t k, int64_t step, int64_t window,
                         int64_t* overflow, int64_t* fill, int64_t* fill_slots, int64_t* scratch) {
  CacheResult out{};
  out.needed = k;
  int64_t n_new = 0;
  for (int64_t i = 0; i < k; ++i) {  // hits refresh their row; new neurons kept in id order (overflow as scratch)
    const int64_t slot = s.slot_of[active[i]];
    if (slot >= 0) {
      s.last_active[slot] = step;
      ++out.hits;
    } else {
      overflow[n_new++] = active[i];
    }
  }
  int64_t* gone = scratch;  // rows that leave, ascending
  int64_t* order = scratch + s.capacity;
  int64_t n_gone = 0;
  for (int64_t r = 0; r < s.num_used; ++r)
    if (s.last_active[r] <= step - window) gone[n_gone++] = r;
  int64_t room = s.capacity - (s.num_used - n_gone);
  if (n_new > room) {  // shrink the window: the oldest survivors not active now, oldest first (stable)
    int64_t n_old = 0;
    for (int64_t r = 0; r < s.num_used; ++r)
      if (s.last_active[r] > step - window && s.last_active[r] < step) order[n_old++] = r;
    std::stable_sort(order, order + n_old, [&](int64_t a, int64_t b) { return s.last_active[a] < s.last_active[b]; });
    const int64_t extra = std::min(n_old, n_new - room);
    for (int64_t i = 0; i < extra; ++i) gone[n_gone++] = order[i];
    std::sort(gone, gone + n_gone);  // delete takes the rows sorted (np.unique)
    room += extra;
  }
  out.evicted = n_gone;
  out.rows_moved = swap_delete(s, gone, n_gone, order);
  out.n_fill = std::max<int64_t>(0, std::min(room, n_new));
  for (int64_t i = 0; i < out.n_fill; ++i) {  // claim rows num_used.. for the new neurons that fit
    const int64_t slot = s.num_used + i, neuron = overflow[i];
    fill[i] = neuron;
    fill_slots[i] = slot;
    s.ids[slot] = neuron;
    s.slot_of[neuron] = slot;
    s.last_active[slot] = step;
  }
  s.num_used += out.n_fill;
  out.n_overflow = n_new - out.n_fill;
  std::memmove(overflow, overflow + out.n_fill, sizeof(int64_t) * out.n_overflow);
  if (s.num_used > 0) {
    int64_t oldest = s.last_active[0];
    for (int64_t r = 1; r < s.num_used; ++r) oldest = std::min(oldest, s.last_active[r]);
    out.window = step - oldest + 1;
  }
  return out;
}

}  // namespace flash
