// CPU matvec kernels for MLX weight layouts: affine-quantized (4/8 bit, uint32 words, low bits first,
// w = scale * q + bias per group along K) and float16 / bfloat16 rows. AVX2/FMA/F16C code is chosen at
// run time on x86-64; everything else (and x86 without AVX2) uses the portable scalar path.
// All sums are float32. Work is split over output elements across a small persistent thread pool.

#include "matvec.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define FLASH_X86 1
#include <immintrin.h>
#define FLASH_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define FLASH_X86 0
#endif

namespace flash {

// ---------------------------------------------------------------------------------------------
// Scalar conversions
static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffff;
  if (ax >= 0x7f800000) return uint16_t(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0));
  if (ax >= 0x477ff000) return uint16_t(sign | 0x7c00);  // overflow -> inf
  if (ax < 0x38800000) {                                    // subnormal or zero
    if (ax < 0x33000000) return uint16_t(sign);
    uint32_t e = ax >> 23, m = (ax & 0x7fffff) | 0x800000;
    int shift = 126 - int(e);  // value = m * 2^(e-150) = r * 2^-24
    uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = ((ax >> 13) - (112u << 10));
  uint32_t rem = ax & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
  return uint16_t(sign | r);
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fff + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

float load_scalar(const void* base, int dtype, int64_t i) {
  switch (dtype) {
    case DT_F16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DT_BF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

#if FLASH_X86
// float16: F16C both ways; bfloat16: round to nearest even on the bits, NaN kept quiet (f32_to_bf16).
// Whole blocks of 8 only; returns how many values it rounded (round_floats does the rest).
FLASH_AVX2 static int64_t round_floats_avx2(int dtype, float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    __m256 y;
    if (dtype == DT_F16) {
      y = _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    } else {
      const __m256i b = _mm256_castps_si256(x), hi = _mm256_set1_epi32(int(0xffff0000u));
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
      const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), hi);
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
      const __m256i q = _mm256_and_si256(_mm256_or_si256(b, _mm256_set1_epi32(0x00400000)), hi);
      y = _mm256_castsi256_ps(_mm256_blendv_epi8(r, q, nan));
    }
    _mm256_storeu_ps(v + i, y);
  }
  return i;
}
#endif

void round_floats(int dtype, float* v, int64_t n) {
  if (dtype == DT_F32) return;
  int64_t i = 0;
#if FLASH_X86
  if (simd_active()) i = round_floats_avx2(dtype, v, n);
#endif
  for (; i < n; ++i) v[i] = dtype == DT_F16 ? f16_to_f32(f32_to_f16(v[i])) : bf16_to_f32(f32_to_bf16(v[i]));
}

// Inlined into the kernels, which store one output per row (an out-of-line call showed in profiles).
__attribute__((always_inline)) static inline void store_out(void* base, int dtype, int64_t i, float v) {
  switch (dtype) {
    case DT_F16: static_cast<uint16_t*>(base)[i] = f32_to_f16(v); break;
    case DT_BF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(v); break;
    default: static_cast<float*>(base)[i] = v;
  }
}

void store_scalar(void* base, int dtype, int64_t i, float v) { store_out(base, dtype, i, v); }

