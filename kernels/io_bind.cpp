// Python binding of the read engine (kernels/aio_read.h), registered by ext.cpp's bind_io.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "aio_read.h"
#include "read_plan.h"

namespace nb = nanobind;

namespace {
using I64 = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U64 = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Flags = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Results = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Bytes1 = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Crcs = nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Counts = nb::ndarray<int64_t, nb::shape<2>, nb::c_contig, nb::device::cpu>;
using Plan = nb::ndarray<int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Staging = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Table = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Rows = nb::ndarray<uint8_t, nb::ndim<2>, nb::device::cpu>;
// (offset in a bundle, bytes, uint8 rows [n, >= bytes]): where one component of each bundle goes.
using Target = std::tuple<int64_t, int64_t, Rows>;
// (flat, first, starts, piece offsets, piece lengths, crcs out): aio_read's crc32 of landed bundles.
using Landed = std::tuple<Bytes1, I64, I64, I64, I64, Crcs>;
// Where each target's component goes (aio_read_staged's StagedBundles fields) and the bundle bytes
// the targets touch.
struct TargetRows {
  std::vector<uint8_t*> dest;
  std::vector<int64_t> off, len, stride;
  int64_t extent = 0;
};

// The targets checked (offsets and lengths >= 0, rows contiguous and wide enough, every slot a row)
// and unpacked; std::invalid_argument naming `op` otherwise.
TargetRows unpack_targets(std::vector<Target>& targets, const I64& slots, const std::string& op) {
  TargetRows t;
  const int64_t n = static_cast<int64_t>(slots.shape(0));
  for (auto& [off, len, rows] : targets) {
    if (off < 0 || len < 0 || rows.stride(1) != 1 || static_cast<int64_t>(rows.shape(1)) < len)
      throw std::invalid_argument(op + ": a target's rows are not contiguous or too short");
    for (int64_t i = 0; i < n; ++i)
      if (slots.data()[i] < 0 || slots.data()[i] >= static_cast<int64_t>(rows.shape(0)))
        throw std::invalid_argument(op + ": slot out of range");
    t.extent = std::max(t.extent, off + len);
    t.dest.push_back(rows.data());
    t.off.push_back(off);
    t.len.push_back(len);
    t.stride.push_back(static_cast<int64_t>(rows.stride(0)));
  }
  return t;
}

// The bundle bytes the crc32 pieces cover (offsets and lengths checked >= 0, equal in number).
int64_t piece_extent(const I64& piece_off, const I64& piece_len, const std::string& op) {
  if (piece_off.shape(0) != piece_len.shape(0))
    throw std::invalid_argument(op + ": piece offsets and lengths differ in length");
  int64_t extent = 0;
  for (size_t q = 0; q < piece_off.shape(0); ++q) {
    if (piece_off.data()[q] < 0 || piece_len.data()[q] < 0) throw std::invalid_argument(op + ": negative piece");
    extent = std::max(extent, piece_off.data()[q] + piece_len.data()[q]);
  }
  return extent;
}
}  // namespace

