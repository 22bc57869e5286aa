"""The Metal emulator (mlx_flash/metal/emulator.py): MLX's kernel text, SIMD-group and barrier
semantics, schedules, and the faults it reports (out-of-bounds, races, deadlocks, hangs).

Linux only (on a Mac the kernels run on the GPU: tests/test_metal_kernels.py); needs g++.
"""

import os
import re
import sys
import tempfile

import mlx.core as mx
import numpy as np
import pytest

from mlx_flash.metal import emulator as em
from mlx_flash.metal import endor
from mlx_flash.metal import kernels as K

pytestmark = [
    pytest.mark.skipif(sys.platform == "darwin", reason="the emulator is for Linux; a Mac runs the real kernels"),
    pytest.mark.skipif(em.compiler() is None, reason="the Metal emulator needs g++ (or $CXX)"),
]


def run(kernel, inputs, grid, threadgroup, shapes, dtypes, **kw):
    return kernel(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=shapes, output_dtypes=dtypes,
                  **kw)


# ------------------------------------------------------------------------------------------------
# The kernel text: the emulator's against MLX's own (printed by verbose=True while exporting)


def mlx_text(capfd, make_kernel, call_kwargs, args):
    """MLX's generated source for one call, traced inside mx.export_function (no GPU needed)."""
    kernel = make_kernel(mx.fast.metal_kernel)

    def f(*arrays):
        return kernel(inputs=list(arrays), verbose=True, **call_kwargs)

    capfd.readouterr()
    with tempfile.TemporaryDirectory() as d:
        mx.export_function(os.path.join(d, "f.mlxfn"), f, *args)
    out = capfd.readouterr().out
    match = re.search(r"```\n(.*)\n```", out, re.S)
    assert match, f"MLX printed no kernel source:\n{out[:500]}"
    return match.group(1)


def sink_kernel(factory):
    """A kernel naming every thread attribute and every shape/strides/ndim parameter kind."""
    names = [a for a, _ in em.METAL_ATTRIBUTES]
    body = "// " + " ".join(names) + "\nout[0] = a_shape[0] + b_strides[0] + c_ndim + s;\n"
    return factory(name="sink", input_names=["a", "b", "c", "s"], output_names=["out", "out2"], source=body,
                   header="// header\n", ensure_row_contiguous=False, atomic_outputs=True)


def plain_kernel(factory):
    return factory(name="plain", input_names=["a"], output_names=["out"], source="out[0] = a[0];")


TEXT_CASES = [
    ("sink", sink_kernel,
     dict(template=[("T", mx.float16), ("N", 3), ("F", False)], grid=(64, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(4,), (2, 2)], output_dtypes=[mx.float32, mx.int32]),
     lambda: [mx.zeros((3, 4)), mx.zeros((20,), mx.bfloat16), mx.zeros((2,), mx.uint32), mx.array(1, mx.int32)]),
    ("plain", plain_kernel,
     dict(grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32]),
     lambda: [mx.zeros((10,))]),
    ("sparse_up q4", lambda f: K.kernel("sparse_up", f), None, "q4"),
    ("sparse_up bf16", lambda f: K.kernel("sparse_up", f), None, "bf16"),
    ("sparse_down q8", lambda f: K.kernel("sparse_down", f), None, "q8"),
    ("endor_up q4", lambda f: K.kernel("endor_up", f), None, "q4"),
    ("endor_down f16", lambda f: K.kernel("endor_down", f), None, "f16"),
]


