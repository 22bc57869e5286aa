// The subset of the Metal Shading Language our kernels use, as C++17 for g++ (the Linux emulator,
// mlx_flash/metal/emulator.py). It stands where MLX's Metal prelude (metal::utils()) stands: the
// kernel text MLX generates follows it unchanged. Address spaces are no-ops (the emulator rewrites
// `threadgroup` arrays to statics shared by the threads of a threadgroup); SIMD-group functions and
// barriers suspend the calling thread (a fiber) until its SIMD group / threadgroup arrives
// (kernels/metal/emu_runtime.h).
#pragma once
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <type_traits>
#include <sys/mman.h>
#include <sys/wait.h>
#include <ucontext.h>
#include <unistd.h>

#define device
#define constant
#define thread
#define threadgroup
#define ray_data
#define object_data
#define METAL_FUNC inline
#define MLX_MTL_CONST static constexpr const
#define MLX_MTL_PRAGMA_UNROLL

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;
typedef _Float16 float16_t;

// bfloat16: the top 16 bits of a float, rounded to nearest even (as MLX converts)
struct bfloat16_t {
  uint16_t bits_;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits_ = uint16_t((u >> 16) | 0x40u);  // quiet NaN
    } else {
      bits_ = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  template <class U, class = std::enable_if_t<std::is_arithmetic<U>::value || std::is_same<U, _Float16>::value>>
  bfloat16_t(U v) : bfloat16_t(float(v)) {}
  operator float() const {
    uint32_t u = uint32_t(bits_) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  bfloat16_t& operator+=(float o) { return *this = bfloat16_t(float(*this) + o); }
  bfloat16_t& operator-=(float o) { return *this = bfloat16_t(float(*this) - o); }
  bfloat16_t& operator*=(float o) { return *this = bfloat16_t(float(*this) * o); }
  bfloat16_t& operator/=(float o) { return *this = bfloat16_t(float(*this) / o); }
};
typedef bfloat16_t bfloat;

namespace emu {
template <class T>
struct is_num : std::integral_constant<bool, std::is_arithmetic<T>::value || std::is_same<T, _Float16>::value ||
                                                 std::is_same<T, bfloat16_t>::value> {};
}  // namespace emu

// ---- vector types -------------------------------------------------------------------------------
template <class T, int N>
struct vec;
#define EMU_VEC_COMMON(N)                                                                  \
  vec() = default;                                                                         \
  vec(T s) { for (int i = 0; i < N; i++) v[i] = s; }                                       \
  template <class U, class = std::enable_if_t<emu::is_num<U>::value && !std::is_same<U, T>::value>> \
  vec(U s) : vec(T(s)) {}                                                                  \
  template <class U>                                                                       \
  explicit vec(const vec<U, N>& o) { for (int i = 0; i < N; i++) v[i] = T(o.v[i]); }       \
  T& operator[](int i) { return v[i]; }                                                    \
  const T& operator[](int i) const { return v[i]; }
template <class T>
struct vec<T, 2> {
  union { struct { T x, y; }; T v[2]; };
  EMU_VEC_COMMON(2)
  vec(T a, T b) { x = a; y = b; }
};
template <class T>
struct vec<T, 3> {
  union { struct { T x, y, z; }; T v[3]; T pad_[4]; };  // Metal's 3-vectors take 4 slots
  EMU_VEC_COMMON(3)
  vec(T a, T b, T c) { x = a; y = b; z = c; }
};
template <class T>
struct vec<T, 4> {
  union { struct { T x, y, z, w; }; T v[4]; };
  EMU_VEC_COMMON(4)
  vec(T a, T b, T c, T d) { x = a; y = b; z = c; w = d; }
  vec(vec<T, 2> a, vec<T, 2> b) { x = a.x; y = a.y; z = b.x; w = b.y; }
};
#define EMU_VEC_BINOP(op)                                                                          \
  template <class T, int N> vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {              \
    for (int i = 0; i < N; i++) a.v[i] = a.v[i] op b.v[i];                                         \
    return a;                                                                                      \
  }                                                                                                \
  template <class T, int N, class S, class = std::enable_if_t<emu::is_num<S>::value>>              \
  vec<T, N> operator op(vec<T, N> a, S s) {                                                        \
    for (int i = 0; i < N; i++) a.v[i] = a.v[i] op T(s);                                           \
    return a;                                                                                      \
  }                                                                                                \
  template <class T, int N, class S, class = std::enable_if_t<emu::is_num<S>::value>>              \
  vec<T, N> operator op(S s, vec<T, N> a) {                                                        \
    for (int i = 0; i < N; i++) a.v[i] = T(s) op a.v[i];                                           \
    return a;                                                                                      \
  }                                                                                                \
  template <class T, int N, class B> vec<T, N>& operator op##=(vec<T, N>& a, const B& b) {        \
    return a = a op b;                                                                             \
  }
