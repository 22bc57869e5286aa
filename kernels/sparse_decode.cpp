// A sparse layer's decode step as one CPU primitive (see sparse_decode.h).

#include "sparse_decode.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "arg_checks.h"
#include "matvec.h"
#include "mlx_view.h"
#include "neuron_cache.h"
#include "primitive.h"
#include "read_plan.h"
#include "row_ops.h"
#include "sparse_ffn.h"

namespace flash_ext {

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// What a message about the pack's bytes starts with (mlx_flash.errors.BAD_PACK: the CLIs turn it
// into a one-line error).
const std::string BAD_PACK = "mlx_flash: bad pack: ";

// Attempts at a read call before its short reads or a checksum mismatch become an error (a
// mismatch read twice is in the file).
constexpr int READ_ATTEMPTS = 2;

// Reads of a plan (plan_strided_reads' rows for n bundles): read k covers [r0[k], r1[k]) and
// bundles first[k]..first[k + 1] - 1.
struct Reads {
  std::vector<int64_t> r0, r1, first;
  int64_t bytes() const {  // what they stage
    int64_t n = 0;
    for (size_t k = 0; k < r0.size(); ++k) n += r1[k] - r0[k];
    return n;
  }
};

// neuron_cache.fit_merges in one pass: the plan's reads with some of its merges undone so that
// they stage at most `limit` bytes (the merges kept: those whose aligned reads touch, then the
// smallest gaps first), or false when even the bundles' own reads stage more.
bool fit_merges(const int64_t* plan, int64_t n, int64_t reads, int64_t align, int64_t limit, Reads& out) {
  out = Reads{};
  if (n <= 0) return true;
  const int64_t *starts = plan + 2 * n, *lengths = plan + 3 * n, *first = plan + 6 * n;
  std::vector<int64_t> a0(static_cast<size_t>(n)), a1(static_cast<size_t>(n));
  std::vector<char> join(static_cast<size_t>(n), 1);  // join[j]: bundle j shares a read with j + 1
  for (int64_t i = 0; i < n; ++i) {
    a0[i] = starts[i] / align * align;
    a1[i] = (starts[i] + lengths[i] + align - 1) / align * align;
  }
  for (int64_t k = 1; k < reads; ++k) join[size_t(first[k] - 1)] = 0;
  join[size_t(n - 1)] = 0;
  int64_t staged = 0;
  std::vector<int64_t> open;  // merges that stage bytes of their own, by gap
  for (int64_t i = 0; i < n; ++i) {
    staged += a1[i] - a0[i];
    if (!join[i]) continue;
    const int64_t gap = a0[i + 1] - a1[i];
    if (gap <= 0)
      staged += gap;
    else
      open.push_back(i);
  }
  if (staged > limit) return false;
  std::stable_sort(open.begin(), open.end(), [&](int64_t x, int64_t y) { return a0[x + 1] - a1[x] < a0[y + 1] - a1[y]; });
  size_t kept = 0;
  for (; kept < open.size() && staged + (a0[open[kept] + 1] - a1[open[kept]]) <= limit; ++kept)
    staged += a0[open[kept] + 1] - a1[open[kept]];
  for (size_t q = kept; q < open.size(); ++q) join[size_t(open[q])] = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || !join[i - 1]) {
      out.first.push_back(i);
      out.r0.push_back(a0[i]);
      out.r1.push_back(a1[i]);
    }
    out.r1.back() = std::max(out.r1.back(), a1[i]);
  }
  return true;
}

// The targets of a read into `dest` (each component's rows, st.row_bytes[c] apart).
flash::StagedBundles targets_of(const SparseDecode& st, const std::vector<uint8_t*>& dest) {
  return flash::StagedBundles{nullptr, nullptr, 0, nullptr, st.piece_off.data(), st.piece_len.data(),
                              int64_t(st.piece_off.size()), st.comp_off.data(), st.comp_len.data(),
                              dest.data(), st.row_bytes.data(), int64_t(dest.size()), nullptr};
}

