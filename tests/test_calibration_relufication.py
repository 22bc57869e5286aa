"""calibration/relufication: the activation swap, training steps, checkpoints and --resume, on tiny random
llamas with a byte tokenizer."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_flash.errors import FlashError
from mlx_flash.calibration import relufication as R
from calibration_packs import CHAT_TEMPLATE, write_byte_tokenizer, write_chat_template, write_text


@pytest.fixture
def src(tiny_llama):
    folder = tiny_llama("src", vocab=256, intermediate=96)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture
def texts(tmp_path):
    return [write_text(tmp_path / f"t{i}.txt", n_words=300, seed=i) for i in range(2)]


@pytest.mark.parametrize("spec", ["relu", "fatrelu:0.05", "drelu", "cats:0.1", "product:0.05"])
def test_swap_computes_the_relu_family_ffn_by_hand(src, spec):
    teacher, config = R.load_float32(src)
    act, t = R.parse_activation(spec)
    model = R.build_model(R.relufied_config(config, act, t), dict(tree_flatten(teacher.parameters())))
    x = mx.random.normal((2, 5, 64), key=mx.random.key(1))
    for i, layer in enumerate(model.layers):
        w = {n: np.array(teacher.layers[i].mlp[n].weight) for n in ("gate_proj", "up_proj", "down_proj")}
        g, u = np.array(x) @ w["gate_proj"].T, np.array(x) @ w["up_proj"].T
        if act == "relu":
            h = np.maximum(g, 0) * u
        elif act == "fatrelu":
            h = np.where(g > t, g, 0) * u
        elif act == "cats":
            a = g / (1 + np.exp(-g))
            h = np.where(np.abs(a) > t, a, 0) * u
        elif act == "product":
            p = g / (1 + np.exp(-g)) * u
            h = np.where(np.abs(p) > t, p, 0)
            assert 0 < (h == 0).mean() < 1  # the threshold silences some values, not all
        else:
            h = np.maximum(g, 0) * np.maximum(u, 0)
        want = h @ w["down_proj"].T
        np.testing.assert_allclose(np.array(layer.mlp(x)), want, rtol=1e-4, atol=1e-5)
    # the whole model runs the swapped MLPs: its logits differ from the SiLU original's
    tokens = mx.array([[1, 2, 3, 4]])
    assert not mx.allclose(model(tokens), teacher(tokens), atol=1e-4).item()


def test_parse_activation_rejects_bad_specs():
    assert R.parse_activation("fatrelu:0.25") == ("fatrelu", 0.25)
    assert R.parse_activation("fatrelu") == ("fatrelu", None)  # per-layer, from --target-sparsity
    assert R.parse_activation("cats:0.1") == ("cats", 0.1) and R.parse_activation("cats") == ("cats", None)
    assert R.parse_activation("product:0.2") == ("product", 0.2) and R.parse_activation("product") == ("product", None)
    for bad in ("gelu", "relu:0.1", "relu:", "fatrelu:x", "fatrelu:-1", "cats:-0.5", "drelu:1", "product:-1"):
        with pytest.raises(FlashError, match="--activation"):
            R.parse_activation(bad)


def test_learning_rate_warms_up_then_decays_along_a_cosine_or_holds():
    def rates(opt, steps):
        return [float(opt._schedulers["learning_rate"](mx.array(s)).item()) for s in steps]

    cosine = R.make_optimizer(1e-3, warmup=10, steps=110, decay="cosine")
    warm, peak, mid, last = rates(cosine, [0, 10, 60, 110])
    assert warm == pytest.approx(1e-4) and peak == pytest.approx(1e-3)
    assert mid == pytest.approx(0.55e-3, rel=1e-4)  # halfway down the cosine to 10%
    assert last == pytest.approx(1e-3 * R.FINAL_LR_FRACTION)
    constant = R.make_optimizer(1e-3, warmup=10, steps=110, decay="constant")
    assert rates(constant, [10, 60, 110]) == pytest.approx([1e-3] * 3)
    with pytest.raises(FlashError, match="--decay"):
        R.make_optimizer(1e-3, warmup=10, steps=110, decay="linear")


def test_training_steps_reduce_the_loss_on_a_fixed_batch(src):
    teacher, config = R.load_float32(src)
    model = R.build_model(R.relufied_config(config, "relu", 0.0), dict(tree_flatten(teacher.parameters())))
    R.freeze_embeddings(model)
    step = R.train_step_fn(model, R.make_optimizer(3e-3, warmup=0), teacher, distill=0.5)
    batch = mx.array(np.random.default_rng(0).integers(0, 256, (2, 32)), dtype=mx.int32)
    embed = np.array(model.model.embed_tokens.weight)
    losses = [step(batch) for _ in range(6)]
    assert losses[-1][0] < 0.9 * losses[0][0], losses
    assert all(0 < sparsity < 1 and kl >= 0 and hid == 0 for _, _, kl, hid, sparsity in losses)
    np.testing.assert_array_equal(np.array(model.model.embed_tokens.weight), embed)  # frozen


def _params(folder):
    return dict(mx.load(str(folder / "model.safetensors")))


def test_checkpoint_and_resume_continue_where_the_run_stopped(src, texts, tmp_path):
    kw = dict(activation="relu", batch_size=1, seq_len=32, lr=1e-3, warmup=2, distill=0.0,
              checkpoint_every=2, progress=False, log=lambda *a: None)
    straight = R.relufy(src, texts, tmp_path / "straight", steps=4, **kw)
    R.relufy(src, texts, tmp_path / "split", steps=2, **kw)
    assert [d.name for d in R.checkpoint_dirs(tmp_path / "split")] == ["step-000002"]
    resumed = R.relufy(src, texts, tmp_path / "split", steps=4, resume=True, **kw)
    assert straight["steps"] == resumed["steps"] == 4
    assert straight["tokens_trained"] == resumed["tokens_trained"] == 4 * 32
    a, b = _params(tmp_path / "straight"), _params(tmp_path / "split")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    # the final model differs from the swapped start (training happened)
    start = dict(tree_flatten(R.load_float32(src)[0].parameters()))
    assert not np.allclose(np.array(a["model.layers.0.mlp.gate_proj.weight"]),
                           np.array(start["model.layers.0.mlp.gate_proj.weight"]))
    # only the newest checkpoint keeps the optimizer state; each one is a loadable model folder
    ckpts = R.checkpoint_dirs(tmp_path / "split")
    assert [d.name for d in ckpts] == ["step-000002", "step-000004"]
    assert not (ckpts[0] / R.OPTIMIZER_FILE).exists() and (ckpts[1] / R.OPTIMIZER_FILE).exists()
    assert json.loads((ckpts[1] / R.TRAINER_JSON).read_text())["step"] == 4


def test_keep_checkpoints_deletes_the_older_ones_and_resumes_from_the_newest(src, texts, tmp_path):
    kw = dict(activation="relu", seq_len=32, lr=1e-3, warmup=0, checkpoint_every=1, keep_checkpoints=2,
              progress=False, log=lambda *a: None)
    write_chat_template(src)
    R.relufy(src, texts[:1], tmp_path / "run", steps=3, **kw)
    ckpts = R.checkpoint_dirs(tmp_path / "run")
    assert [d.name for d in ckpts] == ["step-000002", "step-000003"]
    for folder in (ckpts[-1], tmp_path / "run"):  # each a model folder with the source's chat template
        assert (folder / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert (ckpts[-1] / R.OPTIMIZER_FILE).exists() and (tmp_path / "run" / R.WEIGHTS_FILE).exists()
    assert not [p for p in (tmp_path / "run" / R.CHECKPOINTS).iterdir() if p.name.startswith(".")]
    R.relufy(src, texts[:1], tmp_path / "run", steps=5, resume=True, **kw)
    assert [d.name for d in R.checkpoint_dirs(tmp_path / "run")] == ["step-000004", "step-000005"]
    rows = R.curve(tmp_path / "run", [texts[1]], eval_tokens=64, seq_len=32, progress=False)
    assert [r["step"] for r in rows] == ["original", "swapped", 4, 5]
    (R.checkpoint_dirs(tmp_path / "run")[0] / R.TRAINER_JSON).write_text("[4]")  # damaged
    with pytest.raises(FlashError, match=r"step-000004/trainer\.json: not a JSON object \(an array\)$"):
        R.curve(tmp_path / "run", [texts[1]], eval_tokens=64, seq_len=32, progress=False)
    with pytest.raises(FlashError, match="--keep-checkpoints -1"):
        R.relufy(src, texts, tmp_path / "x", steps=1, **dict(kw, keep_checkpoints=-1))


def test_restore_trainer_names_a_damaged_trainer_json(tmp_path):
    import mlx.optimizers as optim

    ckpt = tmp_path / "step-000003"
    ckpt.mkdir()
    optimizer = optim.Adam(learning_rate=1e-3)
    mx.save_safetensors(str(ckpt / R.OPTIMIZER_FILE), {"step": mx.array(3)})
    (ckpt / R.TRAINER_JSON).write_text(json.dumps({"step": 3, "tokens_trained": 96}))
    assert R.restore_trainer(ckpt, optimizer) == {"step": 3, "tokens_trained": 96}
    assert optimizer.state["step"].item() == 3
    (ckpt / R.TRAINER_JSON).write_text('{"step": 3, "tok')  # cut short
    with pytest.raises(FlashError) as e:
        R.restore_trainer(ckpt, optimizer)
    assert str(e.value).startswith(f"{ckpt / R.TRAINER_JSON}: not JSON (") and "\n" not in str(e.value)


def test_prune_checkpoints_never_deletes_the_newest_written(tmp_path):
    root = tmp_path / R.CHECKPOINTS
    for step in (1, 2, 3, 7):
        (root / f"step-{step:06d}").mkdir(parents=True)
        (root / f"step-{step:06d}" / R.TRAINER_JSON).write_text("{}")
    (root / ".step-000000.deleting-1" / "sub").mkdir(parents=True)  # an interrupted delete's leftover
    # the one just written sorts before a leftover newer one: it stays all the same
    deleted = R.prune_checkpoints(tmp_path, 1, root / "step-000003")
    assert [d.name for d in deleted] == ["step-000001", "step-000002"]
    assert sorted(p.name for p in root.iterdir()) == ["step-000003", "step-000007"]


def test_resume_and_out_refusals(src, texts, tmp_path):
    kw = dict(steps=1, seq_len=32, checkpoint_every=1, progress=False, log=lambda *a: None)
    with pytest.raises(FlashError, match="--resume: .* no checkpoint"):
        R.relufy(src, texts, tmp_path / "none", resume=True, **kw)
    R.relufy(src, texts, tmp_path / "run", **kw)
    with pytest.raises(FlashError, match="--out .* already exists"):
        R.relufy(src, texts, tmp_path / "run", **kw)
    with pytest.raises(FlashError, match="trained with hidden_act"):
        R.relufy(src, texts, tmp_path / "run", activation="drelu", resume=True, **dict(kw, steps=2))
    with pytest.raises(FlashError, match="--eval-text .* also training text"):
        R.relufy(src, texts, tmp_path / "x", eval_files=[texts[0]], **kw)


def test_split_by_file_is_deterministic_and_disjoint(tmp_path):
    files = [str(tmp_path / f"f{i:02d}.txt") for i in range(25)]
    train, held = R.split_by_file(reversed(files))
    assert held == [files[0], files[10], files[20]] and not set(train) & set(held)
    assert len(train) + len(held) == 25


def test_batches_depend_only_on_step_and_seed():
    a = [R.batch_indices(s, 3, 10, seed=1) for s in range(8)]
    assert all(np.array_equal(x, R.batch_indices(s, 3, 10, seed=1)) for s, x in enumerate(a))
    assert sorted(np.concatenate(a[:3]).tolist() + [a[3][0]]) == list(range(10))  # epoch 0 is a permutation


def test_measure_counts_zero_hidden_values(src, texts):
    from mlx_flash.models import load_tokenizer

    teacher, config = R.load_float32(src)
    model = R.build_model(R.relufied_config(config, "fatrelu", 1e9), dict(tree_flatten(teacher.parameters())))
    seqs = R.text_sequences(texts, load_tokenizer(src), 32, 128)
    r = R.measure(model, seqs)
    assert r["sparsity"] == 1.0 and r["tokens"] == 4 * 31  # nothing passes an infinite threshold
    dense = R.measure(teacher, seqs)
    assert dense["sparsity"] is None and dense["ppl"] > 1


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_measure_is_the_perplexity_of_every_next_token_in_uneven_batches(arch, tiny_llama, tmp_path):
    from conftest import write_tiny_moe

    from mlx_flash.models import load_model

    folder = tiny_llama("dense") if arch == "llama" else write_tiny_moe(tmp_path / "moe", "mixtral")
    model, _ = load_model(folder, lazy=False)
    seqs = np.random.default_rng(0).integers(0, 128, (5, 24)).astype(np.int32)
    r = R.measure(model, seqs, batch_size=2)  # batches of 2, 2, 1 sequences
    tokens = mx.array(seqs)
    want = float(mx.exp(mx.mean(R.next_token_nll(model(tokens), tokens))).item())
    assert r["tokens"] == 5 * 23 and r["ppl"] == pytest.approx(want, rel=1e-5)
    assert r["sparsity"] is None and r["sparsity_per_layer"] is None


@pytest.mark.parametrize("activation", ["fatrelu", "cats"])
def test_target_sparsity_sets_per_layer_thresholds_kept_on_resume(src, texts, tmp_path, activation):
    kw = dict(activation=activation, target_sparsity=0.8, seq_len=32, checkpoint_every=1, lr=1e-3,
              progress=False, log=lambda *a: None)
    R.relufy(src, texts[:1], tmp_path / "run", steps=1, eval_files=texts[1:], eval_tokens=128, **kw)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    t = config["activation_threshold"]
    assert isinstance(t, list) and len(t) == 2 and all(v > 0 for v in t)
    report = json.loads((tmp_path / "run" / R.REPORT_JSON).read_text())
    assert 0.7 < report["before"]["swapped"]["sparsity"] < 0.9  # held-out text, thresholds from training text
    R.relufy(src, texts[:1], tmp_path / "run", steps=2, resume=True, **kw)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["activation_threshold"] == t
    with pytest.raises(FlashError, match="--target-sparsity"):
        R.relufy(src, texts[:1], tmp_path / "x", steps=1, **dict(kw, activation="relu"))


def test_relufied_pack_calibrates_and_runs_flash_with_exact_gate_masks(src, texts, tmp_path):
    """A FATReLU model (per-layer thresholds) through convert + calibrate (resident gate, exact
    masks): flash mode, every layer sparse, computes dense's logits while skipping neurons."""
    from calibration_packs import decode_logits
    from mlx_flash.calibration.fit import calibrate
    from mlx_flash.calibration.quality import load_mode
    from mlx_flash.pack import write_pack

    out = tmp_path / "relufied"
    R.relufy(src, texts, out, activation="fatrelu", target_sparsity=0.7, steps=1, seq_len=32,
             checkpoint_every=0, progress=False, log=lambda *a: None)
    pack = write_pack(out, tmp_path / "pack", progress=False)
    calibrate(pack, texts, kind="gate-threshold", target_sparsity=0.0, progress=False)
    doc = json.loads((pack / "predictors.json").read_text())
    thresholds = json.loads((out / "config.json").read_text())["activation_threshold"]
    assert [e["activation"] for e in doc["layers"].values()] == [f"fatrelu:{t}" for t in thresholds]
    assert all(e["stats"]["active"] < 0.4 for e in doc["layers"].values())  # ~30% active by design
    ids = [5, 17, 99, 3, 42, 7]
    dense = decode_logits(load_mode(pack, "dense")[0], ids)
    model = load_mode(pack, "flash", all_sparse=True)[0]
    flash = decode_logits(model, ids)
    np.testing.assert_allclose(flash, dense, rtol=1e-4, atol=1e-4)
    s = model.flash_stats.summary()
    assert s["neurons_loaded"] < 0.6 * 2 * 96  # most neurons of the 2 layers never read


