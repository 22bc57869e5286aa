// Python binding of the neuron-cache update (kernels/neuron_cache.h), registered by ext.cpp's bind_cache.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "neuron_cache.h"

namespace nb = nanobind;

namespace {
using In64 = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Out64 = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Rows = nb::ndarray<uint8_t, nb::ndim<2>, nb::device::cpu>;
}  // namespace

void bind_cache(nb::module_& m) {
  m.def(
      "cache_update",
      [](In64 active, int64_t step, int64_t window, Out64 ids, Out64 slot_of, Out64 last_active, int64_t num_used,
         std::vector<Rows> rows, Out64 overflow, Out64 fill, Out64 fill_slots, Out64 scratch) {
        const int64_t k = static_cast<int64_t>(active.shape(0)), capacity = static_cast<int64_t>(ids.shape(0));
        const int64_t n_neurons = static_cast<int64_t>(slot_of.shape(0));
        if (static_cast<int64_t>(last_active.shape(0)) != capacity || num_used < 0 || num_used > capacity)
          throw std::invalid_argument("cache_update: ids, last_active and num_used disagree on the capacity");
        if (static_cast<int64_t>(overflow.shape(0)) < k || static_cast<int64_t>(fill.shape(0)) < k ||
            static_cast<int64_t>(fill_slots.shape(0)) < k || static_cast<int64_t>(scratch.shape(0)) < 2 * capacity)
          throw std::invalid_argument("cache_update: output arrays too short");
        const int64_t* a = active.data();
        for (int64_t i = 0; i < k; ++i)
          if (a[i] < 0 || a[i] >= n_neurons || (i > 0 && a[i] <= a[i - 1]))
            throw std::invalid_argument("cache_update: active ids not sorted, unique and below the neuron count");
        std::vector<uint8_t*> bases;
        std::vector<int64_t> row_bytes;
        for (auto& r : rows) {
          if (static_cast<int64_t>(r.shape(0)) != capacity || (capacity > 0 && r.shape(1) > 1 && r.stride(1) != 1) ||
              (capacity > 1 && r.stride(0) != static_cast<int64_t>(r.shape(1))))
            throw std::invalid_argument("cache_update: a component's rows are not a packed uint8 [capacity, bytes]");
          bases.push_back(r.data());
          row_bytes.push_back(static_cast<int64_t>(r.shape(1)));
        }
        flash::CacheState s{ids.data(), slot_of.data(), last_active.data(), capacity, n_neurons, num_used,
                            bases.data(), row_bytes.data(), static_cast<int64_t>(bases.size())};
        const flash::CacheResult r = flash::cache_update(s, a, k, step, window, overflow.data(), fill.data(),
                                                         fill_slots.data(), scratch.data());
        return std::make_tuple(s.num_used, r.hits, r.evicted, r.rows_moved, r.n_fill, r.n_overflow, r.window);
      },
      nb::arg("active"), nb::arg("step"), nb::arg("window"), nb::arg("ids"), nb::arg("slot_of"),
      nb::arg("last_active"), nb::arg("num_used"), nb::arg("rows"), nb::arg("overflow"), nb::arg("fill"),
      nb::arg("fill_slots"), nb::arg("scratch"),
      "NeuronCache.update(active, step, window, read=False) on the cache's arrays in place (ids, slot_of, "
      "last_active int64; rows: each component's uint8 [capacity, bytes] host view, swap-deleted rows copied): "
      "overflow[:n_overflow], fill[:n_fill], fill_slots[:n_fill] written (each at least len(active) long; "
      "scratch: 2 * capacity). Returns (num_used, hits, evicted, rows_moved, n_fill, n_overflow, window).");
}
