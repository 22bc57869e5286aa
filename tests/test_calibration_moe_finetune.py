"""calibration/moe_finetune: the dense-equivalent MoE block equals mixtral's top-k block (outputs and
router gradients); the distillation trains what it is told to, lowers the KL and resumes exactly."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from calibration_packs import write_byte_tokenizer, write_text
from mlx.utils import tree_flatten

from mlx_flash.calibration import moe_finetune as F
from mlx_flash.errors import FlashError
from mlx_flash.models import load_model
from mlx_flash.moe.moefy import moefy


def _mixtral_block(k, experts=4, hidden=32, ffn=16, seed=0):
    from mlx_lm.models.mixtral import MixtralSparseMoeBlock, ModelArgs

    args = ModelArgs(model_type="mixtral", vocab_size=64, hidden_size=hidden, intermediate_size=ffn,
                     num_hidden_layers=1, num_attention_heads=4, num_experts_per_tok=k,
                     num_local_experts=experts)
    mx.random.seed(seed)
    block = MixtralSparseMoeBlock(args)
    # logits spread enough that the top-k softmax weights differ
    block.gate.weight = block.gate.weight * 5
    mx.eval(block.parameters())
    return block


@pytest.mark.parametrize("k", [1, 2, 4])
def test_dense_equivalent_block_equals_mixtrals_top_k_block_and_its_router_gradient(k):
    block = _mixtral_block(k)
    dense = F.DenseEquivalentMoE(block)
    x = mx.random.normal((2, 7, 32), key=mx.random.key(3))
    np.testing.assert_allclose(np.array(dense(x)), np.array(block(x)), rtol=1e-5, atol=1e-5)
    # the same parameter names: a checkpoint of the dense equivalent loads into mixtral's block
    assert sorted(k for k, _ in tree_flatten(dense.parameters())) == \
        sorted(k for k, _ in tree_flatten(block.parameters()))
    probe = mx.random.normal((2, 7, 32), key=mx.random.key(4))
    grads = [nn.value_and_grad(m, lambda x: mx.sum(m(x) * probe))(x)[1] for m in (block, dense)]
    for name in ("gate", "switch_mlp"):
        for (key, want), (_, got) in zip(tree_flatten(grads[0][name]), tree_flatten(grads[1][name])):
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.fixture
def moefied(tmp_path):
    from conftest import write_tiny_llama

    src = write_tiny_llama(tmp_path / "dense", vocab=256, intermediate=64, hidden=64)
    write_byte_tokenizer(src)
    texts = [write_text(tmp_path / f"t{i}.txt", n_words=400, seed=i) for i in range(3)]
    model, config = load_model(src, lazy=False)
    tokens = np.frombuffer(texts[0].read_bytes(), np.uint8).astype(np.int32)
    moefy(model, config, tokens, src, tmp_path / "moe", experts=4, top_k=2, seq_len=64, progress=False)
    return src, tmp_path / "moe", texts


def _weights(folder):
    return dict(mx.load(str(folder / "model.safetensors")))


def _run(src, start, texts, out, **kw):
    args = dict(steps=4, lr=3e-3, warmup=0, seq_len=64, checkpoint_every=2, keep_checkpoints=0,
                progress=False, log=lambda *_: None, eval_files=[texts[2]], eval_tokens=512)
    args.update(kw)
    return F.finetune_moe(start, src, texts[:2], out, **args)


@pytest.mark.parametrize("trainable", ["routers", "experts", "both"])
def test_finetune_trains_only_what_it_is_told(moefied, tmp_path, trainable):
    src, start, texts = moefied
    report = _run(src, start, texts, tmp_path / "ft", trainable=trainable)
    before, after = _weights(start), _weights(tmp_path / "ft")
    assert before.keys() == after.keys()
    changed = {k for k in before if not np.array_equal(np.array(before[k]), np.array(after[k]))}
    routers = {k for k in before if k.endswith("block_sparse_moe.gate.weight")}
    experts = {k for k in before if ".switch_mlp." in k}
    assert (routers <= changed) == (trainable != "experts") and (not routers & changed) == (trainable == "experts")
    assert (experts <= changed) == (trainable != "routers") and (not experts & changed) == (trainable == "routers")
    assert not changed - routers - experts  # attention, norms, embeddings stay the dense model's
    assert [e["step"] for e in report["eval"]] == [0, 2, 4]
    cfg = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["moefied"]["finetune"]["trainable"] == trainable
    model, _ = load_model(tmp_path / "ft", lazy=False)  # a plain mixtral folder again
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 256)


@pytest.mark.parametrize("trainable", ["routers", "experts", "both"])
def test_steps_on_a_fixed_batch_lower_the_kl_to_the_dense_teacher(moefied, trainable):
    from mlx_flash.calibration.relufication import load_float32
    from mlx_flash.calibration.training import make_optimizer

    src, start, _ = moefied
    student, _ = F.load_student(start)
    teacher, _ = load_float32(src)
    F.set_trainable(student, trainable)
    step = F.train_step_fn(student, make_optimizer(3e-3, 0), teacher)
    tokens = mx.array(np.random.default_rng(0).integers(0, 256, (2, 48)), mx.int32)
    kl = [step(tokens)[2] for _ in range(12)]
    assert kl[-1] < 0.85 * kl[0]


def test_resume_continues_exactly_where_the_run_stopped(moefied, tmp_path):
    src, start, texts = moefied
    _run(src, start, texts, tmp_path / "whole", trainable="both")
    _run(src, start, texts, tmp_path / "split", trainable="both", steps=2)
    _run(src, start, texts, tmp_path / "split", trainable="both", resume=True)
    whole, split = _weights(tmp_path / "whole"), _weights(tmp_path / "split")
    for k in whole:
        np.testing.assert_allclose(np.array(split[k]), np.array(whole[k]), rtol=1e-6, atol=1e-7, err_msg=k)
    with pytest.raises(FlashError, match="--out .*--resume"):
        _run(src, start, texts, tmp_path / "whole", trainable="both")
    with pytest.raises(FlashError, match="--finetune-train routers"):
        _run(src, start, texts, tmp_path / "split", trainable="routers", steps=6, resume=True)


def test_refusals_before_anything_loads(moefied, tmp_path):
    src, start, texts = moefied
    with pytest.raises(FlashError, match="--resume: .* no checkpoint"):
        _run(src, start, texts, tmp_path / "none", resume=True)
    with pytest.raises(FlashError, match="--eval-text .* also training text"):
        _run(src, start, texts, tmp_path / "x", eval_files=[texts[1]])
    assert not (tmp_path / "none").exists() and not (tmp_path / "x").exists()


def test_moefy_cli_checks_its_fine_tune_flags(moefied, tmp_path, capsys):
    from mlx_flash import moefy as cli

    src, start, texts = moefied
    base = ["--model", str(src), "--out", str(tmp_path / "o")]
    for args, message in [
            (["--from-moefied", str(start), "--finetune-steps", "2"], "--finetune-text: required"),
            (["--finetune-steps", "2", "--finetune-text", str(texts[0])], "--text: required"),
            (["--from-moefied", str(start), "--text", str(texts[0])], "need --finetune-steps"),
            (["--from-moefied", str(start), "--finetune-steps", "2", "--finetune-text", str(texts[0]),
              "--eval-text", str(texts[0])], "must not repeat a --finetune-text file")]:
        with pytest.raises(SystemExit) as e:
            cli.main(base + args)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_top_k_re_routes_the_start_model_before_training(moefied, tmp_path):
    src, start, texts = moefied
    _run(src, start, texts, tmp_path / "k1", trainable="routers", steps=1, top_k=1)
    cfg = json.loads((tmp_path / "k1" / "config.json").read_text())
    assert cfg["num_experts_per_tok"] == 1 and cfg["moefied"]["top_k"] == 1
    before, after = _weights(start), _weights(tmp_path / "k1")
    for k in before:
        if k.endswith("switch_mlp.down_proj.weight"):  # mixtral's top-1 weight is 1, not ~1/2
            np.testing.assert_allclose(np.array(after[k]), np.array(before[k]) / 2, rtol=1e-6)
