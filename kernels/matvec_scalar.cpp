// The scalar reference kernels: natural element order, one float32 multiply-add at a time. Any CPU
// runs them; the tests run every kernel on them and on the best ISA (see matvec_kernels.h).

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "dtype.h"
#include "matvec_kernels.h"

namespace flash::scalar {

namespace {

template <int ST>
void q_fwd(const Problem& p, const float* x, const float* xsum, int i0, int i1) {
  const int K = p.K, gs = p.group_size, G = K / gs;
  const bool q4 = p.fmt == FMT_Q4;
  for (int i = i0; i < i1; ++i) {
    int64_t r = row_of(p, i);
    for (int m = 0; m < p.M; ++m) {
      if (bad_row(p, r)) { store_out(p.out, p.out_dtype, int64_t(m) * p.n + i, kNaN); continue; }
      const uint8_t* wr = p.w + r * p.w_row_bytes;
      const float* xm = x + int64_t(m) * K;
      float acc = 0.f, bacc = 0.f;
      for (int g = 0; g < G; ++g) {
        float qd = 0.f;
        for (int k = g * gs; k < (g + 1) * gs; ++k) {
          int q = q4 ? ((wr[k >> 1] >> ((k & 1) * 4)) & 0xf) : wr[k];
          qd += float(q) * xm[k];
        }
        acc += ld<ST>(p.scales, r * p.sb_row + g) * qd;
        bacc += ld<ST>(p.biases, r * p.sb_row + g) * xsum[int64_t(m) * G + g];
      }
      store_out(p.out, p.out_dtype, int64_t(m) * p.n + i, acc + bacc);
    }
  }
}

template <int ST>
void q_fwd_i8(const Problem& p, const Q8X& xa, const float* xsum, int i0, int i1) {
  const int K = p.K, gs = p.group_size, G = K / gs, B = K / 32;
  const bool q4 = p.fmt == FMT_Q4;
  for (int i = i0; i < i1; ++i) {
    int64_t r = row_of(p, i);
    for (int m = 0; m < p.M; ++m) {
      if (bad_row(p, r)) { store_out(p.out, p.out_dtype, int64_t(m) * p.n + i, kNaN); continue; }
      const uint8_t* wr = p.w + r * p.w_row_bytes;
      float acc = 0.f, bacc = 0.f;
      for (int b = 0; b < B; ++b)
        acc += ld<ST>(p.scales, r * p.sb_row + b * 32 / gs) * xa.xd[int64_t(m) * B + b] *
               float(q_block_dot(wr, int64_t(b) * 32, xa.xq + int64_t(m) * K, q4));
      for (int g = 0; g < G; ++g) {
        float b = ld<ST>(p.biases, r * p.sb_row + g);
        if (!q4) b += 128.f * ld<ST>(p.scales, r * p.sb_row + g);  // 8-bit: s*q + b = s*(q-128) + (b+128s)
        bacc += b * xsum[int64_t(m) * G + g];
      }
      store_out(p.out, p.out_dtype, int64_t(m) * p.n + i, acc + bacc);
    }
  }
}

// The scalar transposed loop shared by both formats: acc[m][k - k0] = sum_i h[m][i] * W[row(i)][k],
// add_row(r, h, a) adding h * W[r][k0..k1) into a[k0..k1); a bad row makes every output NaN.
template <typename AddRow>
void t_loop(const Problem& p, int k0, int k1, float* acc, AddRow add_row) {
  const int len = k1 - k0;
  std::fill(acc, acc + int64_t(p.M) * len, 0.f);
  bool bad = false;
  for (int i = 0; i < p.n; ++i) {
    int64_t r = row_of(p, i);
    if (bad_row(p, r)) { bad = true; continue; }
    for (int m = 0; m < p.M; ++m) add_row(r, p.in[int64_t(m) * p.n + i], acc + int64_t(m) * len - k0);
  }
  for (int m = 0; m < p.M; ++m)
    for (int k = k0; k < k1; ++k)
      store_out(p.out, p.out_dtype, int64_t(m) * p.K + k, bad ? kNaN : acc[int64_t(m) * len + k - k0]);
}

template <int ST>
void q_t(const Problem& p, int k0, int k1, float* acc) {
  const int gs = p.group_size;
  const bool q4 = p.fmt == FMT_Q4;
  t_loop(p, k0, k1, acc, [&](int64_t r, float h, float* a) {
    const uint8_t* wr = p.w + r * p.w_row_bytes;
    for (int g = k0 / gs; g < k1 / gs; ++g) {
      float hs = h * ld<ST>(p.scales, r * p.sb_row + g), hb = h * ld<ST>(p.biases, r * p.sb_row + g);
      for (int k = g * gs; k < (g + 1) * gs; ++k) {
        int q = q4 ? ((wr[k >> 1] >> ((k & 1) * 4)) & 0xf) : wr[k];
        a[k] += hs * float(q) + hb;
      }
    }
  });
}

template <int WT>
void h_fwd(const Problem& p, const float* x, int i0, int i1) {
  for (int i = i0; i < i1; ++i) {
    int64_t r = row_of(p, i);
    for (int m = 0; m < p.M; ++m) {
      if (bad_row(p, r)) { store_out(p.out, p.out_dtype, int64_t(m) * p.n + i, kNaN); continue; }
      const void* wr = p.w + r * p.w_row_bytes;
      const float* xm = x + int64_t(m) * p.K;
      float acc = 0.f;
      for (int k = 0; k < p.K; ++k) acc += ld<WT>(wr, k) * xm[k];
      store_out(p.out, p.out_dtype, int64_t(m) * p.n + i, acc);
    }
  }
}

template <int WT>
void h_t(const Problem& p, int k0, int k1, float* acc) {
  t_loop(p, k0, k1, acc, [&](int64_t r, float h, float* a) {
    const void* wr = p.w + r * p.w_row_bytes;
    for (int k = k0; k < k1; ++k) a[k] += h * ld<WT>(wr, k);
  });
}

}  // namespace

void fwd_rows(const Problem& p, const FwdInput& in, int i0, int i1) {
  if (p.fmt == FMT_Q4 || p.fmt == FMT_Q8) {
    auto run = [&](auto st) {
      constexpr int ST = decltype(st)::value;
      if (in.q8.xq) q_fwd_i8<ST>(p, in.q8, in.xsum, i0, i1);
      else q_fwd<ST>(p, in.x, in.xsum, i0, i1);
    };
    switch (p.sb_dtype) {
      case DT_F16: run(std::integral_constant<int, DT_F16>{}); break;
      case DT_BF16: run(std::integral_constant<int, DT_BF16>{}); break;
      default: run(std::integral_constant<int, DT_F32>{});
    }
    return;
  }
  if (p.fmt == FMT_BF16) h_fwd<DT_BF16>(p, in.x, i0, i1);
  else h_fwd<DT_F16>(p, in.x, i0, i1);
}

void t_cols(const Problem& p, int k0, int k1, float* acc) {
  if (p.fmt == FMT_Q4 || p.fmt == FMT_Q8) {
    switch (p.sb_dtype) {
      case DT_F16: q_t<DT_F16>(p, k0, k1, acc); break;
      case DT_BF16: q_t<DT_BF16>(p, k0, k1, acc); break;
      default: q_t<DT_F32>(p, k0, k1, acc);
    }
    return;
  }
  if (p.fmt == FMT_BF16) h_t<DT_BF16>(p, k0, k1, acc);
  else h_t<DT_F16>(p, k0, k1, acc);
}

// x [M, K] -> int8 per 32-block (round half to even of x / d, d = max|x| / 127), the block scales
// xd and the blocks' integer sums qsum.
void quantize_x(const float* in, int64_t blocks, int8_t* xq, float* xd, int32_t* qsum) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = in + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    xd[b] = d;
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) s += (xq[b * 32 + j] = int8_t(std::nearbyint(xb[j] * inv)));
    qsum[b] = s;
  }
}

void dot_tiles(const float* x, int M, const float* w, int n, int K, float* out, int ld) {
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < n; ++i) {
      float t = 0.f;
      for (int k = 0; k < K; ++k) t += x[int64_t(m) * K + k] * w[int64_t(i) * K + k];
      out[int64_t(m) * ld + i] = t;
    }
}

}  // namespace flash::scalar