EMU_VEC_BINOP(+)
EMU_VEC_BINOP(-)
EMU_VEC_BINOP(*)
EMU_VEC_BINOP(/)
EMU_VEC_BINOP(&)
EMU_VEC_BINOP(|)
EMU_VEC_BINOP(^)
EMU_VEC_BINOP(<<)
EMU_VEC_BINOP(>>)
template <class T, int N>
vec<T, N> operator-(vec<T, N> a) {
  for (int i = 0; i < N; i++) a.v[i] = -a.v[i];
  return a;
}
#define EMU_VEC_TYPES(T, name) \
  typedef vec<T, 2> name##2;   \
  typedef vec<T, 3> name##3;   \
  typedef vec<T, 4> name##4;
EMU_VEC_TYPES(float, float)
EMU_VEC_TYPES(_Float16, half)
EMU_VEC_TYPES(bfloat16_t, bfloat)
EMU_VEC_TYPES(int, int)
EMU_VEC_TYPES(uint, uint)
EMU_VEC_TYPES(short, short)
EMU_VEC_TYPES(ushort, ushort)
EMU_VEC_TYPES(char, char)
EMU_VEC_TYPES(uchar, uchar)
EMU_VEC_TYPES(bool, bool)

namespace metal {

// ---- math (scalars through float, vectors elementwise) -------------------------------------------
namespace emu_math {
#define EMU_UNARY(name, expr)                                                                 \
  template <class T, class = std::enable_if_t<emu::is_num<T>::value>>                        \
  inline T name(T a) {                                                                        \
    float x = float(a);                                                                       \
    return T(expr);                                                                           \
  }                                                                                           \
  template <class T, int N>                                                                   \
  inline vec<T, N> name(vec<T, N> a) {                                                        \
    for (int i = 0; i < N; i++) a.v[i] = name(a.v[i]);                                        \
    return a;                                                                                 \
  }
EMU_UNARY(exp, std::exp(x))
EMU_UNARY(exp2, std::exp2(x))
EMU_UNARY(log, std::log(x))
EMU_UNARY(log2, std::log2(x))
EMU_UNARY(sqrt, std::sqrt(x))
EMU_UNARY(rsqrt, 1.0f / std::sqrt(x))
EMU_UNARY(tanh, std::tanh(x))
EMU_UNARY(sin, std::sin(x))
EMU_UNARY(cos, std::cos(x))
EMU_UNARY(erf, std::erf(x))
EMU_UNARY(floor, std::floor(x))
EMU_UNARY(ceil, std::ceil(x))
EMU_UNARY(round, std::round(x))
EMU_UNARY(trunc, std::trunc(x))
EMU_UNARY(fabs, std::fabs(x))
EMU_UNARY(precise_abs_, std::fabs(x))
template <class T, class = std::enable_if_t<emu::is_num<T>::value>>
inline T abs(T a) { return a < T(0) ? T(-a) : a; }
template <class T, int N>
inline vec<T, N> abs(vec<T, N> a) {
  for (int i = 0; i < N; i++) a.v[i] = abs(a.v[i]);
  return a;
}
template <class T> inline T max(T a, T b) { return a > b ? a : b; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T fmax(T a, T b) { return T(std::fmax(float(a), float(b))); }
template <class T> inline T fmin(T a, T b) { return T(std::fmin(float(a), float(b))); }
template <class T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T> inline T fma(T a, T b, T c) { return T(float(a) * float(b) + float(c)); }
template <class T> inline T pow(T a, T b) { return T(std::pow(float(a), float(b))); }
template <class T> inline bool isnan(T a) { return std::isnan(float(a)); }
template <class T> inline bool isinf(T a) { return std::isinf(float(a)); }
// integer functions: popcount (set bits), ctz (trailing zeros; the bit width for 0, as MSL says)
template <class T, class = std::enable_if_t<std::is_integral<T>::value>>
inline T popcount(T a) { return T(__builtin_popcountll(static_cast<unsigned long long>(std::make_unsigned_t<T>(a)))); }
template <class T, class = std::enable_if_t<std::is_integral<T>::value>>
inline T ctz(T a) {
  auto u = static_cast<unsigned long long>(std::make_unsigned_t<T>(a));
  return u ? T(__builtin_ctzll(u)) : T(8 * sizeof(T));
}
template <class T, int N>
inline T dot(vec<T, N> a, vec<T, N> b) {
  T s = T(0);
  for (int i = 0; i < N; i++) s += a.v[i] * b.v[i];
  return s;
}
}  // namespace emu_math
using namespace emu_math;
namespace fast { using namespace emu_math; }
namespace precise { using namespace emu_math; }

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<_Float16> {
  static constexpr _Float16 max() { return _Float16(65504.0f); }
  static constexpr _Float16 lowest() { return _Float16(-65504.0f); }
  static constexpr _Float16 infinity() { return _Float16(__builtin_inff()); }
};

template <class T, class U>
inline T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}

// ---- atomics (fibers are cooperative: plain read-modify-writes are atomic) ------------------------
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel,
                    memory_order_seq_cst };
