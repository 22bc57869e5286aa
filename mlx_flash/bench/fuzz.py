"""Property-based fuzzing (hypothesis) of what reads untrusted input and of the CPU kernels.

    python -m mlx_flash.bench fuzz --minutes 10 [--targets manifest,predictors,gguf,kernels]

Targets:
    manifest    a tiny quantized pack whose manifest.json gets 1-3 random edits (any JSON value at
                any path, keys removed), re-signed with a valid metadata checksum 9 times in 10 so
                the schema checks are reached; then it is read, loaded whole, its bundles read
                through the FlashLoader and a naive model run on two tokens
    predictors  the same for predictors.json of a pack with gate-threshold and low-rank layers,
                then a flash model run on two tokens
    gguf        a tiny GGUF with random byte edits in its header (or a metadata value replaced, or
                the file cut short), read, turned into a config, and its tensors loaded
    kernels     every mlx_flash.cpu.ops entry point on random shapes, dtypes, bit widths, group
                sizes and values, on the kernels and on their MLX twins: both must give the same
                values (float tolerance) or both refuse the input with ValueError

A case passes when it ends in a result or in one FlashError (bad input); anything else is a
traceback; a case running over 60 s is a hang. Each target runs in a child process, so a crash (a
signal) is counted, not fatal, and reported with the child's stderr; a new child goes on. The
suite (tests/test_bench_fuzz.py) runs the same targets with a bounded number of examples.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ..errors import FlashError
from ..paths import write_json_atomic

TARGETS = ("manifest", "manifest-endor", "predictors", "gguf", "kernels")
CASE_TIMEOUT_S = 60  # a case running longer counts as a hang


# ---- fixtures: tiny real inputs ------------------------------------------------------------------

def tiny_source(path: Path, seed=0, pruned=False) -> Path:
    """A random 2-layer llama, 4-bit, as an mlx-lm folder (no tokenizer); pruned: float16 with the
    smaller half of every layer weight set to 0 (what ENDOR packs encode)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from ..model_folder import write_model_files

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "vocab_size": 128, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "max_position_embeddings": 256}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    if not pruned:
        nn.quantize(model, group_size=32, bits=4)
        config["quantization"] = {"group_size": 32, "bits": 4}
    weights = dict(tree_flatten(model.parameters()))
    if pruned:
        for name, w in weights.items():
            w = w.astype(mx.float16)
            if name.startswith("model.layers.") and w.ndim == 2:
                w = mx.where(mx.abs(w) < mx.sort(mx.abs(w).flatten())[w.size // 2], 0, w)
            weights[name] = w
    path.mkdir(parents=True, exist_ok=True)
    return write_model_files(path, weights, config, tokenizer_src=None)


def tiny_pack(root: Path, predictors=False, encoding="dense") -> Path:
    from ..pack import write_pack

    pack = write_pack(tiny_source(root / "src", pruned=encoding == "endor"), root / "pack",
                      progress=False, encoding=encoding)
    if predictors:
        import mlx.core as mx

        from ..sparse.predictor import save_predictors

        layers = {0: {"kind": "gate-threshold", "n_neurons": 96, "rank": 0, "threshold": 0.05,
                      "prob_threshold": 0.5, "cut": 0.0, "stats": {}, "capacity": [40, 60, 70]},
                  1: {"kind": "low-rank", "n_neurons": 96, "rank": 4, "threshold": 0.0,
                      "prob_threshold": 0.5, "cut": 0.0, "stats": {}, "capacity": [40, 60, 70]}}
        key = mx.random.key(1)
        factors = {1: {"A": mx.random.normal((4, 64), key=key), "B": mx.random.normal((96, 4), key=key),
                       "bias": mx.zeros((96,))}}
        save_predictors(pack, {"activation": "silu"}, layers, factors)
    return pack


def tiny_gguf(path: Path) -> Path:
    """A tiny float32 llama GGUF with a byte-level tokenizer (needs the `gguf` package)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    h, f, v = 32, 48, 256
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in (("add_block_count", 1), ("add_context_length", 64), ("add_embedding_length", h),
                       ("add_feed_forward_length", f), ("add_head_count", 2), ("add_head_count_kv", 1),
                       ("add_layer_norm_rms_eps", 1e-5), ("add_rope_freq_base", 10000.0),
                       ("add_tokenizer_model", "gpt2")):
        getattr(w, add)(value)
    w.add_token_list([chr(0x100 + i) for i in range(v)])
    w.add_token_types([1] * v)
    shapes = {"attn_norm": (h,), "ffn_norm": (h,), "attn_q": (h, h), "attn_k": (h // 2, h),
              "attn_v": (h // 2, h), "attn_output": (h, h), "ffn_gate": (f, h), "ffn_up": (f, h),
              "ffn_down": (h, f)}
    w.add_tensor("token_embd.weight", rng.standard_normal((v, h), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for name, shape in shapes.items():
        w.add_tensor(f"blk.0.{name}.weight", rng.standard_normal(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- strategies ----------------------------------------------------------------------------------

def json_values():
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(), st.booleans(), st.sampled_from([0, -1, 1, 3, 4, 31, 32, 64, 4096, 2 ** 31, 2 ** 63, 10 ** 30]),
        st.integers(), st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(["", "float16", "bfloat16", "uint32", "dense", "../x", "/dev/zero", "neurons",
                         "experts", "silu", "all", "low-rank", "gate-threshold", "bundles/layer_000.bin"]),
        st.text(max_size=8))
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=6)


def mutate_json(data, doc):
    """1-3 random edits of a JSON document: a value replaced anywhere, or a key removed."""
    from hypothesis import strategies as st

    doc = json.loads(json.dumps(doc))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        node, path = doc, []
        while isinstance(node, (dict, list)) and node and data.draw(st.integers(0, 3)) > 0:
            key = (data.draw(st.sampled_from(sorted(node)), label="key") if isinstance(node, dict)
                   else data.draw(st.integers(0, len(node) - 1), label="index"))
            if not isinstance(node[key], (dict, list)) or not node[key]:
                break
            node, path = node[key], path + [key]
        if not node or not isinstance(node, (dict, list)):
            continue
        key = (data.draw(st.sampled_from(sorted(node))) if isinstance(node, dict)
               else data.draw(st.integers(0, len(node) - 1)))
        if isinstance(node, dict) and data.draw(st.integers(0, 5)) == 0:
            del node[key]
        else:
            node[key] = data.draw(json_values(), label="value")
    return doc


# ---- targets: each takes hypothesis `data` and a prepared workdir -------------------------------

def setup(target: str, root: Path) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    if target in ("manifest", "manifest-endor"):
        # manifest-endor: an ENDOR pack (per-layer index tables, resident.endor, memory_length)
        pack = tiny_pack(root, encoding="endor" if target == "manifest-endor" else "dense")
        return {"pack": pack, "manifest": json.loads((pack / "manifest.json").read_text())}
    if target == "predictors":
        pack = tiny_pack(root, predictors=True)
        return {"pack": pack, "doc": json.loads((pack / "predictors.json").read_text())}
    if target == "gguf":
        path = tiny_gguf(root / "tiny.gguf")
        return {"path": path, "bytes": path.read_bytes(), "out": root / "case.gguf"}
    return {}


def _note(ctx, case):
    """Hand the case's input to the child's status file before it runs (a hang or crash is then
    reported with it)."""
    if ctx.get("note"):
        ctx["note"](json.dumps(case, default=str)[:4000])


def _write_signed(path: Path, doc, sign: bool):
    from ..pack.schema import CHECKSUM_KEY, metadata_crc32

    if sign and isinstance(doc, dict):
        doc = dict(doc)
        doc.pop(CHECKSUM_KEY, None)
        doc[CHECKSUM_KEY] = metadata_crc32(doc)
    path.write_text(json.dumps(doc))


def _run_model(pack, mode):
    import mlx.core as mx

    from ..config import FlashConfig
    from ..models.flash import build_flash_model

    model = build_flash_model(pack, FlashConfig(mode))
    mx.eval(model(mx.array([[1, 2]])))
    model.flash_runtime.loader.close()


def _run_mutated_json(data, ctx, name: str, original, run) -> None:
    """Write a mutated copy of the pack's `name` (re-signed 9 times in 10), call `run()`, restore it.

    A FlashError is the expected answer to bad metadata; anything else propagates as a finding."""
    from hypothesis import strategies as st

    doc = mutate_json(data, original)
    _write_signed(ctx["pack"] / name, doc, data.draw(st.integers(0, 9)) > 0)
    _note(ctx, doc)
    try:
        run()
    except FlashError:
        pass
    finally:
        _write_signed(ctx["pack"] / name, original, False)


def case_manifest(data, ctx):
    import numpy as np

    from ..io import FlashLoader
    from ..pack import load_pack_weights, read_manifest

    def run():
        m = read_manifest(ctx["pack"])
        load_pack_weights(ctx["pack"])
        with FlashLoader(ctx["pack"], plan=False) as loader:
            for b in m["bundles"]:
                loader.read(b["layer"], np.arange(min(3, b["count"])), loader.alloc(b["layer"], 3))
        _run_model(ctx["pack"], "naive")

    _run_mutated_json(data, ctx, "manifest.json", ctx["manifest"], run)


def case_predictors(data, ctx):
    from ..sparse.predictor import load_predictors

    def run():
        load_predictors(ctx["pack"])
        _run_model(ctx["pack"], "flash")

    _run_mutated_json(data, ctx, "predictors.json", ctx["doc"], run)


def case_gguf(data, ctx):
    import struct

    from hypothesis import strategies as st

    from ..sources.gguf import gguf_config, gguf_to_mlx, read_gguf_header

    raw = bytearray(ctx["bytes"])
    header_end = min(len(raw), 8192)
    how = data.draw(st.sampled_from(["bytes", "u32", "u64", "cut"]), label="how")
    if how == "cut":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="length")]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, header_end - 8), label="offset")
            if how == "bytes":
                raw[at] = data.draw(st.integers(0, 255))
            elif how == "u32":
                struct.pack_into("<I", raw, at, data.draw(st.sampled_from([0, 1, 3, 1000, 2 ** 31, 2 ** 32 - 1])))
            else:
                struct.pack_into("<Q", raw, at, data.draw(st.sampled_from([0, 2 ** 40, 2 ** 63, 2 ** 64 - 1])))
    ctx["out"].write_bytes(bytes(raw))
    _note(ctx, {"how": how, "length": len(raw)})
    try:
        header = read_gguf_header(ctx["out"])
        gguf_config(header)
        gguf_to_mlx(ctx["out"])
    except FlashError:
        pass


def case_kernels(data, ctx):
    """One random call of an ops entry point, kernels vs MLX twin."""
    import mlx.core as mx
    from hypothesis import strategies as st

    from ..cpu import ops

    draw = data.draw
    op = draw(st.sampled_from(["quantized_matvec", "half_matvec", "gather_matvec", "gather_matvec_t",
                               "quantized_embedding", "rms_norm", "layer_norm", "rope"]), label="op")
    dtype = draw(st.sampled_from([mx.float32, mx.float16, mx.bfloat16]), label="dtype")
    bits = draw(st.sampled_from([4, 8]))
    group = draw(st.sampled_from([32, 64, 128]))
    K = group * draw(st.integers(1, 4))
    N = draw(st.integers(0, 40))
    rows_x = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2 ** 16))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    key = mx.random.split(mx.random.key(seed), 4)
    x = (scale * mx.random.normal((rows_x, K), key=key[0])).astype(dtype)
    w_f = mx.random.normal((max(N, 1), K), key=key[1]).astype(dtype)
    wq, s, b = mx.quantize(w_f, group_size=group, bits=bits)
    n = draw(st.integers(-2, max(N, 1) + 2), label="n")
    ids = mx.array(draw(st.lists(st.integers(-2, max(N, 1) + 1), min_size=1, max_size=4), label="ids"))
    offset = draw(st.integers(0, 100), label="offset")

    def call(x, wq, s, b, w_f, dt):
        if op == "quantized_matvec":
            return ops.quantized_matvec(x, wq, s, b, group, bits)
        if op == "half_matvec":
            return ops.half_matvec(x, w_f)
        if op == "gather_matvec":
            return ops.gather_matvec(x, wq, n=n, scales=s, biases=b, group_size=group, bits=bits)
        if op == "gather_matvec_t":
            h = mx.random.normal((rows_x, max(n, 0)), key=key[2]).astype(dt)
            return ops.gather_matvec_t(h, wq, n=n, scales=s, biases=b, group_size=group, bits=bits)
        if op == "quantized_embedding":
            return ops.quantized_embedding(ids, wq, s, b, group, bits)
        if op == "rms_norm":
            return ops.rms_norm(x, mx.ones((K,), dt), 1e-5)
        if op == "layer_norm":
            return ops.layer_norm(x, mx.ones((K,), dt), mx.zeros((K,), dt), 1e-5)
        return ops.rope(x.reshape(1, 1, rows_x, K), K, traditional=False, base=10000.0, scale=1.0,
                        offset=offset)

    half = w_f.astype(mx.float16)
    f32 = (x.astype(mx.float32), wq, s.astype(mx.float32), b.astype(mx.float32), half.astype(mx.float32),
           mx.float32)
    results = []
    was = ops.kernels_active()
    for on, args in ((True, (x, wq, s, b, half, dtype)), (False, (x, wq, s, b, half, dtype)), (False, f32)):
        ops.set_kernels_enabled(on)
        try:
            y = call(*args)
            mx.eval(y)
            results.append(y)
        except ValueError as e:
            results.append(e)
        finally:
            ops.set_kernels_enabled(was)
    kernel, twin, reference = results
    if any(isinstance(r, Exception) for r in results):
        if type(kernel) is not type(twin):
            raise AssertionError(f"{op}: kernel {kernel!r} vs twin {twin!r}")
        return
    if kernel.shape != twin.shape:
        raise AssertionError(f"{op}: kernel shape {kernel.shape} vs twin {twin.shape}")
    # against the same op in float32 (MLX, kernels off): float32 summation order only; half
    # inputs and outputs: a few ulp of the output dtype (bfloat16 keeps 8 bits) of the largest
    # output and of the inputs' scale
    a, t = kernel.astype(mx.float32), reference.astype(mx.float32)
    # NaN only where the reference has it (quantized_embedding's rows for ids outside the table)
    if not mx.array_equal(mx.isnan(a), mx.isnan(t)).item():
        raise AssertionError(f"{op}: the kernel's NaNs differ from the float32 reference's")
    a, t = mx.where(mx.isnan(a), 0, a), mx.where(mx.isnan(t), 0, t)
    tol = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 6e-2}[dtype]
    bound = tol * (mx.abs(t).max().item() + scale) if t.size else 0
    if t.size and not mx.abs(a - t).max().item() <= bound:
        raise AssertionError(f"{op}: kernel and float32 reference differ by "
                             f"{mx.abs(a - t).max().item()} (> {bound})")


CASES = {"manifest": case_manifest, "manifest-endor": case_manifest, "predictors": case_predictors, "gguf": case_gguf,
         "kernels": case_kernels}


def fuzz_target(target: str, root: Path, *, max_examples=None, seconds=None, seed=None,
                on_case=None, alarm=False, note=None) -> dict:
    """Run one target with hypothesis; {"cases", "tracebacks": [text]}. Bounded by max_examples
    per batch and, with `seconds`, repeated with new seeds until the time is up."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ctx = setup(target, root)
    ctx["note"] = note
    out = {"target": target, "cases": 0, "tracebacks": []}

    def one(data):
        out["cases"] += 1
        if on_case:
            on_case(out["cases"])
        if alarm:  # a case that hangs raises TimeoutError here: a traceback naming it
            signal.alarm(CASE_TIMEOUT_S)
        try:
            CASES[target](data, ctx)
        finally:
            if alarm:
                signal.alarm(0)

    deadline = None if seconds is None else time.monotonic() + seconds
    batch = 0
    while True:
        run = settings(max_examples=max_examples or 200, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck), derandomize=seed is not None and batch == 0,
                       print_blob=False)(given(st.data())(one))
        try:
            run()
        except Exception:  # noqa: BLE001  (hypothesis re-raises the shrunk failing case)
            out["tracebacks"].append(traceback.format_exc(limit=8))
        batch += 1
        if deadline is None or time.monotonic() >= deadline:
            return out


# ---- the CLI: one child per target, so a crash is counted -----------------------------------------

def add_arguments(parser):
    parser.add_argument("--minutes", type=float, default=10.0, help="total fuzzing time (default 10)")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the counts as JSON")
    parser.add_argument("--child", default=None, help=argparse_hidden())
    parser.add_argument("--seconds", type=float, default=None, help=argparse_hidden())
    parser.add_argument("--workdir", default=None, help=argparse_hidden())


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def run(args):
    if args.child:
        return _child(args)
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise FlashError("bench fuzz: needs hypothesis (pip install 'mlx-flash-runtime[test]')") from None
    targets = [t for t in args.targets.split(",") if t]
    for t in targets:
        if t not in TARGETS:
            raise FlashError(f"--targets {t}: unknown (choose from {', '.join(TARGETS)})")
    if not args.minutes > 0:
        raise FlashError(f"--minutes {args.minutes}: must be positive")
    per_target = args.minutes * 60 / len(targets)
    report = {"command": args.command_line, "minutes": args.minutes, "targets": {}}
    for t in targets:
        report["targets"][t] = _run_child(t, per_target)
        r = report["targets"][t]
        print(f"{t}: {r['cases']} cases, {r['crashes']} crashes, {len(r['tracebacks'])} tracebacks, "
              f"{r['hangs']} hangs", file=sys.stderr)
    total = {k: sum(r[k] if k != "tracebacks" else len(r[k]) for r in report["targets"].values())
             for k in ("cases", "crashes", "tracebacks", "hangs")}
    report["total"] = total
    print(f"fuzz total: {total['cases']} cases, {total['crashes']} crashes, {total['tracebacks']} "
          f"tracebacks, {total['hangs']} hangs ({args.command_line})")
    for t, r in report["targets"].items():
        for tb in r["tracebacks"][:3]:
            print(f"--- {t} ---\n{tb}")
    if args.json:
        write_json_atomic(args.json, report)
    return 1 if total["crashes"] or total["tracebacks"] or total["hangs"] else 0


def _run_child(target, seconds) -> dict:
    """Fuzz `target` in child processes for `seconds`; a child killed by a signal is a crash and a
    new child continues until the time is up."""
    result = {"cases": 0, "crashes": 0, "hangs": 0, "tracebacks": [], "crash_cases": []}
    end = time.monotonic() + seconds
    while time.monotonic() < end - 5:
        work = Path(tempfile.mkdtemp(prefix=f"mlx-flash-fuzz-{target}-"))
        status = work / "status.json"
        cmd = [sys.executable, "-m", "mlx_flash.bench", "fuzz", "--child", target, "--workdir", str(work),
               "--seconds", str(max(1.0, end - time.monotonic() - 5))]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=end - time.monotonic() + 120)
            code = p.returncode
        except subprocess.TimeoutExpired:
            code = "hang"
        st = json.loads(status.read_text()) if status.is_file() else {}
        result["cases"] += st.get("cases", 0)
        result["tracebacks"] += st.get("tracebacks", [])
        if code == "hang":
            result["hangs"] += 1
            result["hang_cases"] = result.get("hang_cases", []) + [st.get("last_input")]
        elif code < 0 or (code != 0 and not st.get("finished")):
            result["crashes"] += 1
            result["crash_cases"].append({"signal": -code if isinstance(code, int) and code < 0 else None,
                                          "case": st.get("cases"), "input": st.get("last_input"),
                                          "stderr": (p.stderr or "")[-2000:]})
        shutil.rmtree(work, ignore_errors=True)
        if st.get("finished"):
            break
    return result


def _child(args):
    work = Path(args.workdir)
    status = work / "status.json"
    done = {"cases": 0}

    def save(extra=None):
        tmp = status.with_suffix(".tmp")
        tmp.write_text(json.dumps({**done, **(extra or {})}))
        os.replace(tmp, status)

    def on_case(n):
        done["cases"] = n
        save()

    def too_long(*_):
        raise TimeoutError(f"a case ran over {CASE_TIMEOUT_S} s")

    signal.signal(signal.SIGALRM, too_long)
    def note(case):
        done["last_input"] = case
        save()

    out = fuzz_target(args.child, work / "fixture", seconds=args.seconds, on_case=on_case, alarm=True,
                      note=note)
    done["cases"] = out["cases"]
    save({"tracebacks": out["tracebacks"], "finished": True})
    return 0