// The checks after a read call: an I/O failure throws; the call's reads and bytes counted; true
// when it is done, false to try again; short reads or a checksum mismatch on the last attempt
// throw BAD_PACK messages (plan rows: sorted ids and file offsets of the call's bundles).
bool read_done(const SparseDecode& st, const flash::IdsRead& r, const int64_t* sorted, const int64_t* starts,
               int attempt, int64_t* counters) {
  if (r.status < 0)
    throw std::runtime_error("mlx_flash: " + st.path + ": io_submit / io_getevents failed: " +
                             std::strerror(int(-r.status)));
  counters[DC_READS] += r.reads;
  counters[DC_BYTES] += r.staged;
  if (r.status == 0 && r.bad < 0) return true;
  if (attempt < READ_ATTEMPTS) return false;
  if (r.bad >= 0)
    throw std::invalid_argument(BAD_PACK + st.path + ": checksum mismatch in bundle " + std::to_string(sorted[r.bad]) +
                                " (offset " + std::to_string(starts[r.bad]) + ")");
  throw std::invalid_argument(BAD_PACK + st.path + ": " + std::to_string(r.status) +
                              " reads came back short (truncated?)");
}

// Bundles ids[0..n) into rows slots[i] of dest planned anew in calls that fit st's staging (halves
// while a call does not): what a chunk whose reads stage more than the staging falls back to.
void read_rows(const SparseDecode& st, const int64_t* ids, const int64_t* slots, int64_t n,
               const std::vector<uint8_t*>& dest, int64_t* counters) {
  if (n == 0) return;
  std::vector<int64_t> plan(static_cast<size_t>(8 * n)), res(static_cast<size_t>(n));
  std::vector<uint32_t> crcs(static_cast<size_t>(n));
  for (int attempt = 1;; ++attempt) {
    const flash::IdsRead r =
        flash::aio_read_ids(st.ctx, st.file, st.rule, n, ids, slots, st.table, st.staging, st.staging_size, st.depth,
                            st.spin_ns, nullptr, plan.data(), res.data(), crcs.data(), targets_of(st, dest));
    if (r.reads < 0)
      throw std::invalid_argument("mlx_flash: layer " + std::to_string(st.layer) +
                                  ": neuron ids out of range or repeated");
    if (!r.fits) {
      if (n == 1) throw std::runtime_error("mlx_flash: " + st.path + ": one bundle does not fit the staging buffer");
      read_rows(st, ids, slots, n / 2, dest, counters);
      read_rows(st, ids + n / 2, slots + n / 2, n - n / 2, dest, counters);
      return;
    }
    if (read_done(st, r, plan.data(), plan.data() + 2 * n, attempt, counters)) return;
  }
}

// A read plan of bundles ids[0..n) (plan_strided_reads' rows) cut into chunks as
// neuron_cache.plan_chunks cuts it: each chunk [lo[c], hi[c]) of the sorted bundles with its reads
// (first relative to lo): one chunk when the plan stages at most `limit` bytes (-1: no limit) and
// holds at most max_rows bundles, or when only merges through gaps take it over (fit_merges);
// else chunks cut at read boundaries (a read cut at a chunk's end covering just that chunk's
// bundles, as ReadPlan.take).
struct Chunks {
  int64_t n = 0;
  std::vector<int64_t> plan;
  std::vector<int64_t> lo, hi;
  std::vector<Reads> reads;
};