template <class T>
struct atomic {
  T value_;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <class T, class U> inline T atomic_fetch_add_explicit(atomic<T>* a, U v, memory_order) {
  T old = a->value_; a->value_ = T(old + T(v)); return old;
}
template <class T, class U> inline T atomic_fetch_sub_explicit(atomic<T>* a, U v, memory_order) {
  T old = a->value_; a->value_ = T(old - T(v)); return old;
}
template <class T, class U> inline T atomic_fetch_max_explicit(atomic<T>* a, U v, memory_order) {
  T old = a->value_; a->value_ = old > T(v) ? old : T(v); return old;
}
template <class T, class U> inline T atomic_fetch_min_explicit(atomic<T>* a, U v, memory_order) {
  T old = a->value_; a->value_ = old < T(v) ? old : T(v); return old;
}
template <class T, class U> inline T atomic_fetch_or_explicit(atomic<T>* a, U v, memory_order) {
  T old = a->value_; a->value_ = old | T(v); return old;
}
template <class T, class U> inline T atomic_fetch_and_explicit(atomic<T>* a, U v, memory_order) {
  T old = a->value_; a->value_ = old & T(v); return old;
}
template <class T, class U> inline T atomic_exchange_explicit(atomic<T>* a, U v, memory_order) {
  T old = a->value_; a->value_ = T(v); return old;
}
template <class T, class U> inline void atomic_store_explicit(atomic<T>* a, U v, memory_order) { a->value_ = T(v); }
template <class T> inline T atomic_load_explicit(const atomic<T>* a, memory_order) { return a->value_; }
template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* a, T* expected, U desired, memory_order, memory_order) {
  if (a->value_ == *expected) { a->value_ = T(desired); return true; }
  *expected = a->value_;
  return false;
}

// ---- barriers and SIMD-group functions (suspend the calling fiber: emu_runtime.h) ------------------
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
}  // namespace metal
using namespace metal;

