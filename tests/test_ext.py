"""mlx_flash._ext: the instruction-set switch, the layer kernels on every instruction set, and every
entry point's argument checks (a bad argument is a ValueError, never a crash of the process).

Calls that could crash (SIGFPE, SIGSEGV) run in one child process, so a crash fails the cases it
hit instead of killing pytest.
"""

import json
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest
from conftest import kernel_extension

_ext, _why = kernel_extension()
pytestmark = pytest.mark.skipif(_ext is None, reason=f"mlx_flash._ext not available ({_why})")
BEST_ISA = _ext.best_isa() if _ext is not None else "best"
ISA_ORDER = ("scalar", "avx2", "avx512")  # each includes the ones before it


def runnable(isa):
    """`isa` when this CPU runs it, else the best it has (as MLX_FLASH_ISA does)."""
    return isa if BEST_ISA in ISA_ORDER and ISA_ORDER.index(isa) <= ISA_ORDER.index(BEST_ISA) else BEST_ISA


@pytest.fixture(params=["scalar", BEST_ISA])
def isa(request):
    """Run on the portable scalar path and on the best instruction set this CPU has."""
    _ext.set_isa(request.param)
    yield request.param
    _ext.set_isa(BEST_ISA)


def test_isa_switch():
    assert BEST_ISA in ISA_ORDER
    features = _ext.cpu_features()
    avx2 = all(f in features for f in ("avx2", "fma", "f16c"))
    avx512 = avx2 and all(f in features for f in ("avx512f", "avx512bw", "avx512vl", "avx512vbmi2", "vpclmulqdq"))
    assert BEST_ISA == ("avx512" if avx512 else "avx2" if avx2 else "scalar")
    try:
        _ext.set_isa("scalar")
        assert _ext.isa() == "scalar" and not _ext.simd_active()
        _ext.set_simd(True)  # the older switch: True = the best ISA
        assert _ext.isa() == BEST_ISA
        with pytest.raises(ValueError, match="unknown instruction set"):
            _ext.set_isa("avx1024")
        for isa in ISA_ORDER[ISA_ORDER.index(BEST_ISA) + 1:]:
            with pytest.raises(ValueError, match="cannot run"):
                _ext.set_isa(isa)
        for isa in ISA_ORDER[: ISA_ORDER.index(BEST_ISA) + 1]:
            _ext.set_isa(isa)
            assert _ext.isa() == isa
    finally:
        _ext.set_isa(BEST_ISA)


@pytest.mark.parametrize("name,value,want", [("MLX_FLASH_ISA", "scalar", "scalar"), ("MLX_FLASH_ISA", "", BEST_ISA),
                                             ("MLX_FLASH_ISA", "avx2", runnable("avx2")),
                                             ("MLX_FLASH_ISA", "avx512", runnable("avx512")), ("MLX_FLASH_THREADS", "3", "3"),
                                             ("MLX_FLASH_THREADS", "1", "1")])