template <int ST>
static inline float ld(const void* base, int64_t i) {
  if constexpr (ST == DT_F16) return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
  else if constexpr (ST == DT_BF16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  else return static_cast<const float*>(base)[i];
}

static const float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// Persistent thread pool. A call is split into chunks that the caller and the workers claim from
// one atomic counter, so a worker that is not scheduled (cores shared with other processes) just
// leaves its chunks to the caller instead of stalling it. Idle workers spin briefly (decode issues
// hundreds of small matvecs per token; a futex wake per call would cost more than the work), then
// sleep on a condition variable.
namespace {

using TaskFn = void (*)(const void* ctx, int chunk);

inline void cpu_relax() {
#if FLASH_X86
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { loop(); });
  }
  int size() const { return int(threads_.size()) + 1; }

  // Runs fn(ctx, c) for every c in [0, chunks), on the caller and any worker that is awake.
  void run(TaskFn fn, const void* ctx, int chunks) {
    if (chunks <= 1 || threads_.empty() || !busy_.try_lock()) {  // nested/concurrent: serial
      for (int c = 0; c < chunks; ++c) fn(ctx, c);
      return;
    }
    for (int base = 0; base < chunks; base += kMaxChunks) run_locked(fn, ctx, base, std::min(kMaxChunks, chunks - base));
    busy_.unlock();
  }

 private:
  // The job's chunk count lives in the state word beside the generation and the next chunk: a
  // worker still looping on the previous job must never compare its counter against the next job's
  // count (a plain field written before the new generation is published let a straggler claim a
  // chunk past the old job's end and run it on the new job's context).
  static constexpr int kMaxChunks = 0xffff;
  static uint64_t pack(uint64_t gen, int total, int next) { return gen << 32 | uint64_t(total) << 16 | uint64_t(next); }

  void run_locked(TaskFn fn, const void* ctx, int base, int chunks) {
    fn_ = fn;
    ctx_ = ctx;
    base_ = base;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    {
      std::lock_guard<std::mutex> lk(mutex_);
      state_.store(pack(gen, chunks, 0), std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    work(gen);
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins < 4096) cpu_relax();
      else std::this_thread::yield();
    }
  }

  // Claim and run chunks of generation gen until none are left (or a newer job started).
  void work(uint64_t gen) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if ((s >> 32) != gen) return;
      const int c = int(s & 0xffff), total = int((s >> 16) & 0xffff);
      if (c >= total) return;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      // A claimed chunk keeps its job alive (the caller waits for done_), so fn_/ctx_ are stable.
      fn_(ctx_, base_ + c);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      uint64_t gen;
      while ((gen = state_.load(std::memory_order_acquire) >> 32) == seen) {
        cpu_relax();
        if ((++spins & 255) != 0) continue;
        // Let another runnable thread have this core between polls (mlx-lm builds the next token's
        // graph in Python while this one computes: a busy spin would take a core from it).
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(200)) {
          std::unique_lock<std::mutex> lk(mutex_);
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          cv_.wait(lk, [&] { return (state_.load(std::memory_order_acquire) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      seen = gen;
      work(gen);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex busy_, mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> state_{0};  // generation << 32 | chunks << 16 | next chunk to claim
  std::atomic<int> done_{0}, sleepers_{0};
  TaskFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int base_ = 0;  // chunk index of this round's chunk 0 (jobs over kMaxChunks run in rounds)
};

std::atomic<int> g_threads{0};  // 0: not decided yet
std::atomic<bool> g_simd{true};

int default_threads() {
  if (const char* env = std::getenv("MLX_FLASH_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : int(std::min(hc, 16u));
}

Pool& pool() {
  // Leaked on purpose: joining at interpreter exit could block on a sleeping worker.
  static Pool* p = new Pool(std::max(0, num_threads() - 1));
  return *p;
}

bool cpu_has_avx2() {
#if FLASH_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

}  // namespace

void set_simd_enabled(bool enabled) { g_simd.store(enabled); }
bool simd_active() { return g_simd.load() && cpu_has_avx2(); }
void set_num_threads(int n) {
  // Only before the pool exists; later calls just cap how many chunks are used.
  g_threads.store(std::max(1, n));
}
int num_threads() {
  int n = g_threads.load();
  if (n == 0) {
    n = default_threads();
    g_threads.store(n);
  }
  return n;
}

// ---------------------------------------------------------------------------------------------
// Per-call scratch (grows, never shrinks; one set per thread so no allocation once warm).
static float* scratch(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
static int8_t* scratch_bytes(std::vector<int8_t>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// The 4-bit forward SIMD loop consumes a 32-element block as [0,2,..,14][1,3,..,15][16,..,30][17,..,31];
// natural index of permuted position p:
static inline int q4_natural(int p) { return (p >> 4) * 16 + 2 * (p & 7) + ((p >> 3) & 1); }

// x rows from which the forward kernels run as tiles (fwd_tiles) on the SIMD path.
constexpr int kTileMinRows = 6;

static inline bool bad_row(const Problem& p, int64_t r) { return r < 0 || r >= p.N; }
static inline int64_t row_of(const Problem& p, int i) { return p.rows ? int64_t(p.rows[i]) : int64_t(i); }

// ---------------------------------------------------------------------------------------------
// Scalar kernels (natural element order)
template <int ST>
static void q_fwd_scalar(const Problem& p, const float* x, const float* xsum, int i0, int i1) {
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

// x rounded to int8 per 32-block: xq [M, K] natural order, xd [M, K/32] block scales.
struct Q8X {
  const int8_t* xq;
  const float* xd;
};

// Integer dot of one 32-block of a quantized row (natural order) with xq. 8-bit rows use q - 128
// (a signed byte, as the SIMD path needs) and fold 128*s into the bias term (which uses the
// rounded x's block sums, like everything else on this path).
static inline int32_t q_block_dot(const uint8_t* wr, int64_t k, const int8_t* xq, bool q4) {
  int32_t s = 0;
  for (int j = 0; j < 32; ++j) {
    const int64_t e = k + j;
    const int q = q4 ? ((wr[e >> 1] >> ((e & 1) * 4)) & 0xf) : int(wr[e]) - 128;
    s += q * int32_t(xq[e]);
  }
  return s;
}

template <int ST>
static void q_fwd_i8_scalar(const Problem& p, const Q8X& xa, const float* xsum, int i0, int i1) {
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
static void t_scalar(const Problem& p, int k0, int k1, float* acc, AddRow add_row) {
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
static void q_t_scalar(const Problem& p, int k0, int k1, float* acc) {
  const int gs = p.group_size;
  const bool q4 = p.fmt == FMT_Q4;
  t_scalar(p, k0, k1, acc, [&](int64_t r, float h, float* a) {
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
static void h_fwd_scalar(const Problem& p, const float* x, int i0, int i1) {
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
static void h_t_scalar(const Problem& p, int k0, int k1, float* acc) {
  t_scalar(p, k0, k1, acc, [&](int64_t r, float h, float* a) {
    const void* wr = p.w + r * p.w_row_bytes;
    for (int k = k0; k < k1; ++k) a[k] += h * ld<WT>(wr, k);
  });
}

// ---------------------------------------------------------------------------------------------
// AVX2 kernels
#if FLASH_X86

template <int ST>
FLASH_AVX2 static inline float ldv(const void* base, int64_t i) {
  if constexpr (ST == DT_F16) return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
  else return ld<ST>(base, i);
}

// store_out with F16C's conversion for float16 outputs (one instruction, round to nearest even as
// f32_to_f16; the software routine per output element was a tenth of a small matvec's samples).
FLASH_AVX2 static inline void store_out_simd(void* base, int dtype, int64_t i, float v) {
  if (dtype == DT_F16) static_cast<uint16_t*>(base)[i] = uint16_t(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
  else store_out(base, dtype, i, v);
}

FLASH_AVX2 static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Dequantise 32 consecutive quantized values (as integers in float) starting at element k.
template <bool Q4>
FLASH_AVX2 static inline void load32(const uint8_t* wr, int64_t k, __m256& w0, __m256& w1, __m256& w2,
                                     __m256& w3) {
  if constexpr (Q4) {
    // Byte j of the packed row holds elements 2j (low nibble) and 2j+1 (high). Zero-extending 8
    // bytes to 32-bit lanes, then masking / shifting, yields the even and the odd elements; x is
    // pre-permuted to match (q4_position). Cheaper than per-lane variable shifts on this core.
    const __m256i mask = _mm256_set1_epi32(0xf);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k / 2)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k / 2 + 8)));
    w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
    w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    w2 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
    w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  } else {
    const uint8_t* b = wr + k;
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8))));
    w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16))));
    w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 24))));
  }
}

FLASH_AVX2 static inline void prefetch_span(const void* start, int64_t bytes) {
  const char* s = static_cast<const char*>(start);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(s + o, _MM_HINT_T0);
}

// Gathered rows are not where the hardware prefetcher looks. The loops below prefetch the next
// row's weights line by line as they stream the current row at the same offset (one row of compute
// ahead; a whole row at once overflows the core's outstanding-miss slots), and its scales / biases
// of groups [g0, g0 + ng) when they start a row. Returns the next row's weights (nullptr: none).
FLASH_AVX2 static inline const uint8_t* prefetch_next_row(const Problem& p, int next, int end, int g0 = 0, int ng = 0) {
  if (!p.rows || next >= end) return nullptr;
  const int64_t r = row_of(p, next);
  if (bad_row(p, r)) return nullptr;
  if (ng > 0) {
    const int es = p.sb_dtype == DT_F32 ? 4 : 2;
    prefetch_span(static_cast<const char*>(p.scales) + (r * p.sb_row + g0) * es, int64_t(ng) * es);
    prefetch_span(static_cast<const char*>(p.biases) + (r * p.sb_row + g0) * es, int64_t(ng) * es);
  }
  return p.w + r * p.w_row_bytes;
}

// Prefetch the line at byte offset `off` of a row (nullptr: nothing) once per 64 bytes streamed.
// PF (gathered rows) is a template flag so the dense loops carry no trace of it.
template <bool PF>
FLASH_AVX2 static inline void prefetch_line(const uint8_t* row, int64_t off) {
  if constexpr (PF)
    if (row && (off & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + off), _MM_HINT_T0);
}