Chunks plan_chunks(const SparseDecode& st, const int64_t* ids, int64_t n, int64_t limit, int64_t max_rows) {
  Chunks ch;
  ch.n = n;
  if (n == 0) return ch;
  ch.plan.resize(static_cast<size_t>(8 * n));
  int64_t* p = ch.plan.data();
  const int64_t reads =
      flash::plan_strided_reads(n, ids, st.file.count, st.file.offset, st.file.stride, st.rule.align, st.rule.merge,
                                st.rule.merge_gap, st.rule.max_read, p, p + n, p + 2 * n, p + 3 * n, p + 4 * n,
                                p + 5 * n, p + 6 * n, p + 7 * n);
  if (reads < 0)
    throw std::invalid_argument("mlx_flash: layer " + std::to_string(st.layer) + ": neuron ids out of range or repeated");
  const int64_t *starts = p + 2 * n, *lengths = p + 3 * n, *r0 = p + 4 * n, *r1 = p + 5 * n, *first = p + 6 * n;
  max_rows = std::max<int64_t>(1, max_rows);
  const double max_bytes = limit < 0 ? 1e300 : double(limit);
  Reads whole{std::vector<int64_t>(r0, r0 + reads), std::vector<int64_t>(r1, r1 + reads),
              std::vector<int64_t>(first, first + reads)};
  if (double(whole.bytes()) <= max_bytes && n <= max_rows) {
    ch.lo = {0};
    ch.hi = {n};
    ch.reads = {std::move(whole)};
    return ch;
  }
  Reads fitted;
  if (n <= max_rows && limit >= 0 && fit_merges(p, n, reads, st.rule.align, limit, fitted)) {
    ch.lo = {0};
    ch.hi = {n};
    ch.reads = {std::move(fitted)};
    return ch;
  }
  const int64_t al = st.rule.align;
  auto take = [&](int64_t lo, int64_t hi) {  // ReadPlan.take
    Reads t;
    for (int64_t k = 0; k < reads; ++k) {
      const int64_t end = k + 1 < reads ? first[k + 1] : n;
      if (end <= lo || first[k] >= hi) continue;
      t.r0.push_back(r0[k]);
      t.r1.push_back(r1[k]);
      t.first.push_back(std::max(first[k], lo) - lo);
    }
    t.r0.front() = starts[lo] / al * al;
    t.r1.back() = (starts[hi - 1] + lengths[hi - 1] + al - 1) / al * al;
    ch.lo.push_back(lo);
    ch.hi.push_back(hi);
    ch.reads.push_back(std::move(t));
  };
  int64_t lo = 0;
  double piece = 0;
  for (int64_t k = 0; k < reads; ++k) {
    const int64_t a = first[k], b = k + 1 < reads ? first[k + 1] : n;
    const double size = double(r1[k] - r0[k]);
    if (a > lo && (piece + size > max_bytes || b - lo > max_rows)) {
      take(lo, a);
      lo = a;
      piece = 0;
    }
    while (b - lo > max_rows) {  // one read of more bundles than a chunk holds: split it
      take(lo, lo + max_rows);
      lo += max_rows;
      piece = 0;
    }
    piece += size;
  }
  take(lo, n);
  return ch;
}

// Chunk c of `ch` (planned from ids) into rows slots[i] of dest for ids[i]: its reads as planned
// in one call, or, when they stage more than st's staging, its bundles planned anew (read_rows).
void read_chunk(const SparseDecode& st, const Chunks& ch, size_t c, const int64_t* slots,
                const std::vector<uint8_t*>& dest, int64_t* counters) {
  const int64_t n = ch.n, lo = ch.lo[c], m = ch.hi[c] - lo;
  const int64_t *sorted = ch.plan.data() + lo, *index = ch.plan.data() + n + lo, *starts = ch.plan.data() + 2 * n + lo;
  const Reads& f = ch.reads[c];
  const int64_t t0 = now_ns();
  std::vector<int64_t> res(f.r0.size());
  std::vector<uint32_t> crcs(static_cast<size_t>(m));
  for (int attempt = 1;; ++attempt) {
    const flash::IdsRead r = flash::aio_read_planned(
        st.ctx, st.file.fd, m, sorted, index, starts, int64_t(f.r0.size()), f.r0.data(), f.r1.data(), f.first.data(),
        slots, st.table, st.staging, st.staging_size, st.depth, st.spin_ns, nullptr, res.data(), crcs.data(),
        targets_of(st, dest));
    if (!r.fits) {  // more than the staging holds: its bundles planned anew in calls that fit
      std::vector<int64_t> ids(sorted, sorted + m), rows(static_cast<size_t>(m));
      for (int64_t i = 0; i < m; ++i) rows[i] = slots[index[i]];
      read_rows(st, ids.data(), rows.data(), m, dest, counters);
      break;
    }
    if (read_done(st, r, sorted, starts, attempt, counters)) break;
  }
  counters[DC_IO_NS] += now_ns() - t0;
}