def _ffn_case(kind, which):
    """(call kwargs, inputs) of a sparse FFN kernel call, captured from the wrapper."""
    mx.random.seed(1)
    w = mx.random.normal((40, 64)).astype(mx.float16 if kind == "q4" else mx.bfloat16)
    if kind in ("q4", "q8"):
        bits = 4 if kind == "q4" else 8
        q, s, b = mx.quantize(w, group_size=32, bits=bits)
        weights = K.Weights(q, s, b, bits=bits, group_size=32)
    else:
        weights = K.Weights(w)
    captured = {}

    def capture(**kernel_kwargs):
        def call(inputs, **call_kwargs):
            captured["inputs"], captured["kwargs"] = inputs, call_kwargs
            return [mx.zeros(shape, dtype) for shape, dtype in zip(call_kwargs["output_shapes"],
                                                                  call_kwargs["output_dtypes"])]
        return call

    if which.startswith("endor"):
        payload = {"bits": 4, "group_size": 32} if kind == "q4" else {"dtype": "float16"}
        enc, bounds = mx.zeros((300,), mx.uint32), mx.array([[0, 10], [10, 20]], mx.int32)
        if which == "endor_up":
            endor.endor_up_metal(mx.zeros((1, 64), mx.float16), enc, bounds, columns=64, down_columns=48,
                                 payload=payload, metal_kernel=capture)
        else:
            endor.endor_down_metal(mx.zeros((1, 12), mx.float16), enc, mx.arange(12).astype(mx.int32),
                                   mx.zeros((12, 2), mx.int32), columns=48, payload=payload, metal_kernel=capture)
    elif which == "sparse_up":
        K.sparse_up_metal(mx.zeros((1, 64), mx.float16), weights, weights, n=12, metal_kernel=capture)
    else:
        K.sparse_down_metal(mx.zeros((1, 12), mx.float16), weights, rows=mx.arange(12), metal_kernel=capture)
    return captured["kwargs"], captured["inputs"]


@pytest.mark.parametrize("case", TEXT_CASES, ids=[c[0] for c in TEXT_CASES])
def test_kernel_text_matches_mlx(case, capfd):
    """The text the emulator compiles is MLX's, character for character (an MLX upgrade that
    changes its wrapper fails here)."""
    name, make, kwargs, inputs = case
    if kwargs is None:
        kwargs, args = _ffn_case(inputs, name.split()[0])
    else:
        args = inputs()
    kwargs = {k: v for k, v in kwargs.items() if k not in ("schedule", "seed", "timeout_s")}
    expected = mlx_text(capfd, make, kwargs, args)
    factory_args = {}
    make(lambda **kw: factory_args.update(kw))
    _, text = em.kernel_source(factory_args["name"], factory_args["input_names"], factory_args["output_names"],
                               factory_args["source"], factory_args.get("header", ""),
                               factory_args.get("atomic_outputs", False), args, kwargs["output_dtypes"],
                               kwargs.get("template"))
    assert text.rstrip("\n") == expected.rstrip("\n")


# ------------------------------------------------------------------------------------------------
# Semantics


ATTRS = em.metal_kernel("attrs", ["a"], ["out"], """
uint i = thread_position_in_grid.x + threads_per_grid.x * (thread_position_in_grid.y + threads_per_grid.y * thread_position_in_grid.z);
uint o = i * 12;
out[o + 0] = thread_position_in_threadgroup.x;  out[o + 1] = thread_position_in_threadgroup.y;
out[o + 2] = threadgroup_position_in_grid.x;    out[o + 3] = threadgroup_position_in_grid.y;
out[o + 4] = threads_per_threadgroup.x;         out[o + 5] = threads_per_threadgroup.y;
out[o + 6] = thread_index_in_threadgroup;       out[o + 7] = simdgroup_index_in_threadgroup;
out[o + 8] = thread_index_in_simdgroup;         out[o + 9] = simdgroups_per_threadgroup;
out[o + 10] = threadgroups_per_grid.x;          out[o + 11] = dispatch_threads_per_threadgroup.x + a[0];
""")