// n scale-like values of a row starting at element i, as float (8 at a time for half types).
template <int ST>
FLASH_AVX2 static inline __m256 load8s(const void* base, int64_t i) {
  if constexpr (ST == DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  else if constexpr (ST == DT_BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i))), 16));
  else return _mm256_loadu_ps(static_cast<const float*>(base) + i);
}

// sum_g (b_g [+ 128 s_g for the int8-activation 8-bit path: Q4 = false]) * xsum_g over a row's G groups.
template <int ST, bool Q4>
FLASH_AVX2 static inline float row_bias_dot(const Problem& p, int64_t sb, const float* xsum, int G) {
  __m256 acc = _mm256_setzero_ps();
  int g = 0;
  for (; g + 8 <= G; g += 8) {
    __m256 b = load8s<ST>(p.biases, sb + g);
    if constexpr (!Q4) b = _mm256_fmadd_ps(_mm256_set1_ps(128.f), load8s<ST>(p.scales, sb + g), b);
    acc = _mm256_fmadd_ps(b, _mm256_loadu_ps(xsum + g), acc);
  }
  float t = hsum(acc);
  for (; g < G; ++g) {
    float b = ldv<ST>(p.biases, sb + g);
    if constexpr (!Q4) b += 128.f * ldv<ST>(p.scales, sb + g);
    t += b * xsum[g];
  }
  return t;
}

template <int MB, int ST, bool Q4, bool PF, int CPG>
FLASH_AVX2 static void q_fwd_avx2(const Problem& p, const float* x, const float* xsum, int m0, int i0, int i1) {
  // CPG 32-element chunks per group (group size 32 * CPG), unrolled. A row's scales are converted to
  // float 8 at a time into sc first (one broadcast load per group instead of a scalar half load,
  // convert and broadcast), and alternate groups feed two accumulators, so consecutive groups do not
  // wait on each other's FMA. In a stand-alone loop (one thread, weights cache-resident) this took
  // the 4-bit group-32 kernel from 9.6 to 10.5 GB/s, group 64 from 11.2 to 11.4: the loop is bound
  // by how many vector ops the FP pipes can issue, about 21 per 32 weights before, 18 now.
  constexpr int kSpan = 256;  // groups per pass over sc
  const int K = p.K, gs = 32 * CPG, G = K / gs;
  float sc[kSpan];
  for (int i = i0; i < i1; ++i) {
    int64_t r = row_of(p, i);
    if (bad_row(p, r)) {
      for (int m = 0; m < MB; ++m) store_out_simd(p.out, p.out_dtype, int64_t(m0 + m) * p.n + i, kNaN);
      continue;
    }
    const uint8_t* next = PF ? prefetch_next_row(p, i + 1, i1, 0, G) : nullptr;
    const uint8_t* wr = p.w + r * p.w_row_bytes;
    const int64_t sb = r * p.sb_row;
    __m256 acc0[MB], acc1[MB];
    for (int m = 0; m < MB; ++m) { acc0[m] = _mm256_setzero_ps(); acc1[m] = _mm256_setzero_ps(); }
    for (int gb = 0; gb < G; gb += kSpan) {
      const int ge = std::min(G, gb + kSpan);
      int g = gb;
      for (; g + 8 <= ge; g += 8) _mm256_storeu_ps(sc + (g - gb), load8s<ST>(p.scales, sb + g));
      for (; g < ge; ++g) sc[g - gb] = ldv<ST>(p.scales, sb + g);
      for (g = gb; g < ge; ++g) {
        // One x row: two partial sums keep the FMA dependency chains within a group short too. Four
        // rows (prompts): the rows are the independent chains, so one partial each (q1 is qa) and one
        // accumulator: 13 vector registers instead of 21, which spilled (in a throwaway stand-alone
        // loop, 1536x576 group 32, cache-resident: 4 rows 204 -> 154 us on one thread, 106-159 ->
        // 81-136 us on two; 37 rows 2104 -> 1547 us). The float32 summation order then differs from
        // the one-row loop's (both within the tests' accumulation bounds).
        constexpr bool kSplit = MB < 4;
        __m256 qa[MB], qb[MB];
        __m256* q1 = kSplit ? qb : qa;  // takes the 2nd and 4th 8-lane blocks
        for (int m = 0; m < MB; ++m) { qa[m] = _mm256_setzero_ps(); qb[m] = _mm256_setzero_ps(); }
        for (int c = 0; c < CPG; ++c) {
          const int64_t k = int64_t(g) * gs + c * 32;
          prefetch_line<PF>(next, Q4 ? k / 2 : k);
          __m256 w0, w1, w2, w3;
          load32<Q4>(wr, k, w0, w1, w2, w3);
          for (int m = 0; m < MB; ++m) {
            const float* xm = x + int64_t(m0 + m) * K + k;
            qa[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), qa[m]);
            q1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), q1[m]);
            qa[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), qa[m]);
            q1[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), q1[m]);
          }
        }
        const __m256 s = _mm256_broadcast_ss(sc + (g - gb));
        for (int m = 0; m < MB; ++m) {
          if constexpr (kSplit) {
            acc0[m] = _mm256_fmadd_ps(s, _mm256_add_ps(qa[m], qb[m]), acc0[m]);
            std::swap(acc0[m], acc1[m]);
          } else {
            acc0[m] = _mm256_fmadd_ps(s, qa[m], acc0[m]);
          }
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const float bacc = row_bias_dot<ST, true>(p, sb, xsum + int64_t(m0 + m) * G, G);
      store_out_simd(p.out, p.out_dtype, int64_t(m0 + m) * p.n + i, hsum(_mm256_add_ps(acc0[m], acc1[m])) + bacc);
    }
  }
}

