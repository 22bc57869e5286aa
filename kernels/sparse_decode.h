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
  DC_AHEAD_READ,   // neurons this call started reading ahead for the next sparse layer
  DC_AHEAD_TAKEN,  // neurons of this layer's lookahead read (started by the previous layer's call) reaped
  DC_AHEAD_USED,   // of those, neurons this call needed (cache fills copied, or computed from the buffer)
  DC_AHEAD_COPIED, // of those, cache fills copied into their cache rows
  DECODE_COUNTERS
};

struct SparseDecode;

// The lookahead of a runtime's decode calls (FlashRuntime.set_lookahead): a sparse layer's call,
// given a mask of the next sparse layer's neurons predicted from its own input, starts reading
// those the next layer's cache lacks (at most `capacity`, in id order) once its own reads are in,
// into one of two buffers (the other may hold rows the call itself computes), and returns while
// they land; the next layer's call takes the neurons it needs from there (cache fills copied into
// their rows, overflow computed from the buffer) and reads the rest itself. Its reads go through an
// AIO context of their own (the layers' calls reap theirs on theirs) and a staging buffer of their
// own: a read that does not fit it is cut to the bundles that do. One per runtime, shared by its
// layers' states (raw pointers: the Python objects that own the memory outlive every call).
// Shared from this (as SparseDecode): a pointer nanobind passes back from Python shares the
// control block made in C++, so the copy a pending call holds can be dropped on MLX's stream
// thread without taking the GIL (a Python-made control block's deleter takes it, and a main
// thread that holds it while waiting for the stream, mx.clear_cache say, never lets go).
struct Lookahead : std::enable_shared_from_this<Lookahead> {
  uint64_t ctx = 0;
  uint8_t* staging = nullptr;
  int64_t staging_size = 0, capacity = 0;
  std::vector<int64_t> row_bytes;  // each component's
  std::vector<uint8_t*> rows[2];  // each component's rows (capacity of them) of the two buffers
  // the read in flight: for which layer's state, into which buffer, its neurons (sorted, row i of
  // the buffer) and their plan (plan_strided_reads' rows, the reads kept)
  const SparseDecode* target = nullptr;
  int buffer = 0;
  std::vector<int64_t> ids, plan, r0, r1, first, slots, res;
  std::vector<uint32_t> crcs;
  std::unique_ptr<flash::PlannedRead> read;
  // Forget the read in flight (waits for whatever of it is still landing).
  void drop() {
    read.reset();
    target = nullptr;
  }
};

// What one layer's calls share across tokens: the neuron cache's arrays (NeuronCache's, updated
// in place: ids, slot_of, last_active int64, used int64 [1]; rows: each component's host bytes,
// `capacity` rows of row_bytes), the streaming buffer's rows (buf: each component, buf_capacity
// rows), and how to read a bundle (one plain layer of `path`: fd, layout, plan rule, crc32 table or
// null, the crc32 pieces and each component's bytes in a bundle, a staging buffer the runtime's
// calls share, the AIO context of the stream's thread). Raw pointers: the Python objects that own
// the memory outlive the model's calls. Shared from this: see Lookahead.
struct SparseDecode : std::enable_shared_from_this<SparseDecode> {
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
  std::shared_ptr<Lookahead> lookahead;  // the runtime's, or null: no read ahead for or by this layer
};

// (y, counters): the decode step of `state`'s layer for x [..., K] holding one token. mask: bool
// [N], the neurons needed; gate_values [..., N] (sets without gate rows take them, by neuron id);
// cache and buf: the cache's and the streaming buffer's component arrays (MLX, the memory of
// state.rows / state.buf), roles: which component is up, gate (-1: none) and down_t; act and
// threshold as sparse_ffn's; step: the token's step number (the cache's clock). ahead_mask: bool
// [N of `next`], the next sparse layer's predicted neurons, read ahead into the states' shared
// Lookahead (both states must have the same one, and the same bundle layout); none: no read ahead.
std::vector<mlx::core::array> sparse_decode(const mlx::core::array& x, const std::optional<mlx::core::array>& gate_values,
                                            const mlx::core::array& mask, std::shared_ptr<SparseDecode> state,
                                            const std::vector<mlx::core::array>& cache,
                                            const std::vector<mlx::core::array>& buf, std::vector<int> roles,
                                            int act, float threshold, int64_t step,
                                            const std::optional<mlx::core::array>& ahead_mask = std::nullopt,
                                            std::shared_ptr<SparseDecode> next = nullptr);

}  // namespace flash_ext