// A call's cache fill read as the per-layer path reads it (FlashFFN._read_fill_and_overflow):
// beside the overflow in buffer rows 0.. (the overflow first, then the fill, copied into its cache
// rows) when both fit the buffer and one call within both limits takes them (returns true: the
// overflow is read too); else straight into its cache rows in the chunks of the cache's limit
// (returns false: the caller reads the overflow, chunk by chunk, as it computes).
bool read_fill(const SparseDecode& st, const int64_t* over, int64_t n_over, const int64_t* fill,
               const int64_t* fill_slots, int64_t n_fill, int64_t* counters) {
  if (n_over > 0 && n_fill > 0 && n_over + n_fill <= st.buf_capacity) {
    std::vector<int64_t> ids(over, over + n_over), rows(static_cast<size_t>(n_over + n_fill));
    ids.insert(ids.end(), fill, fill + n_fill);
    for (int64_t i = 0; i < n_over + n_fill; ++i) rows[i] = i;
    const int64_t limit = st.piece_bytes < 0 ? st.fill_bytes
                          : st.fill_bytes < 0 ? st.piece_bytes
                                              : std::min(st.piece_bytes, st.fill_bytes);
    const Chunks jc = plan_chunks(st, ids.data(), n_over + n_fill, limit, n_over + n_fill);
    if (jc.lo.size() == 1 && (limit < 0 || jc.reads[0].bytes() <= limit)) {  // (one read over the limit stays one chunk)
      read_chunk(st, jc, 0, rows.data(), st.buf, counters);
      const int64_t t0 = now_ns();
      for (size_t c = 0; c < st.rows.size(); ++c)
        for (int64_t i = 0; i < n_fill; ++i)
          std::memcpy(st.rows[c] + fill_slots[i] * st.row_bytes[c], st.buf[c] + (n_over + i) * st.row_bytes[c],
                      size_t(st.row_bytes[c]));
      counters[DC_MEM_NS] += now_ns() - t0;
      counters[DC_FILL_COPIED] = n_fill;
      return true;
    }
  }
  if (n_fill > 0) {
    const Chunks fc = plan_chunks(st, fill, n_fill, st.fill_bytes, n_fill);
    for (size_t c = 0; c < fc.lo.size(); ++c) read_chunk(st, fc, c, fill_slots, st.rows, counters);
  }
  return false;
}

// Start reading ahead for `next` (the next sparse layer): the neurons of amask its cache lacks, at
// most la.capacity in id order, cut to the bundles whose reads fit la's staging, into rows 0.. of
// la's buffer `b`. Returns how many went out (0: none; a read that cannot start is dropped: the
// next layer reads those neurons itself).
int64_t start_ahead(Lookahead& la, const SparseDecode& next, const View& amask, int b) {
  la.drop();  // a read no layer took (an aborted pass): its buffer and staging are reused now
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < next.n_neurons && int64_t(ids.size()) < la.capacity; ++i)
    if (amask.ptr[amask.offset(i)] && next.slot_of[i] < 0) ids.push_back(i);
  if (ids.empty()) return 0;
  Chunks ch = plan_chunks(next, ids.data(), int64_t(ids.size()), la.staging_size, int64_t(ids.size()));
  const int64_t n = ch.hi[0];  // the first chunk: the bundles that fit the staging (sorted ids)
  const Reads& f = ch.reads[0];
  if (f.bytes() > la.staging_size) return 0;
  la.ids.assign(ch.plan.begin(), ch.plan.begin() + n);
  la.plan.assign(ch.plan.begin() + 2 * ch.n, ch.plan.begin() + 2 * ch.n + n);  // their file offsets
  la.r0 = f.r0;
  la.r1 = f.r1;
  la.first = f.first;
  la.slots.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) la.slots[i] = i;  // sorted: bundle i -> row i (index is the identity)
  la.res.assign(f.r0.size(), 0);
  la.crcs.assign(size_t(n), 0);
  la.read = std::make_unique<flash::PlannedRead>(
      la.ctx, next.file.fd, n, la.ids.data(), la.slots.data(), la.plan.data(), int64_t(f.r0.size()), la.r0.data(),
      la.r1.data(), la.first.data(), la.slots.data(), next.table, la.staging, la.staging_size, next.depth,
      next.spin_ns, nullptr, la.res.data(), la.crcs.data(), targets_of(next, la.rows[b]));
  if (!la.read->fits() || !la.read->start()) {
    la.drop();
    return 0;
  }
  la.target = &next;
  la.buffer = b;
  return n;
}