template <int ST, bool Q4, bool PF>
FLASH_AVX2 static void q_t_avx2(const Problem& p, int k0, int k1, float* acc) {
  // acc[m][k] collects sum_i (h*s)*q, four rows per pass so each accumulator load/store serves four
  // FMAs per lane (in row order, so the float32 summation order is unchanged); the bias part sum_i h*b
  // is constant within a group, so it is collected per group (bacc) and added once at the end. Rows
  // are decoded 32 elements at a time (load32); for 4 bits that is the nibble order of the forward
  // loop, so acc holds each 32-block in that order and is put back in natural order when stored.
  constexpr int R = 4;
  const int gs = p.group_size, len = k1 - k0, g0 = k0 / gs, ng = len / gs;
  float* bacc = acc + int64_t(p.M) * len;
  std::fill(acc, acc + int64_t(p.M) * (len + ng), 0.f);
  bool bad = false;
  int i = 0;
  while (i < p.n) {
    int nr = 0;
    const uint8_t* wr[R];
    int64_t sb[R];
    int idx[R];
    for (; nr < R && i < p.n; ++i) {
      int64_t r = row_of(p, i);
      if (bad_row(p, r)) { bad = true; continue; }
      wr[nr] = p.w + r * p.w_row_bytes;
      sb[nr] = r * p.sb_row;
      idx[nr++] = i;
    }
    const uint8_t* next[R];  // the next pass's rows (at most R; bad or missing ones: nullptr)
    for (int t = 0; t < R; ++t) next[t] = PF ? prefetch_next_row(p, i + t, p.n, g0, ng) : nullptr;
    for (int t = nr; t < R; ++t) { wr[t] = wr[0]; sb[t] = sb[0]; }  // padded rows get h = 0
    for (int g = g0; g < g0 + ng; ++g) {
      float s[R], b[R];
      for (int t = 0; t < R; ++t) { s[t] = ldv<ST>(p.scales, sb[t] + g); b[t] = ldv<ST>(p.biases, sb[t] + g); }
      for (int m = 0; m < p.M; ++m) {
        const float* hm = p.in + int64_t(m) * p.n;
        __m256 hs[R];
        float hb = 0.f;  // the pass's bias part, summed in a register (one read-modify-write of bacc)
        for (int t = 0; t < R; ++t) {
          const float h = t < nr ? hm[idx[t]] : 0.f;
          hs[t] = _mm256_set1_ps(h * s[t]);
          hb += h * b[t];
        }
        bacc[int64_t(m) * ng + (g - g0)] += hb;
        float* a = acc + int64_t(m) * len - k0;
        for (int64_t k = int64_t(g) * gs; k < int64_t(g + 1) * gs; k += 32) {
          if (PF && m == 0)
            for (int t = 0; t < R; ++t) prefetch_line<PF>(next[t], Q4 ? k / 2 : k);
          __m256 v0 = _mm256_loadu_ps(a + k), v1 = _mm256_loadu_ps(a + k + 8), v2 = _mm256_loadu_ps(a + k + 16),
                 v3 = _mm256_loadu_ps(a + k + 24);
          for (int t = 0; t < R; ++t) {
            __m256 w0, w1, w2, w3;
            load32<Q4>(wr[t], k, w0, w1, w2, w3);
            v0 = _mm256_fmadd_ps(hs[t], w0, v0);
            v1 = _mm256_fmadd_ps(hs[t], w1, v1);
            v2 = _mm256_fmadd_ps(hs[t], w2, v2);
            v3 = _mm256_fmadd_ps(hs[t], w3, v3);
          }
          _mm256_storeu_ps(a + k, v0);
          _mm256_storeu_ps(a + k + 8, v1);
          _mm256_storeu_ps(a + k + 16, v2);
          _mm256_storeu_ps(a + k + 24, v3);
        }
      }
    }
  }
  for (int m = 0; m < p.M; ++m)
    for (int j = 0; j < len; ++j) {
      const int nat = Q4 ? (j & ~31) + q4_natural(j & 31) : j;
      const float v = acc[int64_t(m) * len + j] + bacc[int64_t(m) * ng + j / gs];
      store_out_simd(p.out, p.out_dtype, int64_t(m) * p.K + k0 + nat, bad ? kNaN : v);
    }
}

template <bool BF>
FLASH_AVX2 static inline __m256 load8h(const uint16_t* w) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  if constexpr (BF) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  else return _mm256_cvtph_ps(v);
}

template <bool BF>
FLASH_AVX2 static inline float ldh(const uint16_t* w, int k) {
  if constexpr (BF) return bf16_to_f32(w[k]);
  else return _cvtsh_ss(w[k]);
}

template <bool BF>
FLASH_AVX2 static void load_floats_avx2(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8h<BF>(src + i));
  for (; i < n; ++i) dst[i] = ldh<BF>(src, int(i));
}

template <int MB, bool BF, bool PF>
FLASH_AVX2 static void h_fwd_avx2(const Problem& p, const float* x, int m0, int i0, int i1) {
  const int K = p.K;
  for (int i = i0; i < i1; ++i) {
    int64_t r = row_of(p, i);
    if (bad_row(p, r)) {
      for (int m = 0; m < MB; ++m) store_out_simd(p.out, p.out_dtype, int64_t(m0 + m) * p.n + i, kNaN);
      continue;
    }
    const uint8_t* next = PF ? prefetch_next_row(p, i + 1, i1) : nullptr;
    const uint16_t* wr = reinterpret_cast<const uint16_t*>(p.w + r * p.w_row_bytes);
    __m256 a0[MB], a1[MB];
    float tail[MB];
    for (int m = 0; m < MB; ++m) { a0[m] = _mm256_setzero_ps(); a1[m] = _mm256_setzero_ps(); tail[m] = 0.f; }
    int k = 0;
    for (; k + 16 <= K; k += 16) {
      prefetch_line<PF>(next, 2 * int64_t(k));
      __m256 w0 = load8h<BF>(wr + k), w1 = load8h<BF>(wr + k + 8);
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + int64_t(m0 + m) * K + k;
        a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xm), a0[m]);
        a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), a1[m]);
      }
    }
    for (; k + 8 <= K; k += 8) {
      __m256 w0 = load8h<BF>(wr + k);
      for (int m = 0; m < MB; ++m) a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + int64_t(m0 + m) * K + k), a0[m]);
    }
    for (; k < K; ++k) {
      float w = ldh<BF>(wr, k);
      for (int m = 0; m < MB; ++m) tail[m] += w * x[int64_t(m0 + m) * K + k];
    }
    for (int m = 0; m < MB; ++m)
      store_out_simd(p.out, p.out_dtype, int64_t(m0 + m) * p.n + i, hsum(_mm256_add_ps(a0[m], a1[m])) + tail[m]);
  }
}

