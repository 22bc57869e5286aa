"""bench moe_profile: a decode token's parts on a tiny synthetic OLMoE pack."""

import mlx.core as mx
import pytest

from mlx_flash.bench.__main__ import main as bench_main
from mlx_flash.bench.moe_profile import decode_profile
from mlx_flash.config import FlashConfig
from mlx_flash.convert import main as convert_main
from mlx_flash.models.moe import build_moe_model


@pytest.fixture(scope="module")
def tiny_olmoe(tmp_path_factory):
    pack = tmp_path_factory.mktemp("olmoe") / "olmoe-tiny"
    assert convert_main(["--synthetic", "olmoe-tiny", "--out", str(pack)]) == 0
    return pack


@pytest.mark.parametrize("mode", ["dense", "hybrid"])
def test_parts_add_up_to_the_whole_token(tiny_olmoe, mode):
    mx.set_default_device(mx.cpu)
    model = build_moe_model(tiny_olmoe, FlashConfig(mode=mode), **({"capacity": 4} if mode == "hybrid" else {}))
    prompt, repeats = [5, 9, 300, 41], 3
    rows = decode_profile(model, prompt, repeats)
    names = [r[0] for r in rows]
    assert names == ["attention + norms", "router + top-k", "experts (SwitchGLU call, host sync)", "combine",
                     "final norm + LM head", "Python, syncs, rest", "whole decode token"]
    parts, total = rows[:-1], rows[-1]
    for i in (1, 2):  # wall, CPU: the parts and the rest make up the whole token
        assert sum(r[i] for r in parts) == pytest.approx(total[i])
    assert all(r[1] > 0 for r in rows[:5])
    if model.moe_store is not None:
        model.moe_store.close()


def test_cli_prints_the_table(tiny_olmoe, capsys):
    assert bench_main(["moe_profile", "--model", str(tiny_olmoe), "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "| experts (SwitchGLU call, host sync) |" in out and "whole token" in out
    assert "python -m mlx_flash.bench moe_profile --model" in out


def test_a_dense_pack_is_refused_in_one_line(llama_pack, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["moe_profile", "--model", str(llama_pack)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no MoE expert blocks" in err and "\n" not in err