def test_environment_sets_isa_and_threads_through_cpu_ops(name, value, want):
    # mlx_flash.cpu.ops is the one reader of the variables: it checks them, then applies them.
    shown = "_ext.isa()" if name == "MLX_FLASH_ISA" else "_ext.num_threads()"
    code = f"import mlx_flash.cpu.ops; from mlx_flash import _ext; print({shown})"
    env = {**os.environ, name: value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == want


def test_the_extension_itself_reads_no_environment():
    # A direct import of _ext cannot bypass cpu.ops' check: the C++ ignores the variables.
    code = "import mlx.core; from mlx_flash import _ext; print(_ext.isa(), _ext.num_threads())"
    env = {**os.environ, "MLX_FLASH_ISA": "scalar", "MLX_FLASH_THREADS": "99999"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    bare = {k: v for k, v in os.environ.items() if k not in ("MLX_FLASH_ISA", "MLX_FLASH_THREADS")}
    ref = subprocess.run([sys.executable, "-c", code], env=bare, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == BEST_ISA and out.stdout == ref.stdout


@pytest.mark.parametrize("n", [0, -1, 257])
def test_set_num_threads_refuses_out_of_range(n):
    with pytest.raises(ValueError, match="1..256"):
        _ext.set_num_threads(n)


@pytest.mark.parametrize("quantize", [(4, 32), None], ids=["q4g32", "f16"])
def test_patched_llama_matches_mlx_on_each_isa(tiny_llama, isa, quantize):
    # The fused blocks (norm + qkv + rope, attention + o_proj, norm + SwiGLU + down), norms and
    # matvecs of a patched tiny llama, a prompt then decode steps through mlx-lm's KV cache, against
    # MLX's own ops on the same model: on the scalar path and on the best one.
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from mlx_flash.cpu import ops
    from mlx_flash.cpu.patch import patch_layers

    mx.set_default_device(mx.cpu)
    model, _ = load_model(tiny_llama("m", **({"quantize": quantize} if quantize else {"dtype": "float16"})))
    patch_layers(model)

    def run():
        cache = make_prompt_cache(model)
        outs = [model(mx.array([[1, 5, 9, 2, 7, 3, 11]]), cache=cache)]
        outs += [model(mx.array([[t]]), cache=cache) for t in (4, 8)]
        mx.eval(outs)
        return [np.array(o.astype(mx.float32)) for o in outs]

    ours = run()
    try:
        ops.set_kernels_enabled(False)
        reference = run()
    finally:
        ops.set_kernels_enabled(True)
    tol = 1e-4 if quantize else 2e-2  # float16 activations round to 2^-11
    for a, r in zip(ours, reference):
        assert np.max(np.abs(a - r)) <= tol * max(1.0, np.max(np.abs(r))), np.max(np.abs(a - r))


# ------------------------------------------------------------------------------------------------
# Argument checks: each case is one call with one bad argument (the rest valid), run in a child.

_SETUP = """
import mlx.core as mx
from mlx_flash import _ext
mx.set_default_device(mx.cpu)
K, N = 64, 8
x = mx.ones((2, K))
w16 = mx.ones((N, K), mx.float16)
wq, s, b = mx.quantize(mx.ones((N, K)), group_size=32, bits=4)
wq8, s8, b8 = mx.quantize(mx.ones((N, K)), group_size=32, bits=8)
rows = mx.array([0, 3], mx.int32)
q = mx.ones((1, 4, 3, 16)); kv = mx.ones((1, 2, 5, 16))
xb = mx.ones((1, 3, K), mx.float16)
def proj(n, k, bits=4, bias=None):
    w, sc, bi = mx.quantize(mx.ones((n, k), mx.float16), group_size=32, bits=bits)
    return (w, sc, bi, bias)
qp, kp, vp = proj(64, K), proj(32, K), proj(32, K)
def qkv(**kw):
    a = dict(x=xb, norm_weight=None, eps=1e-5, q=qp, k=kp, v=vp, group_size=32, bits=4, n_heads=4, n_kv_heads=2,
             rope_dims=16, traditional=False, base=1e4, scale=1.0, offset=0, freqs=None)
    a.update(kw)
    return _ext.norm_qkv_rope(**a)
def swiglu(**kw):
    a = dict(x=xb, norm_weight=None, eps=1e-5, gate=proj(96, K), up=proj(96, K), group_size=32, bits=4)
    a.update(kw)
    return _ext.norm_swiglu(**a)
def o_proj(**kw):
    a = dict(queries=q, keys=kv, values=kv, scale=0.25, causal=True, n_keys=None, o=proj(K, 64), group_size=32,
             bits=4, residual=mx.ones((1, 3, K)))
    a.update(kw)
    return _ext.attention_o_proj(**a)
"""

BAD_CALLS = {
    # quantized_matvec
    "qmv bits 0": "_ext.quantized_matvec(x, wq, s, b, 32, 0)",
    "qmv bits 3": "_ext.quantized_matvec(x, wq, s, b, 32, 3)",
    "qmv bits -4": "_ext.quantized_matvec(x, wq, s, b, 32, -4)",
    "qmv bits 16": "_ext.quantized_matvec(x, wq, s, b, 32, 16)",
    "qmv bits 32": "_ext.quantized_matvec(x, wq, s, b, 32, 32)",
    "qmv group 0": "_ext.quantized_matvec(x, wq, s, b, 0, 4)",
    "qmv group -32": "_ext.quantized_matvec(x, wq, s, b, -32, 4)",
    "qmv group 48": "_ext.quantized_matvec(x, wq, s, b, 48, 4)",
    "qmv group not dividing K": "_ext.quantized_matvec(mx.ones((1, 96)), *mx.quantize(mx.ones((4, 96)), 32, 4), 64, 4)",
    "qmv scales shape": "_ext.quantized_matvec(x, wq, s[:, :1], b, 32, 4)",
    "qmv scales int": "_ext.quantized_matvec(x, wq, s.astype(mx.int32), b.astype(mx.int32), 32, 4)",
    "qmv biases dtype": "_ext.quantized_matvec(x, wq, s, b.astype(mx.float16), 32, 4)",
    "qmv w float": "_ext.quantized_matvec(x, wq.astype(mx.float32), s, b, 32, 4)",
    "qmv w 1-D": "_ext.quantized_matvec(x, wq.reshape(-1), s, b, 32, 4)",
    "qmv w 3-D": "_ext.quantized_matvec(x, wq[None], s, b, 32, 4)",
    "qmv x int": "_ext.quantized_matvec(x.astype(mx.int32), wq, s, b, 32, 4)",
    "qmv x float64": "_ext.quantized_matvec(mx.ones((2, K), mx.float64), wq, s, b, 32, 4)",
    "qmv x 0-d": "_ext.quantized_matvec(mx.array(1.0), wq, s, b, 32, 4)",
    "qmv x width": "_ext.quantized_matvec(mx.ones((2, K + 1)), wq, s, b, 32, 4)",
    "qmv add shape": "_ext.quantized_matvec(x, wq, s, b, 32, 4, add=mx.ones((2, N + 1)))",
    "qmv add int": "_ext.quantized_matvec(x, wq, s, b, 32, 4, add=mx.ones((2, N), mx.int32))",
    # half_matvec
    "hmv w uint32": "_ext.half_matvec(x, wq)",
    "hmv w float32": "_ext.half_matvec(x, mx.ones((N, K)))",
    "hmv x width": "_ext.half_matvec(mx.ones((2, K - 1)), w16)",
    "hmv x int": "_ext.half_matvec(x.astype(mx.int8), w16)",
    "hmv add shape": "_ext.half_matvec(x, w16, add=mx.ones((N,)))",
    # gather_matvec / gather_matvec_t
    "gmv n -1": "_ext.gather_matvec(x, w16, n=-1)",
    "gmv n -5 quantized": "_ext.gather_matvec(x, wq, s, b, n=-5, group_size=32, bits=4)",
    "gmv n past N": "_ext.gather_matvec(x, w16, n=N + 1)",
    "gmv rows 2-D": "_ext.gather_matvec(x, w16, rows=rows[None])",
    "gmv rows float": "_ext.gather_matvec(x, w16, rows=mx.array([0.5, 1.0]))",
    "gmv rows and n": "_ext.gather_matvec(x, w16, rows=rows, n=2)",
    "gmv neither": "_ext.gather_matvec(x, w16)",
    "gmv bits 0": "_ext.gather_matvec(x, wq, s, b, rows=rows, group_size=32, bits=0)",
    "gmv group 0": "_ext.gather_matvec(x, wq, s, b, rows=rows, group_size=0, bits=4)",
    "gmv no scales": "_ext.gather_matvec(x, wq, rows=rows, group_size=32, bits=4)",
    "gmv q8 half": "_ext.gather_matvec(x, w16, rows=rows, q8_activations=True)",
    "gmvt n -1": "_ext.gather_matvec_t(mx.ones((2, 0)), w16, n=-1)",
    "gmvt n past N": "_ext.gather_matvec_t(mx.ones((2, N + 1)), w16, n=N + 1)",
    "gmvt h width": "_ext.gather_matvec_t(mx.ones((2, 3)), w16, rows=rows)",
    "gmvt bits 0": "_ext.gather_matvec_t(mx.ones((2, 2)), wq, s, b, rows=rows, group_size=32, bits=0)",
    "gmvt bits 2": "_ext.gather_matvec_t(mx.ones((2, 2)), wq, s, b, rows=rows, group_size=32, bits=2)",
    "gmvt neither": "_ext.gather_matvec_t(mx.ones((2, 2)), w16)",
    # quantized_embedding
    "emb bits 0": "_ext.quantized_embedding(rows, wq, s, b, 32, 0)",
    "emb bits 3": "_ext.quantized_embedding(rows, wq, s, b, 32, 3)",
    "emb group 0": "_ext.quantized_embedding(rows, wq, s, b, 0, 4)",
    "emb ids float": "_ext.quantized_embedding(mx.array([1.0]), wq, s, b, 32, 4)",
    "emb w half": "_ext.quantized_embedding(rows, w16, s, b, 32, 4)",
    "emb scales shape": "_ext.quantized_embedding(rows, wq, s.T, b.T, 32, 4)",
    "emb bits 8 on a 4-bit table": "_ext.quantized_embedding(rows, wq, s, b, 32, 8)",
    # rms_norm / layer_norm / rope
    "rms x int": "_ext.rms_norm(x.astype(mx.int32), None, 1e-5)",
    "rms x 0-d": "_ext.rms_norm(mx.array(1.0), None, 1e-5)",
    "rms weight shape": "_ext.rms_norm(x, mx.ones((K + 1,)), 1e-5)",
    "rms weight int": "_ext.rms_norm(x, mx.ones((K,), mx.int32), 1e-5)",
    "ln bias shape": "_ext.layer_norm(x, None, mx.ones((3,)), 1e-5)",
    "ln x uint8": "_ext.layer_norm(x.astype(mx.uint8), None, None, 1e-5)",
    "rope dims odd": "_ext.rope(q, 15, False, 1e4, 1.0, 0)",
    "rope dims 0": "_ext.rope(q, 0, False, 1e4, 1.0, 0)",
    "rope dims -2": "_ext.rope(q, -2, False, 1e4, 1.0, 0)",
    "rope dims past D": "_ext.rope(q, 18, False, 1e4, 1.0, 0)",
    "rope x 1-D": "_ext.rope(mx.ones((16,)), 16, False, 1e4, 1.0, 0)",
    "rope freqs shape": "_ext.rope(q, 16, False, 1e4, 1.0, 0, mx.ones((3,)))",
    "rope freqs int": "_ext.rope(q, 16, False, 1e4, 1.0, 0, mx.ones((8,), mx.int32))",
    # attention
    "attn 3-D": "_ext.attention(q[0], kv[0], kv[0], 0.25)",
    "attn heads": "_ext.attention(mx.ones((1, 3, 3, 16)), kv, kv, 0.25)",
    "attn no kv heads": "_ext.attention(q, kv[:, :0], kv[:, :0], 0.25)",
    "attn n_keys -1": "_ext.attention(q, kv, kv, 0.25, n_keys=-1)",
    "attn n_keys past L": "_ext.attention(q, kv, kv, 0.25, n_keys=6)",
    "attn head dim": "_ext.attention(mx.ones((1, 4, 3, 8)), kv, kv, 0.25)",
    "attn values length": "_ext.attention(q, kv, kv[:, :, :4], 0.25)",
    "attn int": "_ext.attention(q.astype(mx.int32), kv, kv, 0.25)",
    # norm_qkv_rope
    "qkv bits 0": "qkv(bits=0)",
    "qkv bits 5": "qkv(bits=5)",
    "qkv group 0": "qkv(group_size=0)",
    "qkv n_heads 0": "qkv(n_heads=0)",
    "qkv n_kv_heads -1": "qkv(n_kv_heads=-1)",
    "qkv q rows": "qkv(n_heads=3)",
    "qkv kv rows": "qkv(n_kv_heads=1)",
    "qkv rope dims odd": "qkv(rope_dims=7)",
    "qkv rope dims past head": "qkv(rope_dims=32)",
    "qkv x 2-D": "qkv(x=xb[0])",
    "qkv x int": "qkv(x=xb.astype(mx.int32))",
    "qkv norm weight shape": "qkv(norm_weight=mx.ones((3,)))",
    "qkv freqs int": "qkv(freqs=mx.ones((8,), mx.int32))",
    "qkv bias int": "qkv(q=proj(64, K, bias=mx.ones((64,), mx.int32)))",
    "qkv bias shape": "qkv(q=proj(64, K, bias=mx.ones((3,), mx.float16)))",
    "qkv formats differ": "qkv(k=proj(32, K, bits=8), bits=4)",
    "qkv one cache": "qkv(k_cache=mx.zeros((1, 2, 8, 16), mx.float16))",
    "qkv cache shape": "qkv(k_cache=mx.zeros((1, 2, 2, 16), mx.float16), v_cache=mx.zeros((1, 2, 2, 16), mx.float16))",
    "qkv cache dtype": "qkv(k_cache=mx.zeros((1, 2, 8, 16)), v_cache=mx.zeros((1, 2, 8, 16)))",
    "qkv offset -1 with cache": "qkv(offset=-1, k_cache=mx.zeros((1, 2, 8, 16), mx.float16), v_cache=mx.zeros((1, 2, 8, 16), mx.float16))",
    # norm_swiglu
    "swiglu bits 0": "swiglu(bits=0)",
    "swiglu group 0": "swiglu(group_size=0)",
    "swiglu rows differ": "swiglu(up=proj(64, K))",
    "swiglu bias": "swiglu(gate=proj(96, K, bias=mx.ones((96,), mx.float16)))",
    "swiglu gate 1-D": "swiglu(gate=(mx.ones((96,), mx.uint32), None, None, None))",
    "swiglu x int": "swiglu(x=xb.astype(mx.int32))",
    "swiglu down rows": "swiglu(down=proj(32, 96), down_group_size=32, down_bits=4)",
    "swiglu down bits 0": "swiglu(down=proj(K, 96), down_group_size=32, down_bits=0)",
    "swiglu down group 0": "swiglu(down=proj(K, 96), down_group_size=0, down_bits=4)",
    "swiglu down bias": "swiglu(down=proj(K, 96, bias=mx.ones((K,), mx.float16)), down_group_size=32, down_bits=4)",
    # attention_o_proj
    "o_proj bits 0": "o_proj(bits=0)",
    "o_proj group 0": "o_proj(group_size=0)",
    "o_proj input size": "o_proj(o=proj(K, 32))",
    "o_proj residual shape": "o_proj(residual=mx.ones((1, 3, K + 1)))",
    "o_proj residual int": "o_proj(residual=mx.ones((1, 3, K), mx.int32))",
    "o_proj bias": "o_proj(o=proj(K, 64, bias=mx.ones((K,), mx.float16)))",
    "o_proj n_keys": "o_proj(n_keys=9)",
    # hooks
    "set_isa name": "_ext.set_isa('sse9')",
    "round_floats int": "_ext.round_floats([1.0], mx.int32)",
}

# Inputs the kernels accept whose answer is defined: out-of-range ids and rows (known only when the
# graph runs) give NaN rows; empty rows (K = 0) give zeros. Each expression is True when right.
EDGE_CALLS = {
    "emb ids past the table": "bool(mx.all(mx.isnan(_ext.quantized_embedding(mx.array([2**31 - 1, -2**31, N], "
                              "mx.int32), wq, s, b, 32, 4))))",
    "emb uint32 ids past the table": "bool(mx.all(mx.isnan(_ext.quantized_embedding(mx.array([2**32 - 1], "
                                     "mx.uint32), wq8, s8, b8, 32, 8))))",
    "gather rows past W": "bool(mx.all(mx.isnan(_ext.gather_matvec(mx.ones((7, K)), wq, s, b, "
                          "rows=mx.array([2**31 - 1, -2**31], mx.int32), group_size=32, bits=4))))",
    "gather uint32 rows past W": "bool(mx.all(mx.isnan(_ext.gather_matvec(x, w16, rows=mx.array([2**32 - 1], "
                                 "mx.uint32)))))",
    "gather_t rows past W": "bool(mx.all(mx.isnan(_ext.gather_matvec_t(mx.ones((2, 2)), w16, "
                            "rows=mx.array([1, -7], mx.int32)))))",
    "matvec K 0": "bool(mx.all(_ext.half_matvec(mx.ones((7, 0)), mx.ones((N, 0), mx.float16)) == 0))",
    "quantized matvec K 0": "bool(mx.all(_ext.quantized_matvec(mx.ones((7, 0)), mx.zeros((N, 0), mx.uint32), "
                            "mx.ones((N, 0)), mx.ones((N, 0)), 32, 4) == 0))",
    "matvec no rows": "_ext.gather_matvec(x, w16, n=0).shape == (2, 0)",
}


def _run_child(cases, isa):
    """Runs each case in one child process on instruction set isa: {name: outcome}, where outcome is
    the exception's type name, 'ok: <value>', or 'crashed (<returncode>)' for the case that killed
    the child and every case after it."""
    code = _SETUP + textwrap.dedent(f"""
        import json, sys
        _ext.set_isa({isa!r})
        for name, expr in json.loads(sys.argv[1]).items():
            try:
                value = eval(expr)
                mx.eval(value) if isinstance(value, (mx.array, tuple)) else None
                outcome = "ok: " + str(value)[:60].replace("\\n", " ")
            except Exception as exc:
                outcome = type(exc).__name__ + ": " + str(exc)[:200]
            print(json.dumps([name, outcome]), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    outcomes = dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))
    for name in cases:
        outcomes.setdefault(name, f"crashed ({proc.returncode}): {proc.stderr[-300:]}")
    return outcomes


@pytest.fixture(scope="module", params=["scalar", BEST_ISA])
def child_outcomes(request):
    _ext.set_isa(request.param)  # this process too, so the run's summary counts the child's ISA
    yield _run_child({**BAD_CALLS, **EDGE_CALLS}, request.param)
    _ext.set_isa(BEST_ISA)


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_argument_is_a_value_error(child_outcomes, case):
    assert child_outcomes[case].startswith("ValueError: "), child_outcomes[case]


@pytest.mark.parametrize("case", sorted(EDGE_CALLS))
def test_edge_input_has_a_defined_answer(child_outcomes, case):
    assert child_outcomes[case] == "ok: True", child_outcomes[case]