def test_low_rank_gate_keeps_its_recall_on_a_fatrelu_model(src, texts, tmp_path):
    """FATReLU is zero below its threshold, so |act(estimate)| cannot rank the neurons the estimate
    puts just under it; the predictor scores the estimate itself and keeps --recall."""
    from mlx_flash.calibration.fit import calibrate
    from mlx_flash.pack import write_pack

    out = tmp_path / "relufied"
    R.relufy(src, texts, out, activation="fatrelu", target_sparsity=0.8, steps=1, seq_len=32,
             checkpoint_every=0, progress=False, log=lambda *a: None)
    pack = write_pack(out, tmp_path / "pack", progress=False)
    doc = calibrate(pack, texts, kind="low-rank-gate", rank=8, recall=0.99, target_sparsity=0.0,
                    progress=False)
    recalls = [e["stats"]["recall"] for e in doc["layers"].values()]
    assert min(recalls) > 0.9, recalls


def test_layerwise_fit_solves_each_layers_ridge_least_squares_toward_the_teacher(src, texts):
    from mlx_flash.models import load_tokenizer

    teacher, config = R.load_float32(src)
    seqs = R.text_sequences(texts, load_tokenizer(src), 32, 256)
    thresholds = R.gate_thresholds(teacher, seqs[:2], 0.8)
    student = R.build_model(R.relufied_config(config, "fatrelu", thresholds),
                            dict(tree_flatten(teacher.parameters())))
    tokens = mx.array(seqs)
    before = float(mx.mean(mx.square(student.model(tokens) - teacher.model(tokens))).item())
    fit = R.fit_layerwise(teacher, student, seqs, ridge=1e-3, progress=False)
    # layer 1 by hand: its input is the fitted student's layer 0 output; target = the teacher's
    # residual stream after layer 1 - the student's after layer 1's attention
    e = student.model.embed_tokens(tokens)
    s_in, t_in = student.layers[0](e, "causal"), teacher.layers[0](e, "causal")
    block = student.layers[1]
    mid = s_in + block.self_attn(block.input_layernorm(s_in), "causal")
    x = block.post_attention_layernorm(mid)
    g, u = np.array(block.mlp.gate_proj(x)), np.array(block.mlp.up_proj(x))
    h = (np.where(g > thresholds[1], g, 0) * u).reshape(-1, g.shape[-1]).astype(np.float64)
    target = np.array(teacher.layers[1](t_in, "causal") - mid).reshape(h.shape[0], -1).astype(np.float64)
    gram = h.T @ h
    want = np.linalg.solve(gram + 1e-3 * np.mean(np.diag(gram)) * np.eye(len(gram)), h.T @ target).T
    got = np.array(block.mlp.down_proj.weight)
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert fit["tokens"] == seqs.size and len(fit["relative_error"]) == len(student.layers)
    after = float(mx.mean(mx.square(student.model(tokens) - teacher.model(tokens))).item())
    assert after < 0.5 * before, (before, after)
    # gate, up and thresholds untouched: the sparsity is the swap's
    np.testing.assert_array_equal(np.array(student.layers[1].mlp.gate_proj.weight),
                                  np.array(teacher.layers[1].mlp.gate_proj.weight))


