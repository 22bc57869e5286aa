"""Runs `mx.fast.metal_kernel` sources on Linux: a Metal emulator for tests.

`metal_kernel(...)` takes the same arguments as `mx.fast.metal_kernel` and returns a callable taking
the same call arguments (inputs, template, grid, threadgroup, output_shapes, output_dtypes,
init_value) plus the emulator's own (schedule, seed, timeout_s). It builds the exact kernel text MLX
0.32 generates (`kernel_source`: header, template line, input / shape / strides / ndim / output
parameters, the thread attributes the source names, the explicit instantiation), compiles it as
C++17 with g++ after kernels/metal/msl_shim.h (the MSL subset: `half` is `_Float16`, vector types,
`as_type`, metal:: math, atomics, SIMD-group functions, barriers) and runs every thread of each
threadgroup as a fiber (kernels/metal/emu_runtime.h):
  - a SIMD group (32 lanes) is released when all its live lanes wait at the same simd_* call, a
    threadgroup when all its threads wait at the same threadgroup_barrier; lanes that returned do
    not take part (as inactive lanes on the GPU);
  - `schedule` orders the threads of a threadgroup and the threadgroups of the grid: "forward",
    "reverse" or "shuffled" (reshuffled at every release, from `seed`), so a missing barrier or a
    cross-threadgroup race gives order-dependent results;
  - every buffer ends at an inaccessible page and the kernel runs in a forked child: an
    out-of-bounds access, a deadlock, a divergent barrier or SIMD-group call raises
    `KernelFault` naming the buffer, the thread and the line of the kernel text; a kernel running
    longer than `timeout_s` (a hang) is killed and reported the same way;
  - outputs without `init_value` start as all-ones bytes (NaN for floats, -1 for ints), so an
    element the kernel forgets to write shows.
Each (kernel text) compiles once into a shared library cached under `cache_dir()`
($MLX_FLASH_HOME/metal-emulator, else a per-user temporary directory); about 1 s per variant.

Differences from a GPU: inputs are always passed row-contiguous (ensure_row_contiguous=False still
gets contiguous copies and their strides); a thread runs without interruption between two
SIMD-group calls or barriers; floating-point results follow g++'s arithmetic (`half` math is done
in float and rounded), not the GPU's fast-math; threadgroup memory keeps its contents from one
threadgroup to the next.
"""

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

SHIM_DIR = Path(__file__).resolve().parents[2] / "kernels" / "metal"
SCHEDULES = ("forward", "reverse", "shuffled")
CXXFLAGS = ["-std=c++17", "-O1", "-fPIC", "-shared", "-w", "-fno-strict-aliasing"]

# MLX's get_type_string for each dtype (the C type in the generated signature)
TYPE_STRINGS = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float32: "float", mx.float64: "double",
}
# Inputs with fewer elements than this go in the `constant` address space (MLX's rule).
MAX_CONSTANT_ARRAY_SIZE = 8
# Thread attributes MLX declares when the source names them, in MLX's order, with their types.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"), ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
]


class KernelFault(RuntimeError):
    """The emulated kernel went wrong: out-of-bounds access, deadlock, divergent barrier, hang."""


def cache_dir() -> Path:
    """Where compiled kernel variants are kept: $MLX_FLASH_EMULATOR_CACHE, else
    $MLX_FLASH_HOME/metal-emulator, else a per-user directory under the system temp dir."""
    if os.environ.get("MLX_FLASH_EMULATOR_CACHE"):
        return Path(os.environ["MLX_FLASH_EMULATOR_CACHE"])
    if os.environ.get("MLX_FLASH_HOME"):
        return Path(os.environ["MLX_FLASH_HOME"]) / "metal-emulator"
    return Path(tempfile.gettempdir()) / f"mlx_flash-metal-emulator-{os.getuid()}"


def compiler() -> str | None:
    """The C++ compiler the emulator uses ($CXX or g++), or None when there is none."""
    import shutil

    return shutil.which(os.environ.get("CXX", "g++"))


# ------------------------------------------------------------------------------------------------
# The kernel text, as MLX writes it


def _template_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, mx.Dtype):
        return TYPE_STRINGS[value]
    raise TypeError(f"template argument {value!r}: expected an int, a bool or an mlx dtype")


def _template_kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, mx.Dtype):
        return "typename"
    raise TypeError(f"template argument {value!r}: expected an int, a bool or an mlx dtype")


def shape_infos(source: str, input_names) -> list:
    """(uses name_shape, uses name_strides, uses name_ndim) per input, by substring, as MLX does."""
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def attributes(source: str) -> list:
    """Declarations of the thread attributes `source` names (MLX's substring test, MLX's order)."""
    return [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in source]


