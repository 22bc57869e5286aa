"""bench/early_reads.py: recall and precision of early-read candidates on a tiny CATS pack."""

import pytest

from mlx_flash.bench import early_reads
from mlx_flash.errors import FlashError
from mlx_flash.models.flash import build_flash_model


def test_candidates_are_counted_against_the_runtimes_own_masks(tiny_llama, tmp_path, capsys):
    """Every layer sparse (no budget). The exact masks counted are the runtime's (its needed neurons per sparse layer, the same
    tokens); true positives never exceed either side; a lower cut predicts and recalls at least
    as much; the hot set predicts as many neurons as a layer needs on average; the CLI prints a
    row per candidate and layer group."""
    from calibration_packs import tiny_cats_pack, write_text
    from mlx_flash import calibrate as calibrate_cli

    pack = tiny_cats_pack(tiny_llama, tmp_path, [0.03, 0.05, 0.04, 0.06], gate_bits=4)
    texts = [write_text(tmp_path / f"t{i}.txt", n_words=300, seed=i) for i in range(3)]
    assert calibrate_cli.main(["--model", str(pack), "--text", *map(str, texts[:2]), "--kind", "gate-threshold",
                               "--quiet"]) == 0
    result = early_reads.measure(pack, [texts[2]], max_tokens=80, warmup=8, memory_budget=None,
                                 scales=(0.8, 1.0))
    sparse = [j for j, k in result["kinds"].items() if k == "sparse"]
    assert sparse and set(result["needed"]) == set(sparse)
    counts = result["counts"]
    assert sorted(counts) == ["ahead x0.8", "ahead x1", "hot", "pre x0.8", "pre x1"]
    for j in sparse:
        assert counts["pre x1"][j][2] == result["needed"][j] > 0  # exact: the runtime's masks
    for name, per_layer in counts.items():
        for tp, predicted, exact, tokens in per_layer.values():
            assert tokens == 72 and tp <= min(predicted, exact)
    for kind in ("pre", "ahead"):
        for j in counts[f"{kind} x1"]:
            low, high = counts[f"{kind} x0.8"][j], counts[f"{kind} x1"][j]
            assert low[1] >= high[1] and low[0] >= high[0]
    assert sum(c[0] for c in counts["pre x0.8"].values()) > sum(c[0] for c in counts["pre x1"].values())
    for j, (tp, predicted, exact, tokens) in counts["hot"].items():
        assert abs(predicted / tokens - exact / tokens) <= 0.25 * exact / tokens + 2
    summary = early_reads.summarise(result, sparse)
    assert 0 < summary["pre x1"][0] <= 1 and 0 < summary["pre x1"][1] <= 1

    class Args:
        model, text, max_tokens, warmup, scales, json = str(pack), [str(texts[2])], 80, 8, "1.0", None
        memory_budget = None
    assert early_reads.run(Args()) == 0
    out = capsys.readouterr().out
    assert "| pre x1 | sparse (" in out and "| ahead x1 | sparse (" in out and "| hot | sparse (" in out


def test_a_pack_without_gate_threshold_predictors_is_refused(tiny_llama, tmp_path):
    from calibration_packs import tiny_cats_pack

    pack = tiny_cats_pack(tiny_llama, tmp_path, [0.03, 0.05, 0.04, 0.06], gate_bits=4)
    with pytest.raises(FlashError, match="predictors"):
        early_reads.measure(pack, [], max_tokens=80)
    assert build_flash_model  # the flash model itself builds from such packs (other tests)