template <bool BF>
FLASH_AVX2 static void h_t_avx2(const Problem& p, int k0, int k1, float* acc) {
  // Four rows per pass over the accumulators, as in q_t_avx2.
  constexpr int R = 4;
  const int len = k1 - k0;
  std::fill(acc, acc + int64_t(p.M) * len, 0.f);
  bool bad = false;
  int i = 0;
  while (i < p.n) {
    int nr = 0;
    const uint16_t* wr[R];
    int idx[R];
    for (; nr < R && i < p.n; ++i) {
      int64_t r = row_of(p, i);
      if (bad_row(p, r)) { bad = true; continue; }
      wr[nr] = reinterpret_cast<const uint16_t*>(p.w + r * p.w_row_bytes) + k0;
      idx[nr++] = i;
    }
    if (const uint8_t* next = prefetch_next_row(p, i, p.n))  // half rows: its first 512 bytes measured best
      prefetch_span(next + 2 * int64_t(k0), std::min<int64_t>(512, 2 * int64_t(len)));
    for (int t = nr; t < R; ++t) wr[t] = wr[0];
    for (int m = 0; m < p.M; ++m) {
      const float* hm = p.in + int64_t(m) * p.n;
      float h[R];
      for (int t = 0; t < R; ++t) h[t] = t < nr ? hm[idx[t]] : 0.f;
      const __m256 h0 = _mm256_set1_ps(h[0]), h1 = _mm256_set1_ps(h[1]), h2 = _mm256_set1_ps(h[2]),
                   h3 = _mm256_set1_ps(h[3]);
      float* a = acc + int64_t(m) * len;
      int j = 0;
      for (; j + 8 <= len; j += 8) {
        __m256 v = _mm256_loadu_ps(a + j);
        v = _mm256_fmadd_ps(h0, load8h<BF>(wr[0] + j), v);
        v = _mm256_fmadd_ps(h1, load8h<BF>(wr[1] + j), v);
        v = _mm256_fmadd_ps(h2, load8h<BF>(wr[2] + j), v);
        v = _mm256_fmadd_ps(h3, load8h<BF>(wr[3] + j), v);
        _mm256_storeu_ps(a + j, v);
      }
      for (; j < len; ++j)
        for (int t = 0; t < nr; ++t) a[j] += h[t] * ldh<BF>(wr[t], j);
    }
  }
  for (int m = 0; m < p.M; ++m)
    for (int j = 0; j < len; ++j)
      store_out_simd(p.out, p.out_dtype, int64_t(m) * p.K + k0 + j, bad ? kNaN : acc[int64_t(m) * len + j]);
}

template <int ST, bool Q4, bool PF, int CPG>
FLASH_AVX2 static void q_fwd_avx2_rows(const Problem& p, const float* x, const float* xsum, int i0, int i1) {
  // One weight row per pass, also for a single x row: streaming from memory, interleaving two rows
  // measured 1.45x slower (8-bit, 49152x576: 7.3-8.3 vs 11.6 GB/s on one thread).
  int m0 = 0;
  for (; m0 + 4 <= p.M; m0 += 4) q_fwd_avx2<4, ST, Q4, PF, CPG>(p, x, xsum, m0, i0, i1);
  switch (p.M - m0) {
    case 1: q_fwd_avx2<1, ST, Q4, PF, CPG>(p, x, xsum, m0, i0, i1); break;
    case 2: q_fwd_avx2<2, ST, Q4, PF, CPG>(p, x, xsum, m0, i0, i1); break;
    case 3: q_fwd_avx2<3, ST, Q4, PF, CPG>(p, x, xsum, m0, i0, i1); break;
    default: break;
  }
}

template <int ST, bool Q4, bool PF>
FLASH_AVX2 static void q_fwd_avx2_groups(const Problem& p, const float* x, const float* xsum, int i0, int i1) {
  switch (p.group_size) {  // the ops check it is 32, 64 or 128
    case 32: q_fwd_avx2_rows<ST, Q4, PF, 1>(p, x, xsum, i0, i1); break;
    case 64: q_fwd_avx2_rows<ST, Q4, PF, 2>(p, x, xsum, i0, i1); break;
    default: q_fwd_avx2_rows<ST, Q4, PF, 4>(p, x, xsum, i0, i1); break;
  }
}

// Prompts (p.M >= kTileMinRows x rows): each weight row is turned into float once per block of x
// rows (TILE_NR rows at a time, into a small panel: s*q + b for quantized weights, in the order
// load32 yields and the prepared x follows; the float value of half weights), then a TILE_MR x
// TILE_NR register tile of dot products runs over K: 12 FMAs per 3 x loads and 4 panel loads, where
// the one-row loops convert every weight again for each x row (1536x576 4-bit, one thread, 64 rows:
// 12.4 -> 29.6 GMAC/s in a stand-alone loop). Sums are float32 as everywhere, in another order.
constexpr int TILE_MR = 3, TILE_NR = 4;
thread_local std::vector<float> tl_panel;

// Panel row of quantized weight row r: w = s*q + b (one float32 rounding, as the reference's).
template <int ST, bool Q4>
FLASH_AVX2 static void panel_row_q(const Problem& p, int64_t r, float* dst) {
  const int gs = p.group_size;
  const uint8_t* wr = p.w + r * p.w_row_bytes;
  for (int k = 0; k < p.K; k += gs) {
    const int64_t g = r * p.sb_row + k / gs;
    const __m256 s = _mm256_set1_ps(ldv<ST>(p.scales, g)), b = _mm256_set1_ps(ldv<ST>(p.biases, g));
    for (int c = k; c < k + gs; c += 32) {
      __m256 w0, w1, w2, w3;
      load32<Q4>(wr, c, w0, w1, w2, w3);
      _mm256_storeu_ps(dst + c, _mm256_fmadd_ps(w0, s, b));
      _mm256_storeu_ps(dst + c + 8, _mm256_fmadd_ps(w1, s, b));
      _mm256_storeu_ps(dst + c + 16, _mm256_fmadd_ps(w2, s, b));
      _mm256_storeu_ps(dst + c + 24, _mm256_fmadd_ps(w3, s, b));
    }
  }
}

template <bool BF>
FLASH_AVX2 static void panel_row_h(const Problem& p, int64_t r, float* dst) {
  const uint16_t* wr = reinterpret_cast<const uint16_t*>(p.w + r * p.w_row_bytes);
  for (int k = 0; k < p.K; k += 8) _mm256_storeu_ps(dst + k, load8h<BF>(wr + k));
}

// Dot products of x rows m0 .. m0+2 (of M, each K floats, K a multiple of 8) with the 4 panel rows,
// into out[(m0 + a) * ld + col + j] (dtype out_dtype) for the ones that exist: x rows past M are read
// again as the last row, and panel rows past n_left (zero padding, another thread's rows) not stored.
FLASH_AVX2 static void tile_dots(const float* x, int M, int K, const float* panel, int m0, int n_left, void* out,
                                 int out_dtype, int64_t ld, int64_t col) {
  const float* xr[TILE_MR];
  for (int a = 0; a < TILE_MR; ++a) xr[a] = x + int64_t(std::min(m0 + a, M - 1)) * K;
  __m256 acc[TILE_MR][TILE_NR];
  for (int a = 0; a < TILE_MR; ++a)
    for (int j = 0; j < TILE_NR; ++j) acc[a][j] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 8) {
    __m256 w[TILE_NR];
    for (int j = 0; j < TILE_NR; ++j) w[j] = _mm256_loadu_ps(panel + int64_t(j) * K + k);
    for (int a = 0; a < TILE_MR; ++a) {
      const __m256 xv = _mm256_loadu_ps(xr[a] + k);
      for (int j = 0; j < TILE_NR; ++j) acc[a][j] = _mm256_fmadd_ps(xv, w[j], acc[a][j]);
    }
  }
  for (int a = 0; a < TILE_MR && m0 + a < M; ++a)
    for (int j = 0; j < TILE_NR && j < n_left; ++j)
      store_out_simd(out, out_dtype, int64_t(m0 + a) * ld + col + j, hsum(acc[a][j]));
}

