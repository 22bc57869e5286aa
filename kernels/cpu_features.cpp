// CPU feature detection and the run-time ISA choice (see cpu_features.h).

#include "cpu_features.h"

#include <atomic>
#include <stdexcept>

namespace flash {

namespace {

bool cpu_has_avx2() {
#if FLASH_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if FLASH_X86
  static const bool ok = cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("vpclmulqdq");
  return ok;
#else
  return false;
#endif
}

std::atomic<int>& isa_state() {
  static std::atomic<int> state{int(best_isa())};
  return state;
}

}  // namespace

const char* isa_name(Isa isa) { return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "scalar"; }

Isa best_isa() { return cpu_has_avx512() ? Isa::avx512 : cpu_has_avx2() ? Isa::avx2 : Isa::scalar; }

namespace {
std::atomic<bool> vnni_allowed{true};
}  // namespace

void set_vnni_allowed(bool allowed) { vnni_allowed.store(allowed, std::memory_order_relaxed); }

bool has_avx512_vnni() {
#if FLASH_X86
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok && vnni_allowed.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

Isa active_isa() { return Isa(isa_state().load(std::memory_order_relaxed)); }

void set_isa(Isa isa) {
  if (int(isa) > int(best_isa()))
    throw std::invalid_argument(std::string("mlx_flash: this CPU cannot run the ") + isa_name(isa) + " kernels");
  isa_state().store(int(isa));
}

Isa parse_isa(const std::string& name) {
  if (name == "scalar") return Isa::scalar;
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512") return Isa::avx512;
  throw std::invalid_argument("mlx_flash: unknown instruction set '" + name + "' (scalar, avx2, avx512)");
}

std::vector<std::string> cpu_features() {
  std::vector<std::string> out;
#if FLASH_X86
  if (__builtin_cpu_supports("avx2")) out.push_back("avx2");
  if (__builtin_cpu_supports("fma")) out.push_back("fma");
  if (__builtin_cpu_supports("f16c")) out.push_back("f16c");
  if (__builtin_cpu_supports("avx512f")) out.push_back("avx512f");
  if (__builtin_cpu_supports("avx512bw")) out.push_back("avx512bw");
  if (__builtin_cpu_supports("avx512vl")) out.push_back("avx512vl");
  if (__builtin_cpu_supports("avx512vbmi2")) out.push_back("avx512vbmi2");
  if (__builtin_cpu_supports("vpclmulqdq")) out.push_back("vpclmulqdq");
  if (__builtin_cpu_supports("avx512vnni")) out.push_back("avx512vnni");
#endif
  return out;
}

void set_simd_enabled(bool enabled) { isa_state().store(int(enabled ? best_isa() : Isa::scalar)); }

bool simd_active() { return active_isa() != Isa::scalar; }

}  // namespace flash