def test_relufy_layerwise_fit_is_checkpoint_step_0_and_counts_its_tokens(src, texts, tmp_path):
    kw = dict(activation="fatrelu", target_sparsity=0.8, seq_len=32, checkpoint_every=1, lr=1e-3,
              layerwise_tokens=64, progress=False, log=lambda *a: None)
    report = R.relufy(src, texts[:1], tmp_path / "run", steps=1, **kw)
    ckpts = R.checkpoint_dirs(tmp_path / "run")
    assert [d.name for d in ckpts] == ["step-000000", "step-000001"]
    state = json.loads((ckpts[0] / R.TRAINER_JSON).read_text())
    assert state["layerwise"]["tokens"] == 64 and state["tokens_trained"] == 64
    # the fit's sequences are the epoch's last: the first training steps see other text
    n = state["train_sequences"]
    assert sorted(state["layerwise"]["sequences"]) == sorted(R.batch_indices(n - 2, 1, n, 0).tolist() + R.batch_indices(n - 1, 1, n, 0).tolist())
    assert report["tokens_trained"] == 64 + 32 and report["seconds"] >= state["seconds"] > 0
    rows = R.curve(tmp_path / "run", [texts[1]], eval_tokens=64, seq_len=32, original=src, progress=False)
    assert "| layer-wise fit | 64 |" in R.format_curve(rows)