@pytest.mark.parametrize("schedule", em.SCHEDULES)
def test_thread_attributes_with_partial_threadgroups(schedule):
    """Grid 50x3 in threadgroups of 20x2: the edge threadgroups hold only the threads inside the grid
    (dispatch_threads), and every attribute says so."""
    gx, gy, tx, ty = 50, 3, 20, 2
    out = np.array(run(ATTRS, [mx.zeros((1,), mx.uint32)], (gx, gy, 1), (tx, ty, 1), [(gx * gy * 12,)],
                       [mx.uint32], schedule=schedule)[0]).reshape(gy, gx, 12)
    for y in range(gy):
        for x in range(gx):
            ax, ay = min(tx, gx - x // tx * tx), min(ty, gy - y // ty * ty)
            index = x % tx + ax * (y % ty)
            want = [x % tx, y % ty, x // tx, y // ty, ax, ay, index, index // 32, index % 32,
                    -(-(ax * ay) // 32), -(-gx // tx), tx]
            assert out[y, x].tolist() == want, (x, y)


SIMD_OPS = em.metal_kernel("simd_ops", ["a"], ["out"], """
uint i = thread_position_in_grid.x;
if (i >= a_shape[0]) return;
float v = a[i];
uint lane = thread_index_in_simdgroup;
out[i * 8 + 0] = simd_sum(v);
out[i * 8 + 1] = simd_max(v);
out[i * 8 + 2] = simd_shuffle_down(v, 3);
out[i * 8 + 3] = simd_shuffle_xor(v, 5);
out[i * 8 + 4] = simd_broadcast(v, 2);
out[i * 8 + 5] = simd_prefix_exclusive_sum(v);
out[i * 8 + 6] = simd_shuffle(v, (lane + 7) % 32);
out[i * 8 + 7] = simd_min(v);
""")


@pytest.mark.parametrize("schedule", em.SCHEDULES)
def test_simd_group_functions(schedule):
    """SIMD-group functions over full groups and a group whose lanes 13..31 returned (inactive)."""
    n = 45  # threads 45..63 return at once: the second SIMD group has 13 live lanes
    a = np.random.default_rng(0).integers(-50, 50, n).astype(np.float32)
    out = np.array(run(SIMD_OPS, [mx.array(a)], (64, 1, 1), (64, 1, 1), [(n * 8,)], [mx.float32],
                       schedule=schedule)[0]).reshape(n, 8)
    for i in range(n):
        base, lane = i // 32 * 32, i % 32
        group = a[base:min(base + 32, n)]
        live = len(group)
        assert out[i, 0] == group.sum() and out[i, 1] == group.max() and out[i, 7] == group.min()
        if lane + 3 < live:
            assert out[i, 2] == group[lane + 3]
        elif lane + 3 >= 32:
            assert out[i, 2] == a[i]  # no source lane: the lane keeps its value
        if (lane ^ 5) < live:
            assert out[i, 3] == group[lane ^ 5]
        assert out[i, 4] == group[2]
        assert out[i, 5] == group[:lane].sum()
        if (lane + 7) % 32 < live:
            assert out[i, 6] == group[(lane + 7) % 32]


def test_integer_bit_functions():
    """popcount and ctz (ctz(0) is the bit width, as in MSL), on uint and int."""
    k = em.metal_kernel("bits", ["a"], ["out"], """
uint i = thread_position_in_grid.x;
out[3 * i] = metal::popcount(a[i]);
out[3 * i + 1] = metal::ctz(a[i]);
out[3 * i + 2] = uint(metal::popcount(int(a[i])));
""")
    a = np.array([0, 1, 6, 0x80000000, 0xFFFFFFFF, 0x00F0F000, 12345678, 40], np.uint32)
    out = np.array(run(k, [mx.array(a)], (8, 1, 1), (8, 1, 1), [(24,)], [mx.uint32])[0]).reshape(8, 3)
    assert out[:, 0].tolist() == [bin(int(v)).count("1") for v in a] == out[:, 2].tolist()
    assert out[:, 1].tolist() == [32 if v == 0 else (int(v) & -int(v)).bit_length() - 1 for v in a]


SCAN = em.metal_kernel("scan", ["a"], ["out"], """
uint lane = thread_index_in_simdgroup;
float v = a[thread_position_in_grid.x];
for (ushort offset = 1; offset < 32; offset *= 2) {
  float t = simd_shuffle_up(v, offset);
  if (lane >= offset) v += t;
}
out[thread_position_in_grid.x] = v;
""")


@pytest.mark.parametrize("schedule", em.SCHEDULES)
def test_simd_exchanges_in_a_loop(schedule):
    """A scan by repeated shuffles: each exchange must see the values of that round, whichever lane
    resumes first and posts its next value."""
    a = np.random.default_rng(1).integers(0, 9, 64).astype(np.float32)
    out = np.array(run(SCAN, [mx.array(a)], (64, 1, 1), (64, 1, 1), [(64,)], [mx.float32], schedule=schedule)[0])
    np.testing.assert_array_equal(out, np.concatenate([np.cumsum(a[:32]), np.cumsum(a[32:])]))


REDUCE_SOURCE = """
threadgroup float partial[32];
uint t = thread_index_in_threadgroup;
float v = x[thread_position_in_grid.x];
v = simd_sum(v);
if (thread_index_in_simdgroup == 0) partial[simdgroup_index_in_threadgroup] = v;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (t == 0) {
  float s = 0;
  for (uint k = 0; k < simdgroups_per_threadgroup; k++) s += partial[k];
  out[threadgroup_position_in_grid.x] = s;
}
"""
REDUCE = em.metal_kernel("reduce", ["x"], ["out"], REDUCE_SOURCE)


@pytest.mark.parametrize("schedule", em.SCHEDULES)
def test_threadgroup_memory_and_barrier(schedule):
    x = np.arange(1000, dtype=np.float32)
    out = np.array(run(REDUCE, [mx.array(x)], (1000, 1, 1), (256, 1, 1), [(4,)], [mx.float32],
                       schedule=schedule, seed=3)[0])
    np.testing.assert_array_equal(out, [x[i:i + 256].sum() for i in range(0, 1000, 256)])


def test_threadgroup_memory_read_before_written_is_poisoned():
    """A reduction reading 8 partial sums when the threadgroup has 4 SIMD groups: the 4 never
    written are NaN (threadgroup memory starts undefined), in every threadgroup."""
    k = em.metal_kernel("unwritten", ["x"], ["out"], REDUCE_SOURCE.replace("k < simdgroups_per_threadgroup", "k < 8"))
    x = np.ones(512, np.float32)
    out = np.array(run(k, [mx.array(x)], (512, 1, 1), (128, 1, 1), [(4,)], [mx.float32])[0])
    assert np.isnan(out).all()
    good = np.array(run(REDUCE, [mx.array(x)], (512, 1, 1), (128, 1, 1), [(4,)], [mx.float32])[0])
    np.testing.assert_array_equal(good, [128] * 4)


def test_unwritten_outputs_are_poisoned_and_init_value_fills():
    k = em.metal_kernel("half_write", ["a"], ["out"], "uint i = thread_position_in_grid.x;\n"
                        "if (i % 2 == 0) out[i] = a[i];")
    a = mx.arange(8).astype(mx.float16)
    poisoned = np.array(run(k, [a], (8, 1, 1), (8, 1, 1), [(8,)], [mx.float16])[0])
    assert np.isnan(poisoned[1::2]).all() and (poisoned[::2] == np.arange(0, 8, 2)).all()
    filled = np.array(run(k, [a], (8, 1, 1), (8, 1, 1), [(8,)], [mx.float16], init_value=7)[0])
    assert (filled[1::2] == 7).all()


def test_bfloat16_and_atomics():
    k = em.metal_kernel("atom", ["a"], ["out"], """
uint i = thread_position_in_grid.x;
atomic_fetch_add_explicit(&out[i % 3], float(a[i]), memory_order_relaxed);
""", atomic_outputs=True)
    a = mx.arange(30).astype(mx.bfloat16)
    out = np.array(run(k, [a], (30, 1, 1), (7, 1, 1), [(3,)], [mx.float32], init_value=0, schedule="shuffled")[0])
    np.testing.assert_array_equal(out, [sum(range(r, 30, 3)) for r in range(3)])


# ------------------------------------------------------------------------------------------------
# Faults the emulator reports


def test_out_of_bounds_read_names_buffer_and_thread():
    """An off-by-one bound (<= instead of <) reads the element past the end: the guard page."""
    k = em.metal_kernel("oob", ["a", "n"], ["out"], """
uint i = thread_position_in_grid.x;
float s = 0;
for (uint k = 0; k <= uint(n); k++) s += a[i * uint(n) + k];
out[i] = s;
""")
    with pytest.raises(em.KernelFault, match=r"out-of-bounds read: thread_position_in_grid \(3, 0, 0\).*"
                                             r"byte 64 of buffer `a` \(64 bytes\): 0 bytes past its end"):
        run(k, [mx.zeros((16,)), mx.array(4, mx.int32)], (4, 1, 1), (4, 1, 1), [(4,)], [mx.float32])


def test_out_of_bounds_write():
    k = em.metal_kernel("oobw", ["a"], ["out"], "out[thread_position_in_grid.x + 2] = a[0];")
    with pytest.raises(em.KernelFault, match=r"out-of-bounds write.*buffer `out`"):
        run(k, [mx.zeros((4,))], (8, 1, 1), (8, 1, 1), [(8,)], [mx.float32])


RACE = """
threadgroup float buf[64];
uint i = thread_position_in_threadgroup.x;
buf[i] = a[thread_position_in_grid.x];
%s
out[thread_position_in_grid.x] = buf[(i + 1) %% 64];
"""


def test_missing_barrier_is_a_race_some_schedule_shows():
    a = np.arange(128, dtype=np.float32)
    want = np.roll(a.reshape(2, 64), -1, axis=1).reshape(-1)
    results = {}
    for barrier in ("threadgroup_barrier(mem_flags::mem_threadgroup);", ""):
        k = em.metal_kernel("race", ["a"], ["out"], RACE % barrier)
        results[bool(barrier)] = [np.array_equal(np.array(run(k, [mx.array(a)], (128, 1, 1), (64, 1, 1),
                                                                 [(128,)], [mx.float32], schedule=s)[0]), want)
                                  for s in em.SCHEDULES]
    assert all(results[True])
    assert not all(results[False])


def test_divergent_barrier_is_reported():
    k = em.metal_kernel("div", ["a"], ["out"], """
uint i = thread_position_in_grid.x;
if (i >= 50) return;
threadgroup_barrier(mem_flags::mem_threadgroup);
out[i] = a[i];
""")
    with pytest.raises(em.KernelFault, match=r"(?s)divergent threadgroup_barrier.*returned.*line 8: "
                                             r"threadgroup_barrier"):
        run(k, [mx.zeros((64,))], (64, 1, 1), (64, 1, 1), [(64,)], [mx.float32])


def test_divergent_simd_calls_are_reported():
    k = em.metal_kernel("dsimd", ["a"], ["out"], """
uint i = thread_position_in_grid.x;
float v = a[i];
if (thread_index_in_simdgroup < 16) { v = simd_sum(v); } else { v = simd_max(v); }
out[i] = v;
""")
    with pytest.raises(em.KernelFault, match=r"divergent SIMD-group call.*simd_sum.*simd_max"):
        run(k, [mx.zeros((32,))], (32, 1, 1), (32, 1, 1), [(32,)], [mx.float32])


def test_deadlock_is_reported():
    """Half a SIMD group waits at a barrier, the other half at a SIMD-group call: nobody can go on."""
    k = em.metal_kernel("dead", ["a"], ["out"], """
uint i = thread_position_in_grid.x;
float v = a[i];
if (i < 16) { threadgroup_barrier(mem_flags::mem_threadgroup); } else { v = simd_sum(v); }
out[i] = v;
""")
    with pytest.raises(em.KernelFault, match=r"deadlock"):
        run(k, [mx.zeros((32,))], (32, 1, 1), (32, 1, 1), [(32,)], [mx.float32])


def test_hang_times_out():
    k = em.metal_kernel("hang", ["a"], ["out"], "while (a[0] >= 0) { out[0] += 1; }")
    with pytest.raises(em.KernelFault, match=r"timeout: the kernel ran over 0.5 s"):
        run(k, [mx.zeros((1,))], (1, 1, 1), (1, 1, 1), [(1,)], [mx.float32], timeout_s=0.5)


def test_compile_error_is_reported():
    k = em.metal_kernel("bad", ["a"], ["out"], "out[0] = undeclared_thing;")
    with pytest.raises(em.KernelFault, match=r"(?s)does not compile.*undeclared_thing"):
        run(k, [mx.zeros((1,))], (1, 1, 1), (1, 1, 1), [(1,)], [mx.float32])
