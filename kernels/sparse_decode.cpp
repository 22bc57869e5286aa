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

// Bundles ids[0..n) of st's layer into rows slots[i] of each component's rows at dest[c] (rows
// st.row_bytes[c] apart), in as few aio_read_ids calls as st's staging allows; counters
// (DC_READS, DC_BYTES, DC_IO_NS) added. Errors throw: a checksum mismatch (the pack's bytes) as
// std::invalid_argument, I/O failures as std::runtime_error.
void read_rows(const SparseDecode& st, const int64_t* ids, const int64_t* slots, int64_t n,
               const std::vector<uint8_t*>& dest, int64_t* counters) {
  if (n == 0) return;
  const int64_t t0 = now_ns();
  std::vector<int64_t> plan(static_cast<size_t>(8 * n)), res(static_cast<size_t>(n));
  std::vector<uint32_t> crcs(static_cast<size_t>(n));
  const flash::StagedBundles targets{nullptr, nullptr, 0, nullptr, st.piece_off.data(), st.piece_len.data(),
                                     int64_t(st.piece_off.size()), st.comp_off.data(), st.comp_len.data(),
                                     dest.data(), st.row_bytes.data(), int64_t(dest.size()), nullptr};
  for (int attempt = 1;; ++attempt) {
    const flash::IdsRead r =
        flash::aio_read_ids(st.ctx, st.file, st.rule, n, ids, slots, st.table, st.staging, st.staging_size, st.depth,
                            st.spin_ns, nullptr, plan.data(), res.data(), crcs.data(), targets);
    if (r.reads < 0)
      throw std::invalid_argument("mlx_flash: layer " + std::to_string(st.layer) +
                                  ": neuron ids out of range or repeated");
    if (!r.fits) {  // more than the staging holds: two halves
      if (n == 1) throw std::runtime_error("mlx_flash: " + st.path + ": one bundle does not fit the staging buffer");
      counters[DC_IO_NS] += now_ns() - t0;
      read_rows(st, ids, slots, n / 2, dest, counters);
      read_rows(st, ids + n / 2, slots + n / 2, n - n / 2, dest, counters);
      return;
    }
    if (r.status < 0)
      throw std::runtime_error("mlx_flash: " + st.path + ": io_submit / io_getevents failed: " +
                               std::strerror(int(-r.status)));
    counters[DC_READS] += r.reads;
    counters[DC_BYTES] += r.staged;
    if (r.status == 0 && r.bad < 0) break;
    if (attempt == READ_ATTEMPTS) {
      if (r.bad >= 0)  // the plan's rows: sorted ids, then their file offsets (row 2)
        throw std::invalid_argument(BAD_PACK + st.path + ": checksum mismatch in bundle " +
                                    std::to_string(plan[size_t(r.bad)]) + " (offset " +
                                    std::to_string(plan[size_t(2 * n + r.bad)]) + ")");
      throw std::invalid_argument(BAD_PACK + st.path + ": " + std::to_string(r.status) +
                                  " reads came back short (truncated?)");
    }
  }
  counters[DC_IO_NS] += now_ns() - t0;
}

// The overflow's pieces, [lo, hi) ranges of the sorted ids over[0..n), as neuron_cache.plan_chunks
// cuts them (each computed on its own, in order: the same sums as the per-layer path): one piece
// when its plan stages at most st.piece_bytes and holds at most st.buf_capacity rows, or when only
// merges through gaps take it over the bytes (fit_merges); else cut at read boundaries.
std::vector<std::pair<int64_t, int64_t>> overflow_pieces(const SparseDecode& st, const int64_t* over, int64_t n) {
  if (n == 0) return {};
  std::vector<int64_t> plan(static_cast<size_t>(8 * n));
  int64_t* p = plan.data();
  const int64_t *sorted = p, *starts = p + 2 * n, *lengths = p + 3 * n, *r0 = p + 4 * n, *r1 = p + 5 * n,
                *first = p + 6 * n;
  const int64_t reads =
      flash::plan_strided_reads(n, over, st.file.count, st.file.offset, st.file.stride, st.rule.align, st.rule.merge,
                                st.rule.merge_gap, st.rule.max_read, p, p + n, p + 2 * n, p + 3 * n, p + 4 * n,
                                p + 5 * n, p + 6 * n, p + 7 * n);
  if (reads < 0) throw std::invalid_argument("mlx_flash: layer " + std::to_string(st.layer) + ": overflow ids out of range or repeated");
  (void)sorted;
  const int64_t max_rows = std::max<int64_t>(1, st.buf_capacity);
  const double max_bytes = st.piece_bytes < 0 ? 1e300 : double(st.piece_bytes);
  int64_t staged = 0;
  for (int64_t k = 0; k < reads; ++k) staged += r1[k] - r0[k];
  if (double(staged) <= max_bytes && n <= max_rows) return {{0, n}};
  if (n <= max_rows) {  // fit_merges: the bundles' own aligned reads and the merges that stage nothing
    const int64_t al = st.rule.align;
    std::vector<bool> read_start(static_cast<size_t>(n), false);
    for (int64_t k = 0; k < reads; ++k) read_start[size_t(first[k])] = true;
    int64_t base = 0, prev_end = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a0 = starts[i] / al * al, a1 = (starts[i] + lengths[i] + al - 1) / al * al;
      base += a1 - a0;
      if (i > 0 && !read_start[size_t(i)] && a0 - prev_end <= 0) base += a0 - prev_end;
      prev_end = a1;
    }
    if (double(base) <= max_bytes) return {{0, n}};
  }
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t lo = 0;
  double piece = 0;
  for (int64_t k = 0; k < reads; ++k) {
    const int64_t a = first[k], b = k + 1 < reads ? first[k + 1] : n;
    const double size = double(r1[k] - r0[k]);
    if (a > lo && (piece + size > max_bytes || b - lo > max_rows)) {
      out.emplace_back(lo, a);
      lo = a;
      piece = 0;
    }
    while (b - lo > max_rows) {  // one read of more bundles than a piece holds: split it
      out.emplace_back(lo, lo + max_rows);
      lo += max_rows;
      piece = 0;
    }
    piece += size;
  }
  out.emplace_back(lo, n);
  return out;
}

