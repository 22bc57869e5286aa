// CPU matvec kernels for MLX weight layouts: affine-quantized (4/8 bit, uint32 words, low bits first,
// w = scale * q + bias per group along K) and float16 / bfloat16 rows. This file prepares x and
// splits each call over the thread pool; the kernels are per ISA (matvec_kernels.h), chosen once
// per call by cpu_features.h. All sums are float32.

#include "matvec.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "dtype.h"
#include "matvec_kernels.h"
#include "scratch.h"
#include "thread_pool.h"

namespace flash {

namespace {

struct FwdCtx {
  const Problem* p;
  FwdInput in;
  Isa isa;
  int rows_per_chunk = 0;
};

// The forward problem p with x prepared as in (so far) runs the avx512 kernel under isa.
bool runs_avx512(const Problem& p, const FwdInput& in, Isa isa) {
#if FLASH_X86
  return isa >= Isa::avx512 && avx512_fwd(p, in);
#else
  return false;
#endif
}

void fwd_rows(const FwdCtx& c, int i0, int i1) {
  if (i0 >= i1) return;
#if FLASH_X86
  if (runs_avx512(*c.p, c.in, c.isa)) return avx512::fwd_rows(*c.p, c.in, i0, i1);
  if (c.isa >= Isa::avx2) return avx2::fwd_rows(*c.p, c.in, i0, i1);
#endif
  scalar::fwd_rows(*c.p, c.in, i0, i1);
}

struct TCtx {
  const Problem* p;
  Isa isa;
  int cols_per_chunk;
};

thread_local std::vector<float> tl_acc;

void t_chunk(const void* vctx, int chunk) {
  const TCtx& c = *static_cast<const TCtx*>(vctx);
  const Problem& p = *c.p;
  int k0 = chunk * c.cols_per_chunk, k1 = std::min(p.K, k0 + c.cols_per_chunk);
  if (k0 >= k1) return;
  float* acc = scratch(tl_acc, size_t(p.M) * (k1 - k0 + (k1 - k0) / std::max(1, p.group_size) + 1));
#if FLASH_X86
  if (c.isa >= Isa::avx2) return avx2::t_cols(p, k0, k1, acc);
#endif
  scalar::t_cols(p, k0, k1, acc);
}

// Below ~64 KiB of weights a second thread costs more than it saves; above, chunks of ~128 KiB
// (at least 2 per thread) balance the load between threads that may be descheduled.
int chunks_for(int64_t weight_bytes, int units) {
  const int t = std::min(num_threads(), pool_size());
  if (t <= 1 || weight_bytes < (64 << 10)) return 1;
  int64_t c = std::max<int64_t>(2 * t, weight_bytes / (128 << 10));
  return int(std::max<int64_t>(1, std::min<int64_t>({c, int64_t(units), 4096})));
}

int64_t bytes_per_row(const Problem& p) {
  switch (p.fmt) {
    case FMT_Q4: return p.K / 2 + 2 * (p.K / p.group_size) * (p.sb_dtype == DT_F32 ? 4 : 2);
    case FMT_Q8: return p.K + 2 * (p.K / p.group_size) * (p.sb_dtype == DT_F32 ? 4 : 2);
    default: return 2 * int64_t(p.K);
  }
}

// Prepared x of one problem (grows, never shrinks); one set per problem slot of matvec_many.
struct XScratch {
  std::vector<float> x, xsum, xd, qsum;  // qsum: int32 block sums (float-sized slots)
  std::vector<int8_t> xq, xperm;
  std::vector<int32_t> xoff4;
};
thread_local XScratch tl_xs[kMaxProblems];

void quantize_x(const Problem& p, Isa isa, int8_t* xq, float* xd, int32_t* qsum) {
  const int64_t blocks = int64_t(p.M) * p.K / 32;
#if FLASH_X86
  if (isa >= Isa::avx2) return avx2::quantize_x(p.in, blocks, xq, xd, qsum);
#endif
  scalar::quantize_x(p.in, blocks, xq, xd, qsum);
}

// x reordered to the nibble order a 4-bit SIMD loop consumes: natural(j) = natural index of position j
// of a 32-block (q4_natural: the avx2 loops; q4_natural16: the avx512 one).
const float* q4_permuted_x(const Problem& p, XScratch& xs, int (*natural)(int)) {
  int at[32];
  for (int j = 0; j < 32; ++j) at[j] = natural(j);
  float* xp = scratch(xs.x, size_t(p.M) * p.K);
  for (int64_t b = 0; b < int64_t(p.M) * p.K; b += 32)
    for (int j = 0; j < 32; ++j) xp[b + j] = p.in[b + at[j]];
  return xp;
}

// x of problem p prepared as its forward kernel consumes it (group sums; 4-bit SIMD: nibble order;
// int8 activations: rounded blocks; tiles: only the nibble order), in the scratch set xs. Several x
// rows (kTileMinRows or more, a prompt) stay exact float even with q8_activations, on every path:
// there the SIMD tiles share one weight conversion among many rows, so int8 would buy nothing.
FwdCtx prepare(const Problem& p, XScratch& xs, Isa isa) {
  const bool quant = p.fmt == FMT_Q4 || p.fmt == FMT_Q8, simd = isa != Isa::scalar;
  FwdCtx c{&p, FwdInput{p.in, nullptr}, isa};
  FwdInput& in = c.in;
  // (K = 0: the row loops, which give zeros; the tiles size their blocks by K.)
  in.tiles = simd && p.M >= kTileMinRows && p.K % 8 == 0 && p.K > 0;
  const bool q8 = p.q8_activations && p.M < kTileMinRows;
  if (quant && in.tiles) {
    if (p.fmt == FMT_Q4) in.x = q4_permuted_x(p, xs, q4_natural);
  } else if (quant) {
    const int G = p.K / p.group_size;
    float* xsum = scratch(xs.xsum, size_t(p.M) * G);
    for (int m = 0; m < p.M && !q8; ++m)  // int8 activations sum the rounded x below
      for (int g = 0; g < G; ++g) {
        const float* xg = p.in + int64_t(m) * p.K + int64_t(g) * p.group_size;
        float s = 0.f;
        for (int k = 0; k < p.group_size; ++k) s += xg[k];
        xsum[int64_t(m) * G + g] = s;
      }
    in.xsum = xsum;
    if (q8) {
      int8_t* xq = scratch(xs.xq, size_t(p.M) * p.K);
      float* xd = scratch(xs.xd, size_t(p.M) * p.K / 32);
      int32_t* qsum = reinterpret_cast<int32_t*>(scratch(xs.qsum, size_t(p.M) * p.K / 32));
      quantize_x(p, isa, xq, xd, qsum);
      // The bias term takes the rounded x too: w.x = s*sum(q x) + b*sum(x) has large cancelling parts
      // (q >= 0), which must see the same x to cancel (exact sums here gave 10%+ errors on real layers).
      const int G = p.K / p.group_size, bpg = p.group_size / 32;
      for (int m = 0; m < p.M; ++m)
        for (int g = 0; g < G; ++g) {
          float t = 0.f;
          for (int b = g * bpg; b < (g + 1) * bpg; ++b)
            t += xd[int64_t(m) * (p.K / 32) + b] * float(qsum[int64_t(m) * (p.K / 32) + b]);
          xsum[int64_t(m) * G + g] = t;
        }
      in.q8 = Q8X{xq, xd};
      const bool wide = runs_avx512(p, in, isa);
      if (simd && p.fmt == FMT_Q4) {
        // Per chunk of W elements (avx2: 64; avx512: 128, a last 64 as avx2's): its even elements, then
        // its odd ones (the low and the high nibbles of its W / 2 packed bytes).
        int8_t* xp = scratch(xs.xperm, size_t(p.M) * p.K);
        for (int64_t base = 0; base < int64_t(p.M) * p.K; base += p.K)
          for (int64_t k = 0; k + 64 <= p.K;) {
            const int64_t w = wide && k + 128 <= p.K ? 128 : 64;
            for (int64_t j = 0; j < w / 2; ++j) {
              xp[base + k + j] = xq[base + k + 2 * j];
              xp[base + k + w / 2 + j] = xq[base + k + 2 * j + 1];
            }
            k += w;
          }
        in.xperm = xp;
      } else if (wide) {  // 8-bit: vpdpbusd takes the weights q unsigned; the kernel's sums are of q - 128
        int32_t* off = scratch(xs.xoff4, size_t(p.M) * p.K / 4);
        for (int64_t t = 0; t < int64_t(p.M) * p.K / 4; ++t)
          off[t] = -128 * (int32_t(xq[4 * t]) + xq[4 * t + 1] + xq[4 * t + 2] + xq[4 * t + 3]);
        in.xoff4 = off;
      }
    } else if (simd && p.fmt == FMT_Q4) {
      in.x = q4_permuted_x(p, xs, runs_avx512(p, in, isa) ? q4_natural16 : q4_natural);
    }
  }
  return c;
}

struct ManyCtx {
  FwdCtx fwd[kMaxProblems];
  int first_chunk[kMaxProblems + 1];  // split mode: problem j owns chunks [first_chunk[j], first_chunk[j+1])
  int count = 0;
  RowEpilogue epilogue = nullptr;     // paired mode: chunk c runs rows [i0, i1) of every problem, then this
  const void* epilogue_ctx = nullptr;
  int rows_per_chunk = 0, n = 0;
};

void split_chunk(const void* vctx, int chunk) {
  const ManyCtx& m = *static_cast<const ManyCtx*>(vctx);
  int j = 0;
  while (chunk >= m.first_chunk[j + 1]) ++j;
  const FwdCtx& c = m.fwd[j];
  const int i0 = (chunk - m.first_chunk[j]) * c.rows_per_chunk;
  fwd_rows(c, i0, std::min(c.p->n, i0 + c.rows_per_chunk));
}

void paired_chunk(const void* vctx, int chunk) {
  const ManyCtx& m = *static_cast<const ManyCtx*>(vctx);
  const int i0 = chunk * m.rows_per_chunk, i1 = std::min(m.n, i0 + m.rows_per_chunk);
  if (i0 >= i1) return;
  for (int j = 0; j < m.count; ++j) fwd_rows(m.fwd[j], i0, i1);
  m.epilogue(m.epilogue_ctx, i0, i1);
}

}  // namespace

void matvec_many(const Problem* ps, int count, RowEpilogue epilogue, const void* epilogue_ctx) {
  if (count < 1 || count > kMaxProblems) throw std::invalid_argument("matvec_many: 1 to kMaxProblems problems");
  const Isa isa = active_isa();
  ManyCtx m;
  m.epilogue = epilogue;
  m.epilogue_ctx = epilogue_ctx;
  int64_t bytes = 0;
  for (int j = 0; j < count; ++j) {
    if (epilogue && (ps[j].n != ps[0].n || ps[j].M != ps[0].M))
      throw std::invalid_argument("matvec_many: paired problems need the same rows and x rows");
    if (ps[j].M == 0 || ps[j].n == 0) {
      if (epilogue) return;  // nothing to pair
      continue;
    }
    // Problems reading the same x the same way (q/k/v, gate/up) share one prepared x.
    const Problem* prev = m.count ? m.fwd[m.count - 1].p : nullptr;
    if (prev && prev->in == ps[j].in && prev->M == ps[j].M && prev->K == ps[j].K && prev->fmt == ps[j].fmt &&
        prev->group_size == ps[j].group_size && prev->q8_activations == ps[j].q8_activations) {
      m.fwd[m.count] = m.fwd[m.count - 1];
      m.fwd[m.count++].p = &ps[j];
    } else {
      m.fwd[m.count++] = prepare(ps[j], tl_xs[j], isa);
    }
    bytes += bytes_per_row(ps[j]) * ps[j].n;
  }
  if (m.count == 0) return;
  if (epilogue) {
    m.n = ps[0].n;
    if (m.n == 0) return;
    const int chunks = chunks_for(bytes, m.n);
    m.rows_per_chunk = (m.n + chunks - 1) / chunks;
    parallel_for((m.n + m.rows_per_chunk - 1) / m.rows_per_chunk, paired_chunk, &m);
    return;
  }
  // Split mode: chunks in proportion to each problem's bytes, so threads get equal shares.
  const int total = chunks_for(bytes, 1 << 20);
  m.first_chunk[0] = 0;
  for (int j = 0; j < m.count; ++j) {
    const Problem& p = *m.fwd[j].p;
    const int64_t b = bytes_per_row(p) * p.n;
    const int c = int(std::max<int64_t>(1, std::min<int64_t>(p.n, (total * b + bytes - 1) / std::max<int64_t>(bytes, 1))));
    m.fwd[j].rows_per_chunk = (p.n + c - 1) / c;
    m.first_chunk[j + 1] = m.first_chunk[j] + (p.n + m.fwd[j].rows_per_chunk - 1) / m.fwd[j].rows_per_chunk;
  }
  parallel_for(m.first_chunk[m.count], split_chunk, &m);
}

namespace {

struct BatchCtx {
  std::vector<FwdCtx> fwd;
  std::vector<int> first_chunk;  // problem j owns chunks [first_chunk[j], first_chunk[j + 1])
};
thread_local std::vector<XScratch> tl_batch_xs;

void batch_chunk(const void* vctx, int chunk) {
  const BatchCtx& b = *static_cast<const BatchCtx*>(vctx);
  const int j = int(std::upper_bound(b.first_chunk.begin(), b.first_chunk.end(), chunk) - b.first_chunk.begin()) - 1;
  const FwdCtx& c = b.fwd[j];
  const int i0 = (chunk - b.first_chunk[j]) * c.rows_per_chunk;
  fwd_rows(c, i0, std::min(c.p->n, i0 + c.rows_per_chunk));
}

bool same_x(const Problem& a, const Problem& b) {
  return a.in == b.in && a.M == b.M && a.K == b.K && a.fmt == b.fmt && a.group_size == b.group_size &&
         a.q8_activations == b.q8_activations;
}

}  // namespace

void matvec_batch(const Problem* ps, int count) {
  const Isa isa = active_isa();
  BatchCtx b;
  b.fwd.reserve(count);
  if (tl_batch_xs.size() < size_t(count)) tl_batch_xs.resize(count);  // before any prepare points into it
  int64_t bytes = 0;
  for (int j = 0; j < count; ++j) {
    const Problem& p = ps[j];
    if (p.M == 0 || p.n == 0) continue;
    int shared = -1;
    for (int i = int(b.fwd.size()) - 1; i >= 0 && shared < 0; --i)
      if (same_x(*b.fwd[i].p, p)) shared = i;
    if (shared >= 0) {
      b.fwd.push_back(b.fwd[shared]);
      b.fwd.back().p = &p;
    } else {
      b.fwd.push_back(prepare(p, tl_batch_xs[j], isa));
    }
    bytes += bytes_per_row(p) * p.n;
  }
  if (b.fwd.empty()) return;
  const int total = chunks_for(bytes, 1 << 20);
  b.first_chunk.assign(1, 0);
  for (FwdCtx& c : b.fwd) {
    const Problem& p = *c.p;
    const int64_t pb = bytes_per_row(p) * p.n;
    const int n = int(std::max<int64_t>(1, std::min<int64_t>(p.n, (total * pb + bytes - 1) / std::max<int64_t>(bytes, 1))));
    c.rows_per_chunk = (p.n + n - 1) / n;
    b.first_chunk.push_back(b.first_chunk.back() + (p.n + c.rows_per_chunk - 1) / c.rows_per_chunk);
  }
  parallel_for(b.first_chunk.back(), batch_chunk, &b);
}

void matvec(const Problem& p) { matvec_many(&p, 1); }

void dot_tiles(const float* x, int M, const float* w, int n, int K, float* out, int ld) {
#if FLASH_X86
  if (active_isa() >= Isa::avx2 && K % 8 == 0) return avx2::dot_tiles(x, M, w, n, K, out, ld);
#endif
  scalar::dot_tiles(x, M, w, n, K, out, ld);
}

void matvec_t(const Problem& p) {
  if (p.K == 0 || p.M == 0) return;
  const bool quant = p.fmt == FMT_Q4 || p.fmt == FMT_Q8;
  TCtx c{&p, active_isa(), 0};
  // Column ranges are whole groups (quantized) or multiples of 16 (half) so SIMD loops stay aligned.
  const int unit = quant ? std::max(32, p.group_size) : 16;
  const int units = (p.K + unit - 1) / unit;
  // One column range per thread: finer splits would make every chunk stride over all rows.
  int chunks = std::min(chunks_for(bytes_per_row(p) * std::max(p.n, 1), units), std::min(num_threads(), pool_size()));
  c.cols_per_chunk = ((units + chunks - 1) / chunks) * unit;
  parallel_for(chunks, t_chunk, &c);
}

}  // namespace flash