namespace emu {
// A call site: (file, line) of the MSL call, from __builtin_FILE/__builtin_LINE at the call.
struct Site {
  const char* file;
  int line;
};
enum SimdOp { OP_SIMD_BARRIER, OP_SUM, OP_PRODUCT, OP_MAX, OP_MIN, OP_AND, OP_OR, OP_XOR, OP_ALL, OP_ANY,
              OP_BROADCAST, OP_BROADCAST_FIRST, OP_SHUFFLE, OP_SHUFFLE_DOWN, OP_SHUFFLE_UP, OP_SHUFFLE_XOR,
              OP_ROTATE_DOWN, OP_ROTATE_UP, OP_PREFIX_EXCL_SUM, OP_PREFIX_INCL_SUM, OP_BALLOT, OP_COUNT };
struct ThreadAttrs {
  uint dispatch_quadgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup;
  uint3 dispatch_threads_per_threadgroup, grid_origin, grid_size;
  uint quadgroup_index_in_threadgroup, quadgroups_per_threadgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, thread_execution_width, thread_index_in_quadgroup, thread_index_in_simdgroup,
      thread_index_in_threadgroup;
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
      threadgroups_per_grid, threads_per_grid;
  uint threads_per_simdgroup;
  uint3 threads_per_threadgroup;
};
constexpr int SLOT_BYTES = 64;
// What a SIMD-group exchange returns to each lane: every active lane's posted value and argument.
struct Exchange {
  const unsigned char (*values)[SLOT_BYTES];
  const int* args;
  uint32_t active;  // bit i: lane i took part
  int lane;
};
Exchange simd_exchange(int op, const void* value, int size, int arg, Site site);
// A threadgroup array (a static in the emulated kernel): filled with all-ones bytes when first
// reached and before every later threadgroup (emu_runtime.h), as threadgroup memory starts undefined.
void register_shared(void* data, size_t bytes);
struct SharedMemory {
  SharedMemory(void* data, size_t bytes) { register_shared(data, bytes); }
};
void threadgroup_wait(Site site);
template <class T>
inline T lane_value(const Exchange& e, int lane) {
  T t;
  std::memcpy(&t, e.values[lane], sizeof(T));
  return t;
}
template <class T>
inline Exchange post(int op, const T& v, int arg, Site site) {
  static_assert(sizeof(T) <= SLOT_BYTES, "SIMD-group value too large for the emulator");
  return simd_exchange(op, &v, sizeof(T), arg, site);
}
template <class T, class F>
inline T fold(const Exchange& e, F f) {
  bool first = true;
  T acc{};
  for (int i = 0; i < 32; i++) {
    if (!(e.active >> i & 1u)) continue;
    T v = lane_value<T>(e, i);
    acc = first ? v : f(acc, v);
    first = false;
  }
  return acc;
}
}  // namespace emu