class FlashSparseDecode : public CpuPrimitive {
 public:
  struct Params {
    FfnParams ffn;
    bool has_gate_values;
    int64_t step;
    int up, gate, down, comps;
    std::shared_ptr<SparseDecode> st;
  };
  FlashSparseDecode(mx::Stream s, Params p) : CpuPrimitive(s), p_(std::move(p)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const Params P = p_;
    size_t next = 0;
    const View x = View::of(inputs[next++]);
    View gate_values;
    if (P.has_gate_values) gate_values = View::of(inputs[next++]);
    const View mask = View::of(inputs[next++]);
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
      int64_t t0 = now_ns();
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
      const int64_t n_over = r.n_overflow, n_fill = r.n_fill;
      // the reads: the overflow into buffer rows 0.. with the fill after it (copied into its cache
      // rows) when both fit the buffer; else the fill straight into its rows, the overflow in
      // pieces of the buffer's rows, each read when the one before it was computed
      const std::vector<std::pair<int64_t, int64_t>> pieces = overflow_pieces(st, over.data(), n_over);
      bool first_read = false;
      if (n_over == 0) {
        read_rows(st, fill.data(), fill_slots.data(), n_fill, st.rows, counters);
      } else if (pieces.size() == 1 && n_over + n_fill <= st.buf_capacity) {
        std::vector<int64_t> ids(over.begin(), over.begin() + n_over), slots(static_cast<size_t>(n_over + n_fill));
        ids.insert(ids.end(), fill.begin(), fill.begin() + n_fill);
        for (int64_t i = 0; i < n_over + n_fill; ++i) slots[i] = i;
        read_rows(st, ids.data(), slots.data(), n_over + n_fill, st.buf, counters);
        t0 = now_ns();
        for (size_t c = 0; c < st.rows.size(); ++c)
          for (int64_t i = 0; i < n_fill; ++i)
            std::memcpy(st.rows[c] + fill_slots[i] * st.row_bytes[c], st.buf[c] + (n_over + i) * st.row_bytes[c],
                        size_t(st.row_bytes[c]));
        counters[DC_MEM_NS] += now_ns() - t0;
        counters[DC_FILL_COPIED] = n_fill;
        first_read = true;
      } else {
        read_rows(st, fill.data(), fill_slots.data(), n_fill, st.rows, counters);
      }
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
      const View* gv = P.has_gate_values ? &gate_values : nullptr;
      for (const auto& [a, b] : pieces) {
        if (a > 0) {  // the buffer is about to be refilled
          ffn_sets(P.ffn, M, K, xin, gv, sets, y, have_y);
          sets.clear();
        }
        if (!first_read) {
          std::vector<int64_t> slots(static_cast<size_t>(b - a));
          for (int64_t i = 0; i < b - a; ++i) slots[i] = i;
          read_rows(st, over.data() + a, slots.data(), b - a, st.buf, counters);
        }
        first_read = false;
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
                                     std::vector<int> roles, int act, float threshold, int64_t step) {
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
  inputs.insert(inputs.end(), cache.begin(), cache.end());
  inputs.insert(inputs.end(), buf.begin(), buf.end());
  FlashSparseDecode::Params P{ffn_params(wdt == mx::float16 ? flash::FMT_F16 : flash::FMT_BF16, act, ydt, threshold),
                              gate_values.has_value(), step, roles[0], roles[1], roles[2], comps, std::move(state)};
  auto prim = std::make_shared<FlashSparseDecode>(cpu_stream(), std::move(P));
  return mx::array::make_arrays({x.shape(), {DECODE_COUNTERS}}, {ydt, mx::int64}, prim, std::move(inputs));
}

}  // namespace flash_ext