def test_ce_and_kl_equal_the_reference_losses():
    rng = np.random.default_rng(0)
    s, t = (mx.array(rng.normal(0, 3, (2, 7, 50)).astype(np.float32)) for _ in range(2))
    tokens = mx.array(rng.integers(0, 50, (2, 7)), dtype=mx.int32)
    ce, kl = R.ce_and_kl(s, tokens, t)
    assert ce.item() == pytest.approx(mx.mean(R.next_token_nll(s, tokens)).item(), rel=1e-5)
    assert kl.item() == pytest.approx(R.distill_kl(s, t).item(), rel=1e-4)
    assert R.ce_and_kl(s, tokens, None)[1].item() == 0
    # same gradients too
    ref = mx.grad(lambda x: mx.mean(R.next_token_nll(x, tokens)) + R.distill_kl(x, t))(s)
    got = mx.grad(lambda x: sum(R.ce_and_kl(x, tokens, t)))(s)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-6)


def _swapped(src, act="cats", threshold=0.05):
    teacher, config = R.load_float32(src)
    model = R.build_model(R.relufied_config(config, act, threshold), dict(tree_flatten(teacher.parameters())))
    R.freeze_embeddings(model)
    return teacher, model


@pytest.mark.parametrize("hidden", [0.0, 0.5])
def test_compiled_step_updates_the_model_as_the_eager_step_does(src, hidden):
    """The mx.compile'd step with the fused loss takes the eager reference step's AdamW updates
    (model and optimizer state in and out of the compiled function), step after step."""
    teacher, eager_model = _swapped(src)
    compiled_model = _swapped(src)[1]
    eager = R.train_step_fn(eager_model, R.make_optimizer(3e-3, warmup=2), teacher, distill=0.5,
                            hidden=hidden, compiled=False, fused_loss=False)
    compiled = R.train_step_fn(compiled_model, R.make_optimizer(3e-3, warmup=2), teacher, distill=0.5,
                               hidden=hidden, compiled=True)
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = mx.array(rng.integers(0, 256, (2, 32)), dtype=mx.int32)
        want, got = eager(batch), compiled(batch)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
        assert (want[3] > 0) == (hidden > 0)
    a, b = dict(tree_flatten(eager_model.parameters())), dict(tree_flatten(compiled_model.parameters()))
    for k in a:
        np.testing.assert_allclose(np.array(b[k]), np.array(a[k]), rtol=1e-3, atol=1e-5, err_msg=k)
    start = dict(tree_flatten(teacher.parameters()))
    assert not np.allclose(np.array(a["model.layers.1.mlp.up_proj.weight"]),
                           np.array(start["model.layers.1.mlp.up_proj.weight"]))