#define EMU_SITE const char* site_file = __builtin_FILE(), int site_line = __builtin_LINE()
#define EMU_AT emu::Site{site_file, site_line}
namespace metal {
inline void threadgroup_barrier(mem_flags, EMU_SITE) { emu::threadgroup_wait(EMU_AT); }
inline void simdgroup_barrier(mem_flags, EMU_SITE) {
  int z = 0;
  emu::post(emu::OP_SIMD_BARRIER, z, 0, EMU_AT);
}
template <class T> inline T simd_sum(T v, EMU_SITE) {
  return emu::fold<T>(emu::post(emu::OP_SUM, v, 0, EMU_AT), [](T a, T b) { return T(a + b); });
}
template <class T> inline T simd_product(T v, EMU_SITE) {
  return emu::fold<T>(emu::post(emu::OP_PRODUCT, v, 0, EMU_AT), [](T a, T b) { return T(a * b); });
}
template <class T> inline T simd_max(T v, EMU_SITE) {
  return emu::fold<T>(emu::post(emu::OP_MAX, v, 0, EMU_AT), [](T a, T b) { return max(a, b); });
}
template <class T> inline T simd_min(T v, EMU_SITE) {
  return emu::fold<T>(emu::post(emu::OP_MIN, v, 0, EMU_AT), [](T a, T b) { return min(a, b); });
}
template <class T> inline T simd_and(T v, EMU_SITE) {
  return emu::fold<T>(emu::post(emu::OP_AND, v, 0, EMU_AT), [](T a, T b) { return T(a & b); });
}
template <class T> inline T simd_or(T v, EMU_SITE) {
  return emu::fold<T>(emu::post(emu::OP_OR, v, 0, EMU_AT), [](T a, T b) { return T(a | b); });
}
template <class T> inline T simd_xor(T v, EMU_SITE) {
  return emu::fold<T>(emu::post(emu::OP_XOR, v, 0, EMU_AT), [](T a, T b) { return T(a ^ b); });
}
inline bool simd_all(bool v, EMU_SITE) {
  return emu::fold<bool>(emu::post(emu::OP_ALL, v, 0, EMU_AT), [](bool a, bool b) { return a && b; });
}
inline bool simd_any(bool v, EMU_SITE) {
  return emu::fold<bool>(emu::post(emu::OP_ANY, v, 0, EMU_AT), [](bool a, bool b) { return a || b; });
}
template <class T> inline T simd_broadcast(T v, ushort lane, EMU_SITE) {
  return emu::lane_value<T>(emu::post(emu::OP_BROADCAST, v, lane, EMU_AT), lane & 31);
}
template <class T> inline T simd_broadcast_first(T v, EMU_SITE) {
  emu::Exchange e = emu::post(emu::OP_BROADCAST_FIRST, v, 0, EMU_AT);
  return emu::lane_value<T>(e, __builtin_ctz(e.active));
}
template <class T> inline T simd_shuffle(T v, ushort lane, EMU_SITE) {
  return emu::lane_value<T>(emu::post(emu::OP_SHUFFLE, v, lane, EMU_AT), lane & 31);
}
// lanes whose source lane is past the SIMD group keep their own value
template <class T> inline T simd_shuffle_down(T v, ushort delta, EMU_SITE) {
  emu::Exchange e = emu::post(emu::OP_SHUFFLE_DOWN, v, delta, EMU_AT);
  return e.lane + delta < 32 ? emu::lane_value<T>(e, e.lane + delta) : v;
}
template <class T> inline T simd_shuffle_up(T v, ushort delta, EMU_SITE) {
  emu::Exchange e = emu::post(emu::OP_SHUFFLE_UP, v, delta, EMU_AT);
  return e.lane >= delta ? emu::lane_value<T>(e, e.lane - delta) : v;
}
template <class T> inline T simd_shuffle_xor(T v, ushort mask, EMU_SITE) {
  emu::Exchange e = emu::post(emu::OP_SHUFFLE_XOR, v, mask, EMU_AT);
  return emu::lane_value<T>(e, (e.lane ^ mask) & 31);
}
template <class T> inline T simd_shuffle_rotate_down(T v, ushort delta, EMU_SITE) {
  emu::Exchange e = emu::post(emu::OP_ROTATE_DOWN, v, delta, EMU_AT);
  return emu::lane_value<T>(e, (e.lane + delta) & 31);
}
template <class T> inline T simd_shuffle_rotate_up(T v, ushort delta, EMU_SITE) {
  emu::Exchange e = emu::post(emu::OP_ROTATE_UP, v, delta, EMU_AT);
  return emu::lane_value<T>(e, (e.lane - delta) & 31);
}
template <class T> inline T simd_prefix_exclusive_sum(T v, EMU_SITE) {
  emu::Exchange e = emu::post(emu::OP_PREFIX_EXCL_SUM, v, 0, EMU_AT);
  T s = T(0);
  for (int i = 0; i < e.lane; i++)
    if (e.active >> i & 1u) s = T(s + emu::lane_value<T>(e, i));
  return s;
}
template <class T> inline T simd_prefix_inclusive_sum(T v, EMU_SITE) {
  emu::Exchange e = emu::post(emu::OP_PREFIX_INCL_SUM, v, 0, EMU_AT);
  T s = T(0);
  for (int i = 0; i <= e.lane; i++)
    if (e.active >> i & 1u) s = T(s + emu::lane_value<T>(e, i));
  return s;
}
inline bool simd_is_first(EMU_SITE) {
  emu::Exchange e = emu::post(emu::OP_BROADCAST_FIRST, 0, 0, EMU_AT);
  return e.lane == __builtin_ctz(e.active);
}
}  // namespace metal