def kernel_name(name: str, inputs, output_dtypes, template) -> str:
    """MLX's host name of the variant: name, template values, input dtypes (s: scalar, c: constant),
    output dtypes."""
    kname = "custom_kernel_" + name
    if template:
        kname += "_" + "_" + "_".join(_template_value(v) for _, v in template)
    for a in inputs:
        kname += "_" + TYPE_STRINGS[a.dtype]
        if a.ndim == 0:
            kname += "s"
        elif a.size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for dt in output_dtypes:
        kname += "_" + TYPE_STRINGS[dt]
    return kname


def kernel_source(name, input_names, output_names, source, header, atomic_outputs, inputs, output_dtypes,
                  template) -> tuple:
    """(host name, text) of the Metal source MLX 0.32 compiles for this call (without its
    metal::utils() prelude). `inputs` need .dtype, .ndim and .size."""
    kname = kernel_name(name, inputs, output_dtypes, template)
    infos = shape_infos(source, input_names)
    attrs = attributes(source)
    text = header
    if template:
        text += "template <" + ", ".join(f"{_template_kind(v)} {n}" for n, v in template) + ">\n"
    text += f"[[kernel]] void {kname}(\n"
    index = 0
    for n, a, info in zip(input_names, inputs, infos):
        location = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if a.ndim == 0 else "*"
        text += f"  const {location} {TYPE_STRINGS[a.dtype]}{ref} {n} [[buffer({index})]],\n"
        index += 1
        if a.ndim > 0:
            for used, param in zip(info, (f"const constant int* {n}_shape", f"const constant int64_t* {n}_strides",
                                          f"const constant int& {n}_ndim")):
                if used:
                    text += f"  {param} [[buffer({index})]],\n"
                    index += 1
    for n, dt in zip(output_names, output_dtypes):
        t = TYPE_STRINGS[dt]
        text += f"  device {'atomic<' + t + '>' if atomic_outputs else t}* {n} [[buffer({index})]]"
        # MLX's test counts shape/stride buffers in `index`: reproduced as is
        text += ",\n" if index < len(inputs) + len(output_names) - 1 or attrs else ") {\n"
        index += 1
    for i, attr in enumerate(attrs):
        text += attr + (",\n" if i < len(attrs) - 1 else ") {\n")
    text += source + "\n}\n"
    if template:
        tdef = kname + "<" + ", ".join(_template_value(v) for _, v in template) + ">"
        text += (f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n')
    return kname, text


# ------------------------------------------------------------------------------------------------
# Compiling


# `threadgroup T name[...];` declarations become statics: one copy shared by the fibers of the
# threadgroup being run (threadgroups run one after another), registered so that the runtime fills
# it with all-ones bytes (NaN, -1) before each threadgroup: a read before any write shows.
_THREADGROUP_DECL = re.compile(r"\bthreadgroup\s+((?:[\w:]+\s*(?:<[^;{}()]*?>)?\s+)+?)(\w+)\s*((?:\[[^;\]]*\]\s*)*);")


def _emulator_text(text: str) -> str:
    return _THREADGROUP_DECL.sub(
        lambda m: (f"static {m.group(1)}{m.group(2)}{m.group(3)}; "
                   f"static emu::SharedMemory emu_shared_{m.group(2)}(&{m.group(2)}, sizeof({m.group(2)}));"), text)


def _entry(kname, inputs, input_names, output_dtypes, infos, attrs_used, template, atomic_outputs) -> str:
    """emu_thread_entry: calls the kernel with buffer pointers and one thread's attributes."""
    args, b = [], 0
    for a, info in zip(inputs, infos):
        t = TYPE_STRINGS[a.dtype]
        args.append(f"*(const {t}*)b[{b}]" if a.ndim == 0 else f"(const {t}*)b[{b}]")
        b += 1
        if a.ndim > 0:
            for used, t in zip(info, ("const int*", "const int64_t*", None)):
                if used:
                    args.append(f"({t})b[{b}]" if t else f"*(const int*)b[{b}]")
                    b += 1
    for dt in output_dtypes:
        t = TYPE_STRINGS[dt]
        args.append(f"(atomic<{t}>*)b[{b}]" if atomic_outputs else f"({t}*)b[{b}]")
        b += 1
    args += [f"a->{name}" for name in attrs_used]
    fn = kname + ("<" + ", ".join(_template_value(v) for _, v in template) + ">" if template else "")
    return ('extern "C" void emu_thread_entry(void* const* b, const emu::ThreadAttrs* a) {\n  '
            + fn + "(" + ", ".join(args) + ");\n}\n")


_compile_lock = threading.Lock()
_libraries: dict = {}


def _shim_digest() -> str:
    h = hashlib.sha256()
    for f in ("msl_shim.h", "emu_runtime.h"):
        h.update((SHIM_DIR / f).read_bytes())
    return h.hexdigest()


def _precompiled_header(cxx: str, digest: str) -> Path:
    """Directory holding msl_emu.h (shim + runtime) and, when g++ can build it, its precompiled
    header: each variant then parses only its own text."""
    pch_dir = cache_dir() / f"pch-{digest[:16]}"
    header = pch_dir / "msl_emu.h"
    if not header.exists():
        pch_dir.mkdir(parents=True, exist_ok=True)
        tmp = header.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(f'#pragma once\n#include "{SHIM_DIR / "msl_shim.h"}"\n#include "{SHIM_DIR / "emu_runtime.h"}"\n')
        os.replace(tmp, header)
    gch = pch_dir / "msl_emu.h.gch"
    if not gch.exists():
        tmp = pch_dir / f"msl_emu.{os.getpid()}.{threading.get_ident()}.gch.tmp"
        flags = [f for f in CXXFLAGS if f != "-shared"]
        proc = subprocess.run([cxx, *flags, "-x", "c++-header", str(header), "-o", str(tmp)], capture_output=True)
        if proc.returncode == 0:
            os.replace(tmp, gch)
        else:  # no precompiled header: every variant parses the shim itself
            tmp.unlink(missing_ok=True)
    return pch_dir


def compile_variant(unit: str) -> ctypes.CDLL:
    """The loaded shared library of kernel text `unit` (after msl_emu.h), compiled once and cached
    on disk under cache_dir()."""
    cxx = compiler()
    if cxx is None:
        raise KernelFault("the Metal emulator needs a C++17 compiler (g++ or $CXX): none found")
    digest = _shim_digest()
    key = hashlib.sha256((unit + digest + " ".join(CXXFLAGS) + cxx).encode()).hexdigest()[:24]
    with _compile_lock:
        if key in _libraries:
            return _libraries[key]
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / f"k{key}.so"
    if not so.exists():
        pch_dir = _precompiled_header(cxx, digest)
        src = out_dir / f"k{key}.cpp"
        tmp_src = src.with_suffix(f".{os.getpid()}.{threading.get_ident()}.cpp")
        tmp_src.write_text('#include "msl_emu.h"\n' + unit)
        os.replace(tmp_src, src)
        tmp_so = so.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        proc = subprocess.run([cxx, *CXXFLAGS, "-I", str(pch_dir), str(src), "-o", str(tmp_so)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelFault(f"the kernel does not compile (as C++17 against msl_shim.h; source {src}):\n"
                              + proc.stderr[-4000:])
        os.replace(tmp_so, so)
    lib = ctypes.CDLL(str(so))
    lib.emu_alloc.restype = ctypes.c_void_p
    lib.emu_alloc.argtypes = [ctypes.c_size_t]
    lib.emu_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.emu_run.restype = ctypes.c_int
    lib.emu_run.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                            ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.POINTER(ctypes.c_uint),
                            ctypes.POINTER(ctypes.c_uint), ctypes.c_int, ctypes.c_ulonglong, ctypes.c_double,
                            ctypes.c_char_p, ctypes.c_int]
    with _compile_lock:
        _libraries[key] = lib
    return lib


# ------------------------------------------------------------------------------------------------
# Running


def _host_bytes(a: mx.array) -> np.ndarray:
    """The array's bytes, row-contiguous (bfloat16 through a uint16 view: numpy has no bfloat16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).view(np.uint8).reshape(-1)


def _from_bytes(raw: bytes, shape, dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(np.frombuffer(raw, np.uint16).reshape(shape)).view(mx.bfloat16)
    np_dtype = np.dtype(str(dtype).split(".")[-1].replace("bool_", "bool"))
    return mx.array(np.frombuffer(raw, np_dtype).reshape(shape))


class _Buffers:
    """Guarded buffers of one call (emu_alloc), freed on exit."""

    def __init__(self, lib):
        self.lib, self.ptrs, self.sizes, self.names = lib, [], [], []

    def add(self, name: str, data: bytes | np.ndarray | None, nbytes: int, fill: int = 0):
        ptr = self.lib.emu_alloc(nbytes)
        if not ptr:
            raise MemoryError(f"emulator: cannot map a buffer of {nbytes} bytes")
        self.ptrs.append(ptr)
        self.sizes.append(nbytes)
        self.names.append(name.encode())
        if data is not None and nbytes:
            ctypes.memmove(ptr, np.ascontiguousarray(data).ctypes.data, nbytes)
        elif nbytes:
            ctypes.memset(ptr, fill, nbytes)
        return ptr

    def read(self, i: int) -> bytes:
        return ctypes.string_at(self.ptrs[i], self.sizes[i])

    def write(self, i: int, data: np.ndarray):
        ctypes.memmove(self.ptrs[i], np.ascontiguousarray(data).ctypes.data, self.sizes[i])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p, n in zip(self.ptrs, self.sizes):
            self.lib.emu_free(p, n)


def _as_array(x) -> mx.array:
    return x if isinstance(x, mx.array) else mx.array(x)


def _strides(shape) -> list:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None):
    """The emulated twin of `mx.fast.metal_kernel` (same arguments; compile_options' math_mode is
    accepted and has no effect: g++ computes as IEEE); see the module docstring."""
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    input_names, output_names = list(input_names), list(output_names)
    infos = shape_infos(source, input_names)
    attrs_used = [a for a, _ in METAL_ATTRIBUTES if a in source]

    def call(inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None,
             verbose=False, stream=None, *, schedule="forward", seed=0, timeout_s=60.0):
        """Runs the kernel; returns its outputs as mx arrays. schedule: forward / reverse / shuffled."""
        inputs = [_as_array(x) for x in inputs]
        template = list(template or [])
        if len(inputs) != len(input_names):
            raise ValueError(f"[metal_kernel] Expected `inputs` to have size {len(input_names)} "
                             f"but got size {len(inputs)}.")
        if len(output_shapes) != len(output_names) or len(output_dtypes) != len(output_names):
            raise ValueError("[metal_kernel] Expected one output shape and dtype per output name.")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r}: expected one of {SCHEDULES}")
        kname, text = kernel_source(name, input_names, output_names, source, header, atomic_outputs, inputs,
                                    output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{name}`:\n```\n{text}\n```")
        unit = ('#line 1 "kernel"\n' + _emulator_text(text) + '\n#line 1 "entry"\n'
                + _entry(kname, inputs, input_names, output_dtypes, infos, attrs_used, template, atomic_outputs))
        lib = compile_variant(unit)
        grid = tuple(int(g) for g in grid)
        tg = tuple(max(1, min(int(t), int(g))) for t, g in zip(threadgroup, grid))  # MLX clamps to the grid
        outs = []
        with _Buffers(lib) as bufs:
            for n, a, info in zip(input_names, inputs, infos):
                data = _host_bytes(a)
                bufs.add(n, data, data.size)
                if a.ndim > 0:
                    if info[0]:
                        bufs.add(f"{n}_shape", np.array(a.shape, np.int32), 4 * a.ndim)
                    if info[1]:
                        bufs.add(f"{n}_strides", np.array(_strides(a.shape), np.int64), 8 * a.ndim)
                    if info[2]:
                        bufs.add(f"{n}_ndim", np.array([a.ndim], np.int32), 4)
            first_out = len(bufs.ptrs)
            for n, shape, dt in zip(output_names, output_shapes, output_dtypes):
                nbytes = int(np.prod(shape, dtype=np.int64)) * dt.size
                if init_value is None:
                    bufs.add(n, None, nbytes, fill=0xFF)
                else:
                    init = _host_bytes(mx.full(tuple(shape), init_value, dt))
                    bufs.add(n, init, nbytes)
            if all(g > 0 for g in grid):
                err = ctypes.create_string_buffer(4096)
                k = len(bufs.ptrs)
                rc = lib.emu_run((ctypes.c_void_p * k)(*bufs.ptrs), (ctypes.c_size_t * k)(*bufs.sizes),
                                 (ctypes.c_char_p * k)(*bufs.names), k, (ctypes.c_uint * 3)(*grid),
                                 (ctypes.c_uint * 3)(*tg), SCHEDULES.index(schedule), seed, float(timeout_s),
                                 err, len(err))
                if rc != 0:
                    raise KernelFault(f"{kname}: {_with_line(err.value.decode(errors='replace'), text)}")
            for i, (shape, dt) in enumerate(zip(output_shapes, output_dtypes)):
                outs.append(_from_bytes(bufs.read(first_out + i), tuple(shape), dt))
        return outs

    return call


def _with_line(message: str, text: str) -> str:
    """Appends the kernel-text lines a message cites ("line N")."""
    lines = text.split("\n")
    cited = sorted({int(n) for n in re.findall(r"\bline (\d+)", message)})
    shown = [f"  line {n}: {lines[n - 1].strip()}" for n in cited if 0 < n <= len(lines)]
    return message + ("\n" + "\n".join(shown) if shown else "")
