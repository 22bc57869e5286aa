// Python binding of a sparse layer's decode step (kernels/sparse_decode.h), registered by ext.cpp's bind_decode.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "aio_read.h"
#include "sparse_decode.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {
using I64 = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using CI64 = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Rows = nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Table = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Staging = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Each component's rows (uint8 [rows, bytes]) checked against the row bytes and row count.
std::vector<uint8_t*> row_bases(const std::vector<Rows>& rows, const std::vector<int64_t>& row_bytes, int64_t count,
                                const std::string& what) {
  if (rows.size() != row_bytes.size())
    throw std::invalid_argument("sparse_decode_state: " + what + " must have one array per component");
  std::vector<uint8_t*> out;
  for (size_t c = 0; c < rows.size(); ++c) {
    if (int64_t(rows[c].shape(0)) != count || int64_t(rows[c].shape(1)) != row_bytes[c])
      throw std::invalid_argument("sparse_decode_state: " + what + " rows do not match the layout");
    out.push_back(rows[c].data());
  }
  return out;
}
}  // namespace

void bind_decode(nb::module_& m) {
  nb::class_<flash_ext::SparseDecode>(m, "SparseDecode",
                                      "One sparse layer's decode state (kernels/sparse_decode.h): made by "
                                      "sparse_decode_state, passed to every sparse_decode call of the layer.");
  nb::class_<flash_ext::Lookahead>(m, "DecodeLookahead",
                                    "The lookahead of a runtime's decode calls (kernels/sparse_decode.h): made by "
                                    "sparse_decode_lookahead, given to the states of the layers that read ahead.");
  if (!flash::aio_read_available()) return;  // reads by the kernels' AIO loop only (Linux)
  m.def(
      "sparse_decode_lookahead",
      [](uint64_t ctx, Staging staging, std::vector<Rows> rows_a, std::vector<Rows> rows_b) {
        auto la = std::make_shared<flash_ext::Lookahead>();
        if (ctx == 0) throw std::invalid_argument("sparse_decode_lookahead: no AIO context");
        if (rows_a.empty() || rows_a.size() != rows_b.size())
          throw std::invalid_argument("sparse_decode_lookahead: two buffers of the same components needed");
        la->capacity = int64_t(rows_a[0].shape(0));
        for (const Rows& r : rows_a) la->row_bytes.push_back(int64_t(r.shape(1)));
        la->rows[0] = row_bases(rows_a, la->row_bytes, la->capacity, "lookahead");
        la->rows[1] = row_bases(rows_b, la->row_bytes, la->capacity, "lookahead");
        if (la->capacity < 1) throw std::invalid_argument("sparse_decode_lookahead: the buffers have no rows");
        la->ctx = ctx;
        la->staging = staging.data();
        la->staging_size = int64_t(staging.shape(0));
        return la;
      },
      nb::arg("ctx"), nb::arg("staging"), nb::arg("rows_a"), nb::arg("rows_b"),
      "The lookahead of a runtime's decode calls: an AIO context and a staging buffer of its own, and two buffers "
      "(each component's rows as uint8 [rows, bytes], the same components and rows in both). Pass it as "
      "sparse_decode_state's lookahead to the layers that read ahead or are read ahead for. The memory must "
      "outlive every call; sparse_decode_drain waits for a read in flight before it is freed.");
  m.def(
      "sparse_decode_drain", [](std::shared_ptr<flash_ext::Lookahead> la) { la->drop(); }, nb::arg("lookahead"),
      "Wait for the lookahead's read in flight, if any, and forget it (before its buffers, staging or files go).");
  m.def(
      "sparse_decode_state",
      [](int64_t layer, std::string path, int64_t window, I64 ids, I64 slot_of, I64 last_active, I64 used,
         std::vector<Rows> cache_rows, std::vector<Rows> buf_rows, uint64_t ctx, int64_t fd, int64_t count,
         int64_t offset, int64_t stride, int64_t align, bool merge, int64_t merge_gap, int64_t max_read,
         std::optional<Table> table, CI64 piece_off, CI64 piece_len, std::vector<int64_t> comp_off,
         std::vector<int64_t> comp_len, Staging staging, int64_t depth, int64_t spin_ns, std::optional<int64_t> piece_bytes,
         std::optional<int64_t> fill_bytes, std::shared_ptr<flash_ext::Lookahead> lookahead) {
        auto st = std::make_shared<flash_ext::SparseDecode>();
        const int64_t capacity = int64_t(ids.shape(0)), n_neurons = int64_t(slot_of.shape(0));
        if (int64_t(last_active.shape(0)) != capacity || used.shape(0) != 1 || n_neurons != count)
          throw std::invalid_argument("sparse_decode_state: ids, last_active, slot_of and used disagree with the layer");
        if (ctx == 0 || stride <= 0 || align <= 0 || offset < 0 || window < 1 || depth < 1)
          throw std::invalid_argument("sparse_decode_state: no AIO context, or a bad layout, window or depth");
        if (table.has_value() && int64_t(table->shape(0)) < count)
          throw std::invalid_argument("sparse_decode_state: the crc32 table has fewer entries than bundles");
        if (piece_off.shape(0) != piece_len.shape(0) || comp_off.size() != comp_len.size())
          throw std::invalid_argument("sparse_decode_state: piece or component offsets and lengths differ in length");
        for (size_t c = 0; c < comp_off.size(); ++c)
          if (comp_off[c] < 0 || comp_len[c] < 0 || comp_off[c] + comp_len[c] > stride)
            throw std::invalid_argument("sparse_decode_state: a component outside the bundle");
        for (size_t q = 0; q < piece_off.shape(0); ++q)
          if (piece_off.data()[q] < 0 || piece_len.data()[q] < 0 || piece_off.data()[q] + piece_len.data()[q] > stride)
            throw std::invalid_argument("sparse_decode_state: a checked piece outside the bundle");
        st->layer = layer;
        st->path = std::move(path);
        st->window = window;
        st->ids = ids.data();
        st->slot_of = slot_of.data();
        st->last_active = last_active.data();
        st->used = used.data();
        st->capacity = capacity;
        st->n_neurons = n_neurons;
        st->row_bytes = comp_len;
        st->rows = row_bases(cache_rows, comp_len, capacity, "cache");
        st->buf_capacity = buf_rows.empty() ? 0 : int64_t(buf_rows[0].shape(0));
        st->buf = row_bases(buf_rows, comp_len, st->buf_capacity, "buffer");
        if (st->buf_capacity < 1) throw std::invalid_argument("sparse_decode_state: the buffer has no rows");
        st->ctx = ctx;
        st->file = {fd, count, offset, stride};
        st->rule = {align, merge, merge_gap, max_read};
        st->table = table.has_value() ? table->data() : nullptr;
        st->piece_off.assign(piece_off.data(), piece_off.data() + piece_off.shape(0));
        st->piece_len.assign(piece_len.data(), piece_len.data() + piece_len.shape(0));
        st->comp_off = std::move(comp_off);
        st->comp_len = st->row_bytes;
        st->staging = staging.data();
        st->staging_size = int64_t(staging.shape(0));
        st->depth = depth;
        st->spin_ns = spin_ns;
        st->piece_bytes = piece_bytes.has_value() ? std::max<int64_t>(0, *piece_bytes) : -1;
        st->fill_bytes = fill_bytes.has_value() ? std::max<int64_t>(0, *fill_bytes) : -1;
        if (lookahead && lookahead->row_bytes != st->row_bytes)
          throw std::invalid_argument("sparse_decode_state: the lookahead's buffers do not match the layout");
        st->lookahead = std::move(lookahead);
        return st;
      },
      nb::arg("layer"), nb::arg("path"), nb::arg("window"), nb::arg("ids"), nb::arg("slot_of"), nb::arg("last_active"),
      nb::arg("used"), nb::arg("cache_rows"), nb::arg("buf_rows"), nb::arg("ctx"), nb::arg("fd"), nb::arg("count"),
      nb::arg("offset"), nb::arg("stride"), nb::arg("align"), nb::arg("merge"), nb::arg("merge_gap"),
      nb::arg("max_read"), nb::arg("table").none(), nb::arg("piece_off"), nb::arg("piece_len"), nb::arg("comp_off"),
      nb::arg("comp_len"), nb::arg("staging"), nb::arg("depth"), nb::arg("spin_ns"), nb::arg("piece_bytes").none(),
      nb::arg("fill_bytes").none(), nb::arg("lookahead").none() = nb::none(),
      "A sparse layer's decode state: its neuron cache's arrays (NeuronCache's ids, slot_of, last_active, used "
      "int64 [1], each component's rows as uint8 [capacity, bytes]: updated in place by every call), the streaming "
      "buffer's rows (uint8 [rows, bytes] per component), and its bundles' file: fd, layout (count, offset, stride), "
      "plan rule (align, merge, merge gap, max read), crc32 table (None: no check) and pieces, each component's "
      "offset and bytes in a bundle, a staging buffer, an AIO context only the CPU stream's thread uses, depth and "
      "spin; piece_bytes / fill_bytes: the most bytes a read call of the overflow (its pieces also hold at most the "
      "buffer's rows) / of the cache fill stages (None: no limit); lookahead: the runtime's "
      "(sparse_decode_lookahead), or None. The arrays must outlive every call.");
  m.def(
      "sparse_decode",
      [](const mx::array& x, std::optional<mx::array> gate_values, const mx::array& mask,
         std::shared_ptr<flash_ext::SparseDecode> state, const std::vector<mx::array>& cache,
         const std::vector<mx::array>& buf, std::vector<int> roles, int act, float threshold, int64_t step,
         std::optional<mx::array> ahead_mask, std::shared_ptr<flash_ext::SparseDecode> next) {
        auto out = flash_ext::sparse_decode(x, gate_values, mask, std::move(state), cache, buf, std::move(roles), act,
                                            threshold, step, ahead_mask, std::move(next));
        return std::make_tuple(out[0], out[1]);
      },
      nb::arg("x"), nb::arg("gate_values").none(), nb::arg("mask"), nb::arg("state"), nb::arg("cache"), nb::arg("buf"),
      nb::arg("roles"), nb::arg("act"), nb::arg("threshold"), nb::arg("step"),
      nb::arg("ahead_mask").none() = nb::none(), nb::arg("next").none() = nb::none(),
      "(y, counters): one token's step of a sparse layer as one CPU primitive: the cache updated for the neurons of "
      "mask (bool [N]) at `step`, the ones it lacks read (fill and overflow), y = sparse_ffn over the cached rows "
      "and the streamed ones (act, threshold, gate_values as sparse_ffn's; roles: up, gate or -1, down_t component "
      "indices of cache / buf, the state's arrays as MLX arrays); ahead_mask (bool [N of next]) with next (the next "
      "sparse layer's state, the same lookahead): its predicted neurons start landing in the lookahead's buffer "
      "once this layer's own reads are in. counters: int64 [15] (needed, hits, loaded, bytes, reads, io ns, mem "
      "ns, call ns, window, fill copied, overflow, ahead read, ahead taken, ahead used, ahead copied). Read errors "
      "raise when evaluated.");
}
