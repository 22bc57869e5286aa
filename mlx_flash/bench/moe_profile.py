"""Where an MoE decode token's time goes, per component: `python -m mlx_flash.bench moe_profile`.

On an MoE pack (default `--mode dense`: every expert resident, EdgeMoE's IO-FREE, so no reads),
after a short prompt, each MoE decoder layer's parts are timed on their own, evaluated one at a
time on the layer's real input of a decode step: attention + norms (with the KV cache, rolled
back after), router + top-k, the experts (the SwitchGLU call with its host sync: on the CPU
kernels one primitive per call), the weighted combine; then the final norm + LM head, and whole
tokens. "Python, syncs, rest" is the whole token minus the parts. Each figure is the median over
`--repeats`, as wall time and as the process's CPU time (all threads), which a shared machine
inflates less than wall time.

  python -m mlx_flash.bench moe_profile --model PACK [--mode dense] [--repeats 10]
"""

import statistics
import time
from pathlib import Path

from ..errors import FlashError


def add_arguments(parser):
    parser.add_argument("--model", required=True, help="MoE flash pack (convert --synthetic olmoe-1b-7b)")
    parser.add_argument("--mode", default="dense", choices=("dense", "naive", "hybrid", "flash"),
                        help="runtime mode (default dense: every expert resident, no reads)")
    parser.add_argument("--memory-budget", default=None, help="budget for the streamed modes")
    parser.add_argument("--repeats", type=int, default=10, help="timings per part (median kept)")
    parser.add_argument("--prompt-tokens", type=int, default=8)


def _timed(fn, repeats):
    """(median wall ms, median CPU ms) of fn() evaluated."""
    import mlx.core as mx

    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        mx.eval(fn())
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def decode_profile(model, prompt, repeats) -> list:
    """[(part, wall ms per token, CPU ms per token)] of a decode token of an mlx-lm MoE model
    whose blocks are `model.model.layers[i]` with self_attn / input_layernorm /
    post_attention_layernorm and an MoE `mlp` (gate + switch_mlp), as olmoe, qwen3_moe, mixtral."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(b, "self_attn") and hasattr(getattr(b, "mlp", None), "switch_mlp")
                                 for b in layers):
        raise FlashError("--model: moe_profile needs decoder blocks with self_attn and an MoE mlp "
                         "(gate + switch_mlp), as olmoe / qwen3_moe")
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    tok = mx.array([[prompt[-1]]])
    parts = {name: [0.0, 0.0] for name in ("attention + norms", "router + top-k",
                                           "experts (SwitchGLU call, host sync)", "combine")}
    h = inner.embed_tokens(tok)
    mx.eval(h)
    for block, c in zip(layers, cache):
        moe = block.mlp
        k = moe.top_k if hasattr(moe, "top_k") else moe.num_experts_per_tok

        def attention(block=block, c=c, h=h):
            y = h + block.self_attn(block.input_layernorm(h), None, c)
            c.offset -= 1  # each call writes this step's position; the next call rewrites it
            return y
        x = attention()
        mx.eval(x)
        xn = block.post_attention_layernorm(x).reshape(-1, x.shape[-1])
        mx.eval(xn)

        def router(moe=moe, xn=xn, k=k):
            w = mx.softmax(moe.gate(xn), axis=-1, precise=True)
            idx = mx.argpartition(-w, kth=k - 1, axis=-1)[..., :k]
            return idx, mx.take_along_axis(w, idx, axis=-1)
        idx, scores = router()
        mx.eval(idx, scores)
        y = moe.switch_mlp(xn, idx)
        mx.eval(y)
        for name, fn in (("attention + norms", attention), ("router + top-k", router),
                         ("experts (SwitchGLU call, host sync)", lambda: moe.switch_mlp(xn, idx)),
                         ("combine", lambda: (y * scores[..., None]).sum(axis=-2))):
            wall, cpu = _timed(fn, repeats)
            parts[name][0] += wall
            parts[name][1] += cpu
        c.offset += 1  # this step's position stays written
        h = x + moe(x)
        mx.eval(h)
    head = getattr(model, "lm_head", None)
    rows = [(name, wall, cpu) for name, (wall, cpu) in parts.items()]
    rows.append(("final norm + LM head", *_timed(
        lambda: head(inner.norm(h)) if head is not None else inner.embed_tokens.as_linear(inner.norm(h)),
        repeats)))
    total = _timed(lambda: model(tok, cache=cache), repeats)
    rows.append(("Python, syncs, rest", total[0] - sum(r[1] for r in rows), total[1] - sum(r[2] for r in rows)))
    rows.append(("whole decode token", *total))
    return rows


def run(args) -> int:
    import os

    from ..config import FlashConfig
    from ..cpu import ops
    from ..models.moe import build_moe_model
    from ..pack import read_manifest

    pack = Path(args.model).expanduser()
    manifest = read_manifest(pack)
    model = build_moe_model(pack, FlashConfig(mode=args.mode, memory_budget=args.memory_budget))
    vocab = int(manifest.config.get("vocab_size", 1000))
    prompt = [(17 + 7919 * i) % vocab for i in range(args.prompt_tokens)]
    rows = decode_profile(model, prompt, args.repeats)
    total_wall, total_cpu = rows[-1][1], rows[-1][2]
    print(f"# MoE decode token by part: {pack} ({'SYNTHETIC weights, ' if manifest.synthetic else ''}"
          f"--mode {args.mode}, {len(model.model.layers)} layers), compute: "
          f"{'CPU kernels (' + str(ops.extension().num_threads()) + ' threads)' if ops.kernels_active() else 'MLX ops'}, "
          f"median of {args.repeats}; load {os.getloadavg()[0]:.1f}")
    print(f"# command: {args.command_line}")
    print("| part | wall ms/token | CPU ms/token | share of CPU |")
    print("|---|---|---|---|")
    for name, wall, cpu in rows:
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {100 * cpu / total_cpu:.0f}% |")
    print(f"whole token {total_wall:.1f} ms wall, {total_cpu:.1f} ms CPU")
    if model.moe_store is not None:
        model.moe_store.close()
    return 0