// Rows [i0, i1) of every x row by tiles; fill(r, dst) writes weight row r's K floats.
template <class Fill>
FLASH_AVX2 static void fwd_tiles(const Problem& p, const float* x, int i0, int i1, Fill fill) {
  const int K = p.K;
  float* panel = scratch(tl_panel, size_t(TILE_NR) * K);
  // x rows per block: about 192 KiB of x stays in L2 while the panels of [i0, i1) pass by.
  const int mb = std::max(TILE_MR, int((192 << 10) / (int64_t(K) * 4)) / TILE_MR * TILE_MR);
  for (int m0 = 0; m0 < p.M; m0 += mb) {
    const int m1 = std::min(p.M, m0 + mb);
    for (int i = i0; i < i1; i += TILE_NR) {
      for (int j = 0; j < TILE_NR; ++j) {
        float* dst = panel + int64_t(j) * K;
        const int64_t r = i + j < i1 ? row_of(p, i + j) : 0;
        if (i + j >= i1) std::fill(dst, dst + K, 0.f);
        else if (bad_row(p, r)) std::fill(dst, dst + K, kNaN);
        else fill(r, dst);
      }
      for (int m = m0; m < m1; m += TILE_MR) tile_dots(x, p.M, K, panel, m, i1 - i, p.out, p.out_dtype, p.n, i);
    }
  }
}

FLASH_AVX2 static void dot_tiles_avx2(const float* x, int M, const float* w, int n, int K, float* out, int ld) {
  for (int i = 0; i < n; i += TILE_NR)
    for (int m = 0; m < M; m += TILE_MR)
      tile_dots(x, M, K, w + int64_t(i) * K, m, n - i, out, DT_F32, ld, i);
}

template <bool BF, bool PF>
FLASH_AVX2 static void h_fwd_avx2_rows(const Problem& p, const float* x, int i0, int i1) {
  int m0 = 0;
  for (; m0 + 4 <= p.M; m0 += 4) h_fwd_avx2<4, BF, PF>(p, x, m0, i0, i1);
  switch (p.M - m0) {
    case 1: h_fwd_avx2<1, BF, PF>(p, x, m0, i0, i1); break;
    case 2: h_fwd_avx2<2, BF, PF>(p, x, m0, i0, i1); break;
    case 3: h_fwd_avx2<3, BF, PF>(p, x, m0, i0, i1); break;
    default: break;
  }
}
// int8-activation forward (Problem::q8_activations), one x row at a time. 4-bit: a 64-element chunk
// is two 32-blocks A, B in 32 packed bytes; masking / shifting gives the even elements of A then B
// (low nibbles) and the odd ones (high nibbles), so x is pre-arranged as xe / xo per chunk (xperm).
// maddubs (u8 x s8 -> pairwise s16, at most 15*127*2) then madd (-> s32) gives per-lane partial
// sums; lanes 0-3 belong to A, 4-7 to B, each scaled by its block's s*d. 8-bit: q - 128 as s8 with
// the abs/sign trick (at most 128*127*2 per pair); the +128 part is folded into the bias term.
template <int ST, bool Q4, bool PF>
FLASH_AVX2 static void q_fwd_i8_avx2(const Problem& p, const Q8X& xa, const int8_t* xperm, const float* xsum, int i0,
                                     int i1) {
  const int K = p.K, gs = p.group_size, G = K / gs, B = K / 32, bpg = gs / 32;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), bias8 = _mm256_set1_epi8(char(0x80));
  float sd[4096 / 32 + 8];  // per-block s*d of the current row (K <= 4096 here; larger K: chunks below)
  for (int i = i0; i < i1; ++i) {
    const int64_t r = row_of(p, i);
    for (int m = 0; m < p.M; ++m) {
      if (bad_row(p, r)) { store_out_simd(p.out, p.out_dtype, int64_t(m) * p.n + i, kNaN); continue; }
      const uint8_t* next = PF && m == 0 ? prefetch_next_row(p, i + 1, i1, 0, G) : nullptr;
      const uint8_t* wr = p.w + r * p.w_row_bytes;
      const int64_t sb = r * p.sb_row;
      const float* xd = xa.xd + int64_t(m) * B;
      const int8_t* xq = xa.xq + int64_t(m) * K;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      float tail = 0.f;
      // Blocks are handled in spans of at most 4096 elements so sd stays on the stack.
      for (int64_t k0 = 0; k0 < K; k0 += 4096) {
        const int64_t k1 = std::min<int64_t>(K, k0 + 4096);
        const int b0 = int(k0 / 32), nb = int((k1 - k0) / 32);
        int b = 0;
        if (bpg == 1) {
          for (; b + 8 <= nb; b += 8)
            _mm256_storeu_ps(sd + b, _mm256_mul_ps(load8s<ST>(p.scales, sb + b0 + b), _mm256_loadu_ps(xd + b0 + b)));
        } else if (bpg == 2 || bpg == 4) {  // 8 blocks take 8 / bpg scales, each repeated bpg times
          const __m256i rep = bpg == 2 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3) : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
          for (; b + 8 <= nb && (b0 + b) / bpg + 8 <= p.K / gs; b += 8)
            _mm256_storeu_ps(sd + b, _mm256_mul_ps(_mm256_permutevar8x32_ps(load8s<ST>(p.scales, sb + (b0 + b) / bpg), rep),
                                                   _mm256_loadu_ps(xd + b0 + b)));
        }
        for (; b < nb; ++b) sd[b] = ldv<ST>(p.scales, sb + (b0 + b) / bpg) * xd[b0 + b];
        if constexpr (Q4) {
          const int8_t* xp = xperm + int64_t(m) * K;
          int64_t k = k0;
          for (; k + 64 <= k1; k += 64) {
            prefetch_line<PF>(next, k / 2);
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k / 2));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + k));
            const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + k + 32));
            const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xe), ones),
                                                 _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xo), ones));
            const float* sc = sd + (k - k0) / 32;
            const __m256 scv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sc)), _mm_broadcast_ss(sc + 1), 1);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scv, acc0);
            std::swap(acc0, acc1);
          }
          if (k < k1)  // a last lone 32-block
            tail += sd[(k - k0) / 32] * float(q_block_dot(wr, k, xq, true));
        } else {
          for (int64_t k = k0; k < k1; k += 32) {
            prefetch_line<PF>(next, k);
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k)), bias8);
            const __m256i x8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
            const __m256i s32 =
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x8, q)), ones);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_broadcast_ss(sd + (k - k0) / 32), acc0);
            std::swap(acc0, acc1);
          }
        }
      }
      const float bacc = row_bias_dot<ST, Q4>(p, sb, xsum + int64_t(m) * G, G);
      store_out_simd(p.out, p.out_dtype, int64_t(m) * p.n + i, hsum(_mm256_add_ps(acc0, acc1)) + tail + bacc);
    }
  }
}
#endif  // FLASH_X86