def test_forward_hidden_gives_the_models_logits_and_residual_streams(src):
    teacher, model = _swapped(src)
    tokens = mx.array([[1, 5, 9, 2, 7]])
    logits, streams = R.forward_hidden(model, tokens)
    np.testing.assert_allclose(np.array(logits), np.array(model(tokens)), rtol=1e-5, atol=1e-5)
    assert len(streams) == len(model.layers)
    h = model.model.embed_tokens(tokens)
    for layer, stream in zip(model.layers, streams):
        h = layer(h, "causal")
        np.testing.assert_allclose(np.array(stream), np.array(h), rtol=1e-5, atol=1e-6)
    t_logits, t_streams = R.forward_hidden(teacher, tokens)
    assert R.hidden_mse(t_streams, t_streams).item() == 0
    s, t = streams[0], t_streams[0]
    want = np.mean([np.mean(np.square(np.array(a) - np.array(b))) / np.mean(np.square(np.array(b)))
                    for a, b in zip(streams, t_streams)])
    assert R.hidden_mse(streams, t_streams).item() == pytest.approx(want, rel=1e-4) and want > 0


def test_hidden_distillation_pulls_the_residual_streams_toward_the_teacher(src):
    batch = mx.array(np.random.default_rng(0).integers(0, 256, (2, 32)), dtype=mx.int32)
    errors = []
    for hidden in (0.0, 100.0):
        teacher, model = _swapped(src, threshold=0.2)
        step = R.train_step_fn(model, R.make_optimizer(3e-4, warmup=0), teacher, distill=0.0, hidden=hidden)
        for _ in range(6):
            step(batch)
        errors.append(R.hidden_mse(R.forward_hidden(model, batch)[1], R.forward_hidden(teacher, batch)[1]).item())
    assert errors[1] < 0.5 * errors[0], errors