void bind_io(nb::module_& m) {
  m.def(
      "plan_strided_reads",
      [](I64 ids, int64_t count, int64_t offset, int64_t stride, int64_t align, bool merge, int64_t merge_gap,
         int64_t max_read, Plan out) {
        const int64_t n = static_cast<int64_t>(ids.shape(0));
        if (out.shape(0) != 8 || static_cast<int64_t>(out.shape(1)) != n)
          throw std::invalid_argument("plan_strided_reads: out must be int64 [8, len(ids)]");
        if (stride <= 0 || align <= 0 || offset < 0)
          throw std::invalid_argument("plan_strided_reads: stride and align must be > 0, offset >= 0");
        int64_t* o = out.data();
        return flash::plan_strided_reads(n, ids.data(), count, offset, stride, align, merge, merge_gap, max_read,
                                         o, o + n, o + 2 * n, o + 3 * n, o + 4 * n, o + 5 * n, o + 6 * n, o + 7 * n);
      },
      nb::arg("ids"), nb::arg("count"), nb::arg("offset"), nb::arg("stride"), nb::arg("align"), nb::arg("merge"),
      nb::arg("merge_gap"), nb::arg("max_read"), nb::arg("out"),
      "The read plan of bundles `ids` of a plain layer (bundle i: stride bytes at offset + i * stride) as "
      "io.planner.plan_read_arrays makes it: out rows <- sorted ids, index, starts, lengths, r0, r1, first, "
      "member_read (r0, r1, first: the first k entries). Returns k (reads), -1 (an id outside 0..count-1) or -2 "
      "(duplicate ids).");
  if (!flash::aio_read_available()) return;  // io.aio keeps its own loop (not Linux)
  m.def(
      "aio_read",
      [](uint64_t ctx, I64 fds, I64 offsets, I64 sizes, U64 addresses, std::optional<Flags> vectored, int64_t depth,
         Results res, std::optional<Landed> landed, int64_t spin_ns, std::optional<Counts> waits) {
        const size_t n = fds.shape(0);
        if (offsets.shape(0) != n || sizes.shape(0) != n || addresses.shape(0) != n || res.shape(0) != n ||
            (vectored.has_value() && vectored->shape(0) != n))
          throw std::invalid_argument("aio_read: fds, offsets, sizes, addresses, vectored and res differ in length");
        if (ctx == 0) throw std::invalid_argument("aio_read: no AIO context");
        const uint8_t* vec = vectored.has_value() ? vectored->data() : nullptr;
        flash::LandedCrcs crcs{};
        if (landed.has_value()) {
          auto& [flat, first, starts, piece_off, piece_len, out] = *landed;
          const int64_t bundles = static_cast<int64_t>(starts.shape(0)), size = static_cast<int64_t>(flat.shape(0));
          if (first.shape(0) != n + 1 || out.shape(0) != starts.shape(0) || piece_len.shape(0) != piece_off.shape(0))
            throw std::invalid_argument("aio_read: landed crc32 arrays do not match the reads");
          for (size_t k = 0; k < n; ++k)
            if (first.data()[k] < 0 || first.data()[k] > first.data()[k + 1] || first.data()[k + 1] > bundles)
              throw std::invalid_argument("aio_read: landed bundles of a read out of range");
          int64_t extent = 0;
          for (size_t p = 0; p < piece_off.shape(0); ++p) {
            if (piece_off.data()[p] < 0 || piece_len.data()[p] < 0)
              throw std::invalid_argument("aio_read: negative bundle piece");
            extent = std::max(extent, piece_off.data()[p] + piece_len.data()[p]);
          }
          for (int64_t b = 0; b < bundles; ++b)
            if (starts.data()[b] < 0 || starts.data()[b] > size - extent)
              throw std::invalid_argument("aio_read: a landed bundle runs outside flat");
          crcs = {flat.data(), first.data(), starts.data(), piece_off.data(), piece_len.data(),
                  static_cast<int64_t>(piece_off.shape(0)), out.data(), flash::active_isa()};
        }
        int64_t error;
        {
          nb::gil_scoped_release release;
          error = flash::aio_read_all(ctx, static_cast<int64_t>(n), fds.data(), offsets.data(), sizes.data(),
                                      addresses.data(), vec, depth, res.data(),
                                      landed.has_value() ? &crcs : nullptr, spin_ns,
                                      waits.has_value() ? waits->data() : nullptr);
        }
        return error;
      },
      nb::arg("ctx"), nb::arg("fds"), nb::arg("offsets"), nb::arg("sizes"), nb::arg("addresses"),
      nb::arg("vectored").none(), nb::arg("depth"), nb::arg("res"), nb::arg("landed").none() = nb::none(),
      nb::arg("spin_ns") = 0, nb::arg("waits").none() = nb::none(),
      "Every read i (sizes[i] bytes at offsets[i] of fds[i] into addresses[i]; vectored[i] != 0: an array of "
      "sizes[i] iovecs there) through the io_setup context ctx with at most depth in flight, in one loop with "
      "the GIL released; res[i] <- bytes read or -errno. Returns 0 or the -errno of a failed io_submit / "
      "io_getevents (every submitted read has completed by then). landed: (flat, first, starts, piece_off, "
      "piece_len, crcs): as read k lands whole (plain reads), crcs[b] <- the crc32 of bundle b (flat[starts[b]:], "
      "chained over the pieces) for b in first[k]..first[k + 1] - 1, while later reads are in flight. spin_ns: "
      "watch the completion ring this long before each blocking io_getevents (0: block at once); waits: "
      "int64[2] += (waits ended while spinning, waits that blocked).");
  m.def(
      "aio_read_ids",
      [](uint64_t ctx, int64_t fd, int64_t count, int64_t offset, int64_t stride, int64_t align, bool merge,
         int64_t merge_gap, int64_t max_read, I64 ids, I64 slots, std::optional<Table> table, Staging staging,
         I64 piece_off, I64 piece_len, std::vector<Target> targets, int64_t depth, int64_t spin_ns,
         std::optional<Counts> waits, Plan plan, Results res, Crcs crcs) {
        const int64_t n = static_cast<int64_t>(ids.shape(0));
        if (ctx == 0) throw std::invalid_argument("aio_read_ids: no AIO context");
        if (static_cast<int64_t>(slots.shape(0)) != n || plan.shape(0) != 8 ||
            static_cast<int64_t>(plan.shape(1)) != n || static_cast<int64_t>(res.shape(0)) < n ||
            static_cast<int64_t>(crcs.shape(0)) < n)
          throw std::invalid_argument("aio_read_ids: slots, plan [8, n], res and crcs must match ids");
        if (stride <= 0 || align <= 0 || offset < 0 || count < 0)
          throw std::invalid_argument("aio_read_ids: stride and align must be > 0, offset and count >= 0");
        if (table.has_value() && static_cast<int64_t>(table->shape(0)) < count)
          throw std::invalid_argument("aio_read_ids: the crc32 table has fewer entries than bundles");
        if (piece_extent(piece_off, piece_len, "aio_read_ids") > stride)
          throw std::invalid_argument("aio_read_ids: a checked piece outside the bundle");
        TargetRows t = unpack_targets(targets, slots, "aio_read_ids");
        if (t.extent > stride) throw std::invalid_argument("aio_read_ids: a target outside the bundle");
        const flash::StagedBundles b{nullptr, nullptr, 0, nullptr, piece_off.data(), piece_len.data(),
                                     static_cast<int64_t>(piece_off.shape(0)), t.off.data(), t.len.data(), t.dest.data(),
                                     t.stride.data(), static_cast<int64_t>(t.dest.size()), nullptr};
        flash::IdsRead r;
        {
          nb::gil_scoped_release release;
          r = flash::aio_read_ids(ctx, flash::StridedLayer{fd, count, offset, stride},
                                  flash::PlanRule{align, merge, merge_gap, max_read}, n, ids.data(), slots.data(),
                                  table.has_value() ? table->data() : nullptr, staging.data(),
                                  static_cast<int64_t>(staging.shape(0)), depth, spin_ns,
                                  waits.has_value() ? waits->data() : nullptr, plan.data(), res.data(), crcs.data(), b);
        }
        return std::make_tuple(r.reads, r.staged, r.fits, r.status, r.bad);
      },
      nb::arg("ctx"), nb::arg("fd"), nb::arg("count"), nb::arg("offset"), nb::arg("stride"), nb::arg("align"),
      nb::arg("merge"), nb::arg("merge_gap"), nb::arg("max_read"), nb::arg("ids"), nb::arg("slots"),
      nb::arg("table").none(), nb::arg("staging"), nb::arg("piece_off"), nb::arg("piece_len"), nb::arg("targets"),
      nb::arg("depth"), nb::arg("spin_ns"), nb::arg("waits").none(), nb::arg("plan"), nb::arg("res"), nb::arg("crcs"),
      "A decode call from bundle ids to rows in one go (kernels/aio_read.h, aio_read_ids): bundles ids of a plain "
      "layer (bundle i: stride bytes at offset + i * stride of fd) planned as plan_strided_reads plans them (plan "
      "<- its rows), staged back to back, checked against table[id] (crc32 over the pieces; None: no check) and "
      "copied to row slots[i] of each target (offset, bytes, uint8 rows). Returns (reads, staged bytes, fits, "
      "status, bad): reads < 0 a bad id (-1 out of range, -2 repeated) and fits False (the plan needs more than "
      "the staging given): nothing read; else status and bad as aio_read_staged's.");
  m.def(
      "aio_read_staged",
      [](uint64_t ctx, int64_t fd, I64 r0, I64 r1, I64 pos, I64 first, I64 starts, I64 ids, std::optional<Table> table,
         Staging staging, I64 piece_off, I64 piece_len, std::vector<Target> targets, I64 slots, int64_t depth,
         int64_t spin_ns, std::optional<Counts> waits, Results res, Crcs crcs) {
        const int64_t n = static_cast<int64_t>(r0.shape(0)), bundles = static_cast<int64_t>(starts.shape(0));
        const int64_t size = static_cast<int64_t>(staging.shape(0));
        if (ctx == 0) throw std::invalid_argument("aio_read_staged: no AIO context");
        if (static_cast<int64_t>(r1.shape(0)) != n || static_cast<int64_t>(pos.shape(0)) != n ||
            static_cast<int64_t>(res.shape(0)) != n || static_cast<int64_t>(first.shape(0)) != n + 1)
          throw std::invalid_argument("aio_read_staged: r0, r1, pos, res and first[:-1] differ in length");
        if (static_cast<int64_t>(ids.shape(0)) != bundles || static_cast<int64_t>(slots.shape(0)) != bundles ||
            static_cast<int64_t>(crcs.shape(0)) != bundles || piece_off.shape(0) != piece_len.shape(0))
          throw std::invalid_argument("aio_read_staged: starts, ids, slots and crcs differ in length");
        const int64_t *a = r0.data(), *e = r1.data(), *p = pos.data(), *f = first.data(), *st = starts.data();
        if (n && (f[0] != 0 || f[n] != bundles))
          throw std::invalid_argument("aio_read_staged: first must run 0..bundles");
        const int64_t checked = piece_extent(piece_off, piece_len, "aio_read_staged");
        TargetRows t = unpack_targets(targets, slots, "aio_read_staged");
        const int64_t extent = std::max(checked, t.extent);  // bytes of a bundle the checks and copies touch
        for (int64_t k = 0; k < n; ++k) {
          if (e[k] < a[k] || a[k] < 0 || p[k] < 0 || p[k] > size - (e[k] - a[k]) || f[k] > f[k + 1])
            throw std::invalid_argument("aio_read_staged: a read runs outside staging");
          for (int64_t i = f[k]; i < f[k + 1]; ++i)
            if (st[i] < a[k] || st[i] + extent > e[k])
              throw std::invalid_argument("aio_read_staged: a bundle outside its read");
        }
        const uint32_t* want = nullptr;
        std::vector<uint32_t> expected;
        if (table.has_value()) {
          expected.resize(static_cast<size_t>(bundles));
          for (int64_t i = 0; i < bundles; ++i) {
            const int64_t id = ids.data()[i];
            if (id < 0 || id >= static_cast<int64_t>(table->shape(0)))
              throw std::invalid_argument("aio_read_staged: id outside the crc32 table");
            expected[i] = table->data()[id];
          }
          want = expected.data();
        }
        const flash::StagedBundles b{f, st, bundles, want, piece_off.data(), piece_len.data(),
                                     static_cast<int64_t>(piece_off.shape(0)), t.off.data(), t.len.data(), t.dest.data(),
                                     t.stride.data(), static_cast<int64_t>(t.dest.size()), slots.data()};
        int64_t bad = -1, status;
        {
          nb::gil_scoped_release release;
          status = flash::aio_read_staged(ctx, n, fd, a, e, p, staging.data(), depth, spin_ns,
                                          waits.has_value() ? waits->data() : nullptr, res.data(), crcs.data(), b,
                                          &bad);
        }
        return std::make_tuple(status, bad);
      },
      nb::arg("ctx"), nb::arg("fd"), nb::arg("r0"), nb::arg("r1"), nb::arg("pos"), nb::arg("first"), nb::arg("starts"),
      nb::arg("ids"), nb::arg("table").none(), nb::arg("staging"), nb::arg("piece_off"), nb::arg("piece_len"),
      nb::arg("targets"), nb::arg("slots"), nb::arg("depth"), nb::arg("spin_ns"), nb::arg("waits").none(),
      nb::arg("res"), nb::arg("crcs"),
      "A small staged call in one go (kernels/aio_read.h, aio_read_staged): read k (r0[k]..r1[k] of fd) into "
      "staging[pos[k]:], bundles first[k]..first[k + 1] - 1 (file offsets starts, ids) checked against "
      "table[ids] (crc32 over the pieces; table None: no check) and copied to rows slots of each target "
      "(offset, bytes, uint8 rows). Returns (status, bad): status -errno of a failed submission, else the reads "
      "that did not land whole (0: done unless bad >= 0, the first bundle whose crc32 differs; else nothing was "
      "compared or copied: res and crcs say what landed).");
}