// The lookahead read of `st`'s layer once it is in (reaped, checked, in la.rows[la.buffer]; read
// again, planned anew, when it came back short or failed its checksum once).
void finish_ahead(Lookahead& la, const SparseDecode& st, int64_t* counters) {
  const int64_t t0 = now_ns();
  const flash::IdsRead r = la.read->finish();
  const int64_t n = int64_t(la.ids.size());
  if (!read_done(st, r, la.ids.data(), la.plan.data(), 1, counters))
    read_rows(st, la.ids.data(), la.slots.data(), n, la.rows[la.buffer], counters);
  counters[DC_IO_NS] += now_ns() - t0;
  la.read.reset();
  la.target = nullptr;
}

// Take the neurons `la`'s read holds out of a cache update's fill (ids fill[0..n_fill), their
// slots) and overflow (over[0..n_over)), compacting both; their positions in la.ids are returned
// in served_fill / served_over (with the fills' slots in served_slots).
void split_ahead(const Lookahead& la, int64_t* fill, int64_t* fill_slots, int64_t& n_fill, int64_t* over,
                 int64_t& n_over, std::vector<int64_t>& served_fill, std::vector<int64_t>& served_slots,
                 std::vector<int64_t>& served_over) {
  auto at = [&](int64_t id) -> int64_t {
    const auto it = std::lower_bound(la.ids.begin(), la.ids.end(), id);
    return it != la.ids.end() && *it == id ? int64_t(it - la.ids.begin()) : -1;
  };
  int64_t kept = 0;
  for (int64_t i = 0; i < n_fill; ++i) {
    const int64_t p = at(fill[i]);
    if (p >= 0) {
      served_fill.push_back(p);
      served_slots.push_back(fill_slots[i]);
    } else {
      fill[kept] = fill[i];
      fill_slots[kept++] = fill_slots[i];
    }
  }
  n_fill = kept;
  kept = 0;
  for (int64_t i = 0; i < n_over; ++i) {
    const int64_t p = at(over[i]);
    if (p >= 0)
      served_over.push_back(p);
    else
      over[kept++] = over[i];
  }
  n_over = kept;
}

