// A sparse layer's decode step as one CPU primitive: from the mask of the neurons a token needs to
// the layer's FFN output, with the neuron-cache update (neuron_cache.h), the reads of the neurons
// it lacks (aio_read.h: planned, read, crc32-checked, copied to their rows) and the FFN on the
// cached and the streamed rows (sparse_ffn.h) in the stream's task: no host sync, no Python per
// layer. What FlashFFN._sparse does for one token, computed the same way (bit for bit).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "aio_read.h"
#include "mlx/array.h"

namespace flash_ext {

// The counters of one call, its second output (int64 [DECODE_COUNTERS]), in this order.
enum DecodeCounter : int {
  DC_NEEDED,       // neurons the mask asked for
  DC_HITS,         // of those, cached before the call
  DC_LOADED,       // neurons read (cache fill + overflow)
  DC_BYTES,        // bytes read (staged)
  DC_READS,        // reads issued
  DC_IO_NS,        // nanoseconds in reads
  DC_MEM_NS,       // nanoseconds in the cache update and the fill's row copies
  DC_CALL_NS,      // nanoseconds of the whole call
  DC_WINDOW,       // the cache's effective window after the update (tokens)
  DC_FILL_COPIED,  // fill rows read beside the overflow, then copied into their cache rows
  DC_OVERFLOW,     // needed neurons that did not fit the cache (streamed)
  DECODE_COUNTERS
};

// What one layer's calls share across tokens: the neuron cache's arrays (NeuronCache's, updated
// in place: ids, slot_of, last_active int64, used int64 [1]; rows: each component's host bytes,
// `capacity` rows of row_bytes), the streaming buffer's rows (buf: each component, buf_capacity
// rows), and how to read a bundle (one plain layer of `path`: fd, layout, plan rule, crc32 table or
// null, the crc32 pieces and each component's bytes in a bundle, a staging buffer the runtime's
// calls share, the AIO context of the stream's thread). Raw pointers: the Python objects that own
// the memory outlive the model's calls.
struct SparseDecode {
  int64_t layer = 0, window = 1;
  std::string path;
  int64_t *ids = nullptr, *slot_of = nullptr, *last_active = nullptr, *used = nullptr;
  int64_t capacity = 0, n_neurons = 0;
  std::vector<uint8_t*> rows, buf;
  std::vector<int64_t> row_bytes;
  int64_t buf_capacity = 0;
  uint64_t ctx = 0;
  flash::StridedLayer file{};
  flash::PlanRule rule{};
  const uint32_t* table = nullptr;
  std::vector<int64_t> piece_off, piece_len, comp_off, comp_len;
  uint8_t* staging = nullptr;
  int64_t staging_size = 0, depth = 32, spin_ns = 0;
  // the most bytes a call's reads stage (-1: no limit) for the overflow (whose pieces also hold
  // at most buf_capacity rows) and for the cache fill: the runtime's and the cache's limits, cut
  // as neuron_cache.plan_chunks cuts them
  int64_t piece_bytes = -1, fill_bytes = -1;
};

// (y, counters): the decode step of `state`'s layer for x [..., K] holding one token. mask: bool
// [N], the neurons needed; gate_values [..., N] (sets without gate rows take them, by neuron id);
// cache and buf: the cache's and the streaming buffer's component arrays (MLX, the memory of
// state.rows / state.buf), roles: which component is up, gate (-1: none) and down_t; act and
// threshold as sparse_ffn's; step: the token's step number (the cache's clock).
std::vector<mlx::core::array> sparse_decode(const mlx::core::array& x, const std::optional<mlx::core::array>& gate_values,
                                            const mlx::core::array& mask, std::shared_ptr<SparseDecode> state,
                                            const std::vector<mlx::core::array>& cache,
                                            const std::vector<mlx::core::array>& buf, std::vector<int> roles,
                                            int act, float threshold, int64_t step);

}  // namespace flash_ext