def test_allocate_sparsity_keeps_the_mean_and_spares_the_costly_layers():
    levels = [0.7, 0.8, 0.9]
    kl = np.array([[0.01, 0.02, 0.04],     # cheap layer
                   [0.10, 0.40, 1.60],     # costly layer
                   [0.01, 0.02, 0.04]])
    targets = R.allocate_sparsity(kl, levels, 0.8, step=0.01)
    assert np.mean(targets) == pytest.approx(0.8, abs=0.01)
    assert targets[1] < 0.8 < targets[0] and targets[0] == pytest.approx(targets[2], abs=0.011)
    flat = R.allocate_sparsity(np.ones((3, 3)) * [1, 2, 4], levels, 0.8, step=0.01)
    assert max(flat) - min(flat) <= 0.011  # equal costs: equal targets
    with pytest.raises(FlashError, match="--target-sparsity 0.95"):
        R.allocate_sparsity(kl, levels, 0.95)


def test_attention_half_plus_the_mlp_is_the_decoder_layer(src):
    model, _ = R.load_float32(src)
    h = mx.random.normal((2, 7, model.args.hidden_size), key=mx.random.key(0))
    block = model.layers[1]
    # distinct norm weights, so swapping the two norms shows
    block.input_layernorm.weight = mx.linspace(0.5, 1.5, model.args.hidden_size)
    block.post_attention_layernorm.weight = mx.linspace(2.0, 0.2, model.args.hidden_size)
    mid, x = R.attention_half(block, h)
    np.testing.assert_array_equal(np.array(mid + block.mlp(x)), np.array(block(h, "causal")))
    np.testing.assert_array_equal(np.array(x), np.array(block.post_attention_layernorm(mid)))


