// CPU feature detection and the one run-time choice of instruction set for every kernel.
// Kernels ask active_isa() once per call and run that ISA's functions (same names per ISA, in
// namespaces flash::scalar, flash::avx2 and flash::avx512); nothing else in the kernels tests CPU
// features. ISAs are ordered: a kernel with no avx512 version runs its avx2 one (isa >= avx2).
#pragma once

#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define FLASH_X86 1
// Functions holding AVX2 / FMA / F16C code carry this attribute: the rest of the library stays
// baseline x86-64, so a CPU without AVX2 only ever runs the scalar path.
#define FLASH_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define FLASH_X86 0
#endif

namespace flash {

// Instruction sets with kernels of their own, slowest first; each includes the ones before it.
// avx512 = AVX-512 F/BW/VL + VBMI2 (vpexpandw) + VPCLMULQDQ on top of avx2 (Intel Ice Lake and later, AMD Zen 4).
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa);

// The fastest ISA this CPU runs (detected once).
Isa best_isa();

// The ISA the kernels use: best_isa() unless set_isa() chose another. The C++ reads no environment
// variable: mlx_flash.cpu.ops validates MLX_FLASH_ISA and applies it with set_isa().
Isa active_isa();

// Throws std::invalid_argument when this CPU cannot run isa.
void set_isa(Isa isa);

// Parses "scalar" / "avx2" / "avx512"; throws std::invalid_argument for other names.
Isa parse_isa(const std::string& name);

// AVX512_VNNI (vpdpbusd: u8 x s8 dot products of 4 into int32) on top of avx512, detected once. The
// one feature a kernel tests beside active_isa(): the int8-activation forward runs its avx512 version
// only when this holds (else its avx2 one).
bool has_avx512_vnni();

// Let the kernels use AVX512_VNNI when the CPU has it (true, the default) or act as on an avx512 CPU
// without it (false): how tests run the VNNI-less path on a CPU that has VNNI.
void set_vnni_allowed(bool allowed);

// Names of the detected features the kernels care about (e.g. "avx2", "fma", "f16c", "avx512f",
// "avx512vbmi2", "avx512vnni").
std::vector<std::string> cpu_features();

// The older switch: true = best_isa(), false = scalar.
void set_simd_enabled(bool enabled);
// active_isa() is not the scalar one.
bool simd_active();

}  // namespace flash