class FlashSparseDecode : public CpuPrimitive {
 public:
  struct Params {
    FfnParams ffn;
    bool has_gate_values;
    int64_t step;
    int up, gate, down, comps;
    std::shared_ptr<SparseDecode> st, next;  // next: the layer read ahead for (ahead mask given), or null
  };
  FlashSparseDecode(mx::Stream s, Params p) : CpuPrimitive(s), p_(std::move(p)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Params P = p_;
    size_t next = 0;
    const View x = View::of(inputs[next++]);
    View gate_values;
    if (P.has_gate_values) gate_values = View::of(inputs[next++]);
    const View mask = View::of(inputs[next++]);
    View ahead_mask;
    if (P.next) ahead_mask = View::of(inputs[next++]);
    std::vector<View> cache, buf;
    for (int c = 0; c < P.comps; ++c) cache.push_back(View::of(inputs[next++]));
    for (int c = 0; c < P.comps; ++c) buf.push_back(View::of(inputs[next++]));
    uint8_t* out = allocate_output(outputs[0]);
    auto* counters = reinterpret_cast<int64_t*>(allocate_output(outputs[1]));
    const int odt = scalar_type(outputs[0].dtype());
    dispatch(stream(), inputs, outputs, [=]() {
      const int64_t t_call = now_ns();
      SparseDecode& st = *P.st;
      std::fill(counters, counters + DECODE_COUNTERS, int64_t(0));
      // the neurons needed, sorted
      const int64_t N = mask.size();
      std::vector<int64_t> active;
      active.reserve(size_t(N));
      for (int64_t i = 0; i < N; ++i)
        if (mask.ptr[mask.offset(i)]) active.push_back(i);
      const int64_t k = int64_t(active.size());
      // the cache update: survivors, evictions, rows for the new neurons that fit
      const int64_t t0 = now_ns();
      const auto kk = static_cast<size_t>(k);
      std::vector<int64_t> over(kk), fill(kk), fill_slots(kk), scratch2(static_cast<size_t>(2 * st.capacity));
      flash::CacheState cs{st.ids,      st.slot_of,           st.last_active, st.capacity, st.n_neurons, *st.used,
                           st.rows.data(), st.row_bytes.data(), int64_t(st.rows.size())};
      const flash::CacheResult r = flash::cache_update(cs, active.data(), k, P.step, st.window, over.data(),
                                                       fill.data(), fill_slots.data(), scratch2.data());
      *st.used = cs.num_used;
      counters[DC_MEM_NS] += now_ns() - t0;
      counters[DC_NEEDED] = k;
      counters[DC_HITS] = r.hits;
      counters[DC_LOADED] = r.n_fill + r.n_overflow;
      counters[DC_WINDOW] = r.window;
      counters[DC_OVERFLOW] = r.n_overflow;
      int64_t n_over = r.n_overflow, n_fill = r.n_fill;
      // this layer's lookahead read, if one is in flight: the neurons it holds leave the update
      Lookahead* la = st.lookahead.get();
      const bool ahead_in = la != nullptr && la->read != nullptr && la->target == &st;
      std::vector<int64_t> served_fill, served_slots, served_over;
      if (ahead_in)
        split_ahead(*la, fill.data(), fill_slots.data(), n_fill, over.data(), n_over, served_fill, served_slots,
                    served_over);
      const Chunks oc = plan_chunks(st, over.data(), n_over, st.piece_bytes, st.buf_capacity);
      const bool joint = read_fill(st, over.data(), n_over, fill.data(), fill_slots.data(), n_fill, counters);
      int served_buffer = -1;
      std::vector<int32_t> ahead_ids;
      if (ahead_in) {  // after this layer's own reads (they had the device first): its rows are in
        const int64_t taken = int64_t(la->ids.size());
        served_buffer = la->buffer;
        finish_ahead(*la, st, counters);
        const std::vector<uint8_t*>& rows = la->rows[served_buffer];
        const int64_t t1 = now_ns();
        for (size_t c = 0; c < st.rows.size(); ++c) {
          const int64_t rb = st.row_bytes[c];
          for (size_t i = 0; i < served_fill.size(); ++i)
            std::memcpy(st.rows[c] + served_slots[i] * rb, rows[c] + served_fill[i] * rb, size_t(rb));
          for (size_t t = 0; t < served_over.size(); ++t)  // to rows 0.. in order (served_over[t] >= t)
            if (served_over[t] != int64_t(t))
              std::memcpy(rows[c] + int64_t(t) * rb, rows[c] + served_over[t] * rb, size_t(rb));
        }
        counters[DC_MEM_NS] += now_ns() - t1;
        for (int64_t p : served_over) ahead_ids.push_back(int32_t(la->ids[size_t(p)]));
        counters[DC_AHEAD_TAKEN] = taken;
        counters[DC_AHEAD_USED] = int64_t(served_fill.size() + served_over.size());
        counters[DC_AHEAD_COPIED] = int64_t(served_fill.size());
        counters[DC_LOADED] += taken - counters[DC_AHEAD_USED];
      }
      if (P.next && la != nullptr)  // the next layer's neurons start landing while this one computes
        counters[DC_AHEAD_READ] = start_ahead(*la, *P.next, ahead_mask, served_buffer == 0 ? 1 : 0);
      std::vector<int64_t> over_rows(static_cast<size_t>(n_over));
      std::vector<std::pair<int64_t, int64_t>> pieces;
      if (joint)
        pieces = {{0, n_over}};
      else
        for (size_t c = 0; c < oc.lo.size(); ++c) pieces.emplace_back(oc.lo[c], oc.hi[c]);
      // the FFN: the cached rows and the first overflow piece, then each further piece added
      const int K = int(x.shape.back());
      const int M = K == 0 ? 0 : int(x.size() / K);
      const int64_t out_size = int64_t(M) * K;
      float* xin = scratch(tl_xin(), size_t(out_size));
      to_float(x, xin);
      float* y = scratch(tl_yout(), size_t(out_size));
      bool have_y = false;
      const int64_t used = *st.used;
      std::vector<int32_t> live(static_cast<size_t>(used)), piece_ids;
      for (int64_t i = 0; i < used; ++i) live[i] = int32_t(st.ids[i]);
      auto rows_of = [&](const std::vector<View>& v, int n, const int32_t* ids) {
        SetRows s;
        s.up = v[P.up];
        s.has_gate = P.gate >= 0;
        if (s.has_gate) s.gate = v[P.gate];
        s.down = v[P.down];
        s.n = n;
        s.ids = ids;
        return s;
      };
      std::vector<SetRows> sets = {rows_of(cache, int(used), live.data())};
      std::vector<View> ahead_rows;  // the served overflow rows of the lookahead buffer, as Views
      if (!ahead_ids.empty()) {
        for (int c = 0; c < P.comps; ++c) {
          View v = buf[c];
          v.ptr = la->rows[served_buffer][c];
          v.shape[0] = int(la->capacity);
          ahead_rows.push_back(v);
        }
        sets.push_back(rows_of(ahead_rows, int(ahead_ids.size()), ahead_ids.data()));
      }
      const View* gv = P.has_gate_values ? &gate_values : nullptr;
      for (size_t c = 0; c < pieces.size(); ++c) {
        const auto [a, b] = pieces[c];
        if (a > 0) {  // the buffer is about to be refilled
          ffn_sets(P.ffn, M, K, xin, gv, sets, y, have_y);
          sets.clear();
        }
        if (!joint) {  // over[a + i] (sorted: the plan's order) -> buffer row i
          for (int64_t j = a; j < b; ++j) over_rows[j] = j - a;
          read_chunk(st, oc, c, over_rows.data(), st.buf, counters);
        }
        piece_ids.assign(over.begin() + a, over.begin() + b);
        sets.push_back(rows_of(buf, int(b - a), piece_ids.data()));
      }
      ffn_sets(P.ffn, M, K, xin, gv, sets, y, have_y);
      store_row(out, odt, 0, int(out_size), y);
      counters[DC_CALL_NS] = now_ns() - t_call;
    });
  }