@pytest.mark.parametrize("act", ["fatrelu", "cats", "product"])
def test_gate_thresholds_are_quantiles_of_what_each_activation_thresholds(src, texts, act):
    from mlx_flash.models import load_tokenizer

    teacher, config = R.load_float32(src)
    seqs = R.text_sequences(texts, load_tokenizer(src), 32, 128)
    t = R.gate_thresholds(teacher, seqs, 0.7, act)
    # the model built with them silences 70% of its hidden values on the same tokens
    model = R.build_model(R.relufied_config(config, act, t), dict(tree_flatten(teacher.parameters())))
    sparsity = R.measure(model, seqs, batch_size=len(seqs))["sparsity_per_layer"]
    np.testing.assert_allclose(sparsity, 0.7, atol=0.02)


def test_layer_sensitivity_is_the_kl_of_thresholding_one_layer(src, texts):
    from mlx_flash.models import load_tokenizer

    teacher, config = R.load_float32(src)
    seqs = R.text_sequences(texts, load_tokenizer(src), 32, 128)
    levels = (0.5, 0.9)
    kl = R.layer_sensitivity(teacher, seqs, levels)
    assert kl.shape == (2, 2) and (kl[:, 1] > kl[:, 0]).all() and (kl > 0).all()
    # layer 1 at 0.9 by hand: a CATS model whose other layer keeps every value (threshold 0 = SiLU)
    t = R.gate_thresholds(teacher, seqs, 0.9, "cats")
    one = R.build_model(R.relufied_config(config, "cats", [0.0, t[1]]), dict(tree_flatten(teacher.parameters())))
    tokens = mx.array(seqs)
    assert kl[1, 1] == pytest.approx(R.distill_kl(one(tokens), teacher(tokens)).item(), rel=1e-3)


def test_relufy_sensitivity_allocation_sets_per_layer_targets(src, texts, tmp_path):
    kw = dict(activation="cats", target_sparsity=0.8, seq_len=32, checkpoint_every=1, lr=1e-3,
              progress=False, log=lambda *a: None)
    R.relufy(src, texts[:1], tmp_path / "run", steps=1, allocation="sensitivity", allocation_tokens=64, **kw)
    state = json.loads((R.checkpoint_dirs(tmp_path / "run")[-1] / R.TRAINER_JSON).read_text())
    targets = state["allocation"]["targets"]
    assert len(targets) == 2 and np.mean(targets) == pytest.approx(0.8, abs=0.005)
    assert np.array(state["allocation"]["kl"]).shape == (2, len(R.SENSITIVITY_LEVELS))
    teacher, _ = R.load_float32(src)
    from mlx_flash.models import load_tokenizer

    seqs = R.text_sequences(texts[:1], load_tokenizer(src), 32)
    want = R.gate_thresholds(teacher, seqs[:4], targets, "cats")
    got = json.loads((tmp_path / "run" / "config.json").read_text())["activation_threshold"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(FlashError, match="--sparsity-allocation"):
        R.relufy(src, texts[:1], tmp_path / "x", steps=1, allocation="sensitivity",
                 **dict(kw, activation="fatrelu"))