void load_floats(const void* base, int dtype, int64_t n, float* dst) {
  if (dtype == DT_F32) {
    std::memcpy(dst, base, size_t(n) * 4);
    return;
  }
#if FLASH_X86
  if (simd_active()) {
    const uint16_t* src = static_cast<const uint16_t*>(base);
    return dtype == DT_F16 ? load_floats_avx2<false>(src, n, dst) : load_floats_avx2<true>(src, n, dst);
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = load_scalar(base, dtype, i);
}

void dot_tiles(const float* x, int M, const float* w, int n, int K, float* out, int ld) {
#if FLASH_X86
  if (simd_active() && K % 8 == 0) return dot_tiles_avx2(x, M, w, n, K, out, ld);
#endif
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < n; ++i) {
      float t = 0.f;
      for (int k = 0; k < K; ++k) t += x[int64_t(m) * K + k] * w[int64_t(i) * K + k];
      out[int64_t(m) * ld + i] = t;
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch
namespace {

struct FwdCtx {
  const Problem* p;
  const float* x;     // prepared x
  const float* xsum;  // quantized only
  bool simd;
  int rows_per_chunk;
  Q8X q8{nullptr, nullptr};         // q8_activations only
  const int8_t* xperm = nullptr;    // q8_activations, 4-bit SIMD: xq arranged per 64-chunk
  bool tiles = false;               // several x rows: fwd_tiles (exact float, also with q8_activations)
};

// f(A, B) with two run-time flags as std::bool_constant arguments, so each kernel variant is one
// template instance (e.g. 4-bit or not x gathered rows or not) picked at a single call site.
template <class F>
void with_flags(bool a, bool b, F&& f) {
  if (a) b ? f(std::true_type{}, std::true_type{}) : f(std::true_type{}, std::false_type{});
  else b ? f(std::false_type{}, std::true_type{}) : f(std::false_type{}, std::false_type{});
}

template <int ST>
void q_fwd_range(const FwdCtx& c, int i0, int i1) {
#if FLASH_X86
  if (c.tiles) {
    with_flags(c.p->fmt == FMT_Q4, false, [&](auto q4, auto) {
      fwd_tiles(*c.p, c.x, i0, i1, [&](int64_t r, float* dst) { panel_row_q<ST, decltype(q4)::value>(*c.p, r, dst); });
    });
    return;
  }
#endif
  if (c.q8.xq) {
#if FLASH_X86
    if (c.simd) {
      with_flags(c.p->fmt == FMT_Q4, c.p->rows != nullptr, [&](auto q4, auto pf) {
        q_fwd_i8_avx2<ST, decltype(q4)::value, decltype(pf)::value>(*c.p, c.q8, c.xperm, c.xsum, i0, i1);
      });
      return;
    }
#endif
    q_fwd_i8_scalar<ST>(*c.p, c.q8, c.xsum, i0, i1);
    return;
  }
#if FLASH_X86
  if (c.simd) {
    with_flags(c.p->fmt == FMT_Q4, c.p->rows != nullptr, [&](auto q4, auto pf) {
      q_fwd_avx2_groups<ST, decltype(q4)::value, decltype(pf)::value>(*c.p, c.x, c.xsum, i0, i1);
    });
    return;
  }
#endif
  q_fwd_scalar<ST>(*c.p, c.x, c.xsum, i0, i1);
}

void fwd_rows(const FwdCtx& c, int i0, int i1) {
  const Problem& p = *c.p;
  if (i0 >= i1) return;
  if (p.fmt == FMT_Q4 || p.fmt == FMT_Q8) {
    switch (p.sb_dtype) {
      case DT_F16: q_fwd_range<DT_F16>(c, i0, i1); break;
      case DT_BF16: q_fwd_range<DT_BF16>(c, i0, i1); break;
      default: q_fwd_range<DT_F32>(c, i0, i1);
    }
    return;
  }
  const bool bf = p.fmt == FMT_BF16;
#if FLASH_X86
  if (c.tiles) {
    if (bf) fwd_tiles(p, c.x, i0, i1, [&](int64_t r, float* dst) { panel_row_h<true>(p, r, dst); });
    else fwd_tiles(p, c.x, i0, i1, [&](int64_t r, float* dst) { panel_row_h<false>(p, r, dst); });
    return;
  }
  if (c.simd) {
    with_flags(bf, p.rows != nullptr, [&](auto is_bf, auto pf) {
      h_fwd_avx2_rows<decltype(is_bf)::value, decltype(pf)::value>(p, c.x, i0, i1);
    });
    return;
  }
#endif
  if (bf) h_fwd_scalar<DT_BF16>(p, c.x, i0, i1);
  else h_fwd_scalar<DT_F16>(p, c.x, i0, i1);
}

struct TCtx {
  const Problem* p;
  bool simd;
  int cols_per_chunk;
};

thread_local std::vector<float> tl_acc;

template <int ST>
void q_t_range(const TCtx& c, int k0, int k1, float* acc) {
#if FLASH_X86
  if (c.simd) {
    with_flags(c.p->fmt == FMT_Q4, c.p->rows != nullptr, [&](auto q4, auto pf) {
      q_t_avx2<ST, decltype(q4)::value, decltype(pf)::value>(*c.p, k0, k1, acc);
    });
    return;
  }
#endif
  q_t_scalar<ST>(*c.p, k0, k1, acc);
}

void t_chunk(const void* vctx, int chunk) {
  const TCtx& c = *static_cast<const TCtx*>(vctx);
  const Problem& p = *c.p;
  int k0 = chunk * c.cols_per_chunk, k1 = std::min(p.K, k0 + c.cols_per_chunk);
  if (k0 >= k1) return;
  float* acc = scratch(tl_acc, size_t(p.M) * (k1 - k0 + (k1 - k0) / std::max(1, p.group_size) + 1));
  if (p.fmt == FMT_Q4 || p.fmt == FMT_Q8) {
    switch (p.sb_dtype) {
      case DT_F16: q_t_range<DT_F16>(c, k0, k1, acc); break;
      case DT_BF16: q_t_range<DT_BF16>(c, k0, k1, acc); break;
      default: q_t_range<DT_F32>(c, k0, k1, acc);
    }
    return;
  }
  const bool bf = p.fmt == FMT_BF16;
#if FLASH_X86
  if (c.simd) {
    if (bf) h_t_avx2<true>(p, k0, k1, acc);
    else h_t_avx2<false>(p, k0, k1, acc);
    return;
  }
#endif
  if (bf) h_t_scalar<DT_BF16>(p, k0, k1, acc);
  else h_t_scalar<DT_F16>(p, k0, k1, acc);
}

// Below ~64 KiB of weights a second thread costs more than it saves; above, chunks of ~128 KiB
// (at least 2 per thread) balance the load between threads that may be descheduled.
int chunks_for(int64_t weight_bytes, int units) {
  const int t = std::min(num_threads(), pool().size());
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
};
thread_local XScratch tl_xs[kMaxProblems];

// x [M, K] -> int8 per 32-block (round half to even of x / d, d = max|x| / 127), the block scales
// xd and the blocks' integer sums qsum.
void quantize_x_scalar(const float* in, int64_t blocks, int8_t* xq, float* xd, int32_t* qsum) {
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

#if FLASH_X86
// The same with AVX2: cvtps_epi32 rounds half to even (the default MXCSR mode), as nearbyint does.
FLASH_AVX2 void quantize_x_avx2(const float* in, int64_t blocks, int8_t* xq, float* xd, int32_t* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = in + b * 32;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h), d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    xd[b] = d;
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    qsum[b] = _mm_cvtsi128_si32(s);
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * 32), _mm256_permutevar8x32_epi32(p16, order));
  }
}
#endif