  const char* name() const override { return "FlashSparseDecode"; }
  // Each call updates its layer's cache: never merged with another.
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  static std::vector<float>& tl_xin() {
    thread_local std::vector<float> v;
    return v;
  }
  static std::vector<float>& tl_yout() {
    thread_local std::vector<float> v;
    return v;
  }
  Params p_;
};

}  // namespace

std::vector<mx::array> sparse_decode(const mx::array& x, const std::optional<mx::array>& gate_values,
                                     const mx::array& mask, std::shared_ptr<SparseDecode> state,
                                     const std::vector<mx::array>& cache, const std::vector<mx::array>& buf,
                                     std::vector<int> roles, int act, float threshold, int64_t step,
                                     const std::optional<mx::array>& ahead_mask, std::shared_ptr<SparseDecode> next) {
  const std::string op = "sparse_decode";
  if (!state) fail(op + ": no state");
  const SparseDecode& st = *state;
  if (x.ndim() < 1 || x.size() != size_t(x.shape(-1))) fail(op + ": x must hold one token, got " + shape_str(x));
  check_float(x, op + ": x");
  if (act < 0 || act > 3) fail(op + ": act must be 0..3, got " + std::to_string(act));
  if (mask.dtype() != mx::bool_ || mask.ndim() != 1 || mask.shape(0) != st.n_neurons)
    fail(op + ": mask must be bool [" + std::to_string(st.n_neurons) + "], got " + shape_str(mask));
  const int comps = int(st.rows.size());
  if (int(cache.size()) != comps || int(buf.size()) != comps || int(st.buf.size()) != comps)
    fail(op + ": cache and buffer arrays must match the state's components");
  if (roles.size() != 3 || roles[0] < 0 || roles[0] >= comps || roles[2] < 0 || roles[2] >= comps ||
      roles[1] >= comps)
    fail(op + ": roles must be (up, gate or -1, down_t) component indices");
  const int K = x.shape(-1);
  const mx::Dtype wdt = cache[roles[0]].dtype();
  if (wdt != mx::float16 && wdt != mx::bfloat16) fail(op + ": rows must be float16 or bfloat16");
  for (int c = 0; c < comps; ++c) {
    for (const mx::array* a : {&cache[c], &buf[c]}) {
      if (a->dtype() != wdt || a->ndim() != 2 || a->shape(1) != K || !a->flags().row_contiguous ||
          int64_t(K) * int64_t(mx::size_of(wdt)) != st.row_bytes[c])
        fail(op + ": component arrays must be contiguous [R, " + std::to_string(K) + "] rows of the state's layout");
    }
    if (cache[c].shape(0) != st.capacity || buf[c].shape(0) != st.buf_capacity ||
        (st.capacity > 0 && cache[c].data<uint8_t>() != st.rows[c]) || buf[c].data<uint8_t>() != st.buf[c])
      fail(op + ": cache and buffer arrays must be the state's memory");
  }
  if (roles[1] < 0 && act != 2 && !gate_values) fail(op + ": rows without a gate need gate_values");
  const mx::Dtype ydt = mx::promote_types(x.dtype(), wdt);
  std::vector<mx::array> inputs = {x};
  if (gate_values) {
    check_float(*gate_values, op + ": gate_values");
    if (gate_values->dtype() != ydt || gate_values->shape(-1) != st.n_neurons ||
        gate_values->size() != size_t(st.n_neurons))
      fail(op + ": gate_values must be [..., " + std::to_string(st.n_neurons) + "] of the output's dtype");
    inputs.push_back(*gate_values);
  }
  inputs.push_back(mask);
  if (ahead_mask.has_value() != bool(next)) fail(op + ": ahead_mask and next go together");
  if (next) {
    if (!st.lookahead || next->lookahead != st.lookahead || next.get() == &st)
      fail(op + ": the next layer must be another layer sharing this layer's lookahead");
    if (next->row_bytes != st.row_bytes || next->piece_off != st.piece_off || next->comp_off != st.comp_off)
      fail(op + ": the next layer's bundles must have this layer's layout");
    if (ahead_mask->dtype() != mx::bool_ || ahead_mask->ndim() != 1 || ahead_mask->shape(0) != next->n_neurons)
      fail(op + ": ahead_mask must be bool [" + std::to_string(next->n_neurons) + "], got " + shape_str(*ahead_mask));
    inputs.push_back(*ahead_mask);
  }
  inputs.insert(inputs.end(), cache.begin(), cache.end());
  inputs.insert(inputs.end(), buf.begin(), buf.end());
  FlashSparseDecode::Params P{ffn_params(wdt == mx::float16 ? flash::FMT_F16 : flash::FMT_BF16, act, ydt, threshold),
                              gate_values.has_value(), step, roles[0], roles[1], roles[2], comps, std::move(state),
                              std::move(next)};
  auto prim = std::make_shared<FlashSparseDecode>(cpu_stream(), std::move(P));
  return mx::array::make_arrays({x.shape(), {DECODE_COUNTERS}}, {ydt, mx::int64}, prim, std::move(inputs));
}

}  // namespace flash_ext
