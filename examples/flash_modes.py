"""Run the embedded SmolLM2-135M-Instruct from a flash pack in each mode and compare per-token costs.

    python examples/flash_modes.py [PACK]

Without PACK, the embedded model is converted into a flash pack in a temporary folder first. The
modes that need predictors (flash) run only when the pack has them (python -m mlx_flash.calibrate).
"""

import sys
import tempfile
from pathlib import Path

import mlx_flash
from mlx_flash.sources import resolve_model
from mlx_flash.pack import write_pack


def run(pack, mode, budget, question="Name three colors.", max_tokens=24):
    """Generate in `mode` under `budget`; returns (text, model.flash_stats.summary())."""
    model, tokenizer = mlx_flash.load(str(pack), mode=mode, memory_budget=budget)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    model.flash_stats.reset()
    text = mlx_flash.generate(model, tokenizer, prompt, max_tokens=max_tokens)
    model.flash_stats.finish()
    return text, model.flash_stats.summary()


def main(pack=None):
    with tempfile.TemporaryDirectory() as tmp:
        if pack is None:
            pack = write_pack(resolve_model(None), Path(tmp) / "pack", progress=False)
        modes = [("dense", None), ("naive", None), ("hybrid", 0.65)]
        if (Path(pack) / "predictors.json").exists():
            modes.append(("flash", 0.65))
        print(f"{'mode':8} {'budget':>6} {'ms/token':>9} {'I/O ms':>7} {'MB read':>8} {'hit rate':>8}  text")
        for mode, budget in modes:
            text, s = run(pack, mode, budget)
            hit = "n/a" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.0f}%"
            print(f"{mode:8} {budget or '':>6} {s['total_ms']:9.1f} {s['io_ms']:7.1f} "
                  f"{s['bytes_read'] / 1e6:8.2f} {hit:>8}  {text.strip()[:40]!r}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