void quantize_x(const Problem& p, bool simd, int8_t* xq, float* xd, int32_t* qsum) {
  const int64_t blocks = int64_t(p.M) * p.K / 32;
#if FLASH_X86
  if (simd) return quantize_x_avx2(p.in, blocks, xq, xd, qsum);
#endif
  quantize_x_scalar(p.in, blocks, xq, xd, qsum);
}

}  // namespace

void parallel_for(int chunks, ChunkFn fn, const void* ctx) {
  if (chunks > 0) pool().run(fn, ctx, chunks);
}

namespace {

// x reordered to the nibble order the 4-bit SIMD loops consume (load32).
const float* q4_permuted_x(const Problem& p, XScratch& xs) {
  float* xp = scratch(xs.x, size_t(p.M) * p.K);
  for (int64_t b = 0; b < int64_t(p.M) * p.K; b += 32)
    for (int j = 0; j < 32; ++j) xp[b + j] = p.in[b + q4_natural(j)];
  return xp;
}

// x of problem p prepared as its forward kernel consumes it (group sums; 4-bit SIMD: nibble order;
// int8 activations: rounded blocks; tiles: only the nibble order), in the scratch set xs. Several x
// rows (kTileMinRows or more, a prompt) stay exact float even with q8_activations, on every path:
// there the SIMD tiles share one weight conversion among many rows, so int8 would buy nothing.
FwdCtx prepare(const Problem& p, XScratch& xs, bool simd) {
  const bool quant = p.fmt == FMT_Q4 || p.fmt == FMT_Q8;
  FwdCtx c{&p, p.in, nullptr, simd, 0};
  c.tiles = simd && p.M >= kTileMinRows && p.K % 8 == 0;
  const bool q8 = p.q8_activations && p.M < kTileMinRows;
  if (quant && c.tiles) {
    if (p.fmt == FMT_Q4) c.x = q4_permuted_x(p, xs);
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
    c.xsum = xsum;
    if (q8) {
      int8_t* xq = reinterpret_cast<int8_t*>(scratch_bytes(xs.xq, size_t(p.M) * p.K));
      float* xd = scratch(xs.xd, size_t(p.M) * p.K / 32);
      int32_t* qsum = reinterpret_cast<int32_t*>(scratch(xs.qsum, size_t(p.M) * p.K / 32));
      quantize_x(p, simd, xq, xd, qsum);
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
      c.q8 = Q8X{xq, xd};
      if (simd && p.fmt == FMT_Q4) {  // per 64-chunk: even elements of both blocks, then the odd ones
        int8_t* xp = reinterpret_cast<int8_t*>(scratch_bytes(xs.xperm, size_t(p.M) * p.K));
        for (int64_t base = 0; base < int64_t(p.M) * p.K; base += p.K)
          for (int64_t k = 0; k + 64 <= p.K; k += 64)
            for (int j = 0; j < 32; ++j) {
              const int64_t blk = base + k + (j / 16) * 32, e = 2 * (j % 16);
              xp[base + k + j] = xq[blk + e];
              xp[base + k + 32 + j] = xq[blk + e + 1];
            }
        c.xperm = xp;
      }
    } else if (simd && p.fmt == FMT_Q4) {
      c.x = q4_permuted_x(p, xs);
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
  const bool simd = simd_active();
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
      m.fwd[m.count++] = prepare(ps[j], tl_xs[j], simd);
    }
    bytes += bytes_per_row(ps[j]) * ps[j].n;
  }
  if (m.count == 0) return;
  if (epilogue) {
    m.n = ps[0].n;
    if (m.n == 0) return;
    const int chunks = chunks_for(bytes, m.n);
    m.rows_per_chunk = (m.n + chunks - 1) / chunks;
    pool().run(paired_chunk, &m, (m.n + m.rows_per_chunk - 1) / m.rows_per_chunk);
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
  pool().run(split_chunk, &m, m.first_chunk[m.count]);
}

void matvec(const Problem& p) { matvec_many(&p, 1); }

void matvec_t(const Problem& p) {
  if (p.K == 0 || p.M == 0) return;
  const bool quant = p.fmt == FMT_Q4 || p.fmt == FMT_Q8;
  TCtx c{&p, simd_active(), 0};
  // Column ranges are whole groups (quantized) or multiples of 16 (half) so SIMD loops stay aligned.
  const int unit = quant ? std::max(32, p.group_size) : 16;
  const int units = (p.K + unit - 1) / unit;
  // One column range per thread: finer splits would make every chunk stride over all rows.
  int chunks = std::min(chunks_for(bytes_per_row(p) * std::max(p.n, 1), units), std::min(num_threads(), pool().size()));
  c.cols_per_chunk = ((units + chunks - 1) / chunks) * unit;
  pool().run(t_chunk, &c, chunks);
}

}  // namespace flash
