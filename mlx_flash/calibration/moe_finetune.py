"""End-to-end distillation of a derived MoE (moe/moefy.py's mixtral folder) from its dense source.

moefy splits each FFN into experts and fits each router by ridge regression on a few thousand
tokens, layer by layer: nothing trains the model as a whole, so the routing is chaotic (a small
error early changes which experts the deep layers pick). Here the MoE (the student) is trained
end to end toward the dense model it came from (the teacher): loss = KL(teacher || student) of
the next-token distributions + `ce_weight` x next-token cross-entropy, with AdamW on the routers
(`trainable="routers"`), the experts' weights ("experts") or both ("both"); attention, norms and
embeddings stay the dense model's.

Speed: during training each MoE block runs as its dense equivalent (`DenseEquivalentMoE`): the
16 experts together are the dense FFN's neurons, so the block is three dense matmuls over all of
them with each expert's hidden values scaled by its top-k softmax weight (0 off the top-k): the
same outputs as mlx-lm's SwitchGLU on the top-k (tested), large matmuls instead of gathers.
Float32 (on Linux: OpenBLAS preloaded), the shared compiled step of calibration/training.py.
"""

import random
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import FlashError
from ..model_folder import read_config
from ..paths import write_json_atomic
from .training import (SEQ_LEN, ce_and_kl, checkpoint_dirs, compiled_update, kernels_off,
                       make_optimizer, restore_trainer, save_checkpoint, start_run, text_sequences,
                       train_loop, write_model_folder)

TRAINABLE = ("routers", "experts", "both")  # what AdamW moves: routers, experts' weights, or both
REPORT_JSON = "moe_finetune.json"


class DenseEquivalentMoE(nn.Module):
    """Stands in for mlx-lm's MixtralSparseMoeBlock (same call x -> y, same parameter names
    `gate` and `switch_mlp`, so checkpoints load into the mixtral model): the top-k experts by
    router logit, each weighted by the softmax over the top-k logits, computed as the dense FFN of
    all experts' neurons with every expert's hidden values times its weight (0 off the top-k)."""

    def __init__(self, block):
        super().__init__()
        self.gate = block.gate
        self.switch_mlp = block.switch_mlp
        self.num_experts_per_tok = block.num_experts_per_tok

    def __call__(self, x):
        gates = self.gate(x)
        k = self.num_experts_per_tok
        n_exp = gates.shape[-1]
        # mixtral's own choice of experts, then its softmax over them with the others at -inf
        inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
        chosen = mx.stop_gradient((inds[..., None] == mx.arange(n_exp)).any(axis=-2))
        weights = mx.softmax(mx.where(chosen, gates, -mx.inf), axis=-1, precise=True)
        sw = self.switch_mlp
        wg, wu, wd = sw.gate_proj.weight, sw.up_proj.weight, sw.down_proj.weight
        _, ffn, hid = wu.shape
        up = x @ wu.reshape(n_exp * ffn, hid).T
        gate = x @ wg.reshape(n_exp * ffn, hid).T
        h = sw.activation(up, gate).reshape(*x.shape[:-1], n_exp, ffn) * weights[..., None]
        return h.reshape(*x.shape[:-1], n_exp * ffn) @ wd.transpose(0, 2, 1).reshape(n_exp * ffn, hid)


def moe_blocks(model) -> list:
    """The decoder layers of a mixtral model (each with a `block_sparse_moe`)."""
    layers = model.model.layers
    if not layers or not all(hasattr(layer, "block_sparse_moe") for layer in layers):
        raise FlashError("--finetune-steps: the model is not a moefied mixtral (no block_sparse_moe)")
    return list(layers)


def use_dense_equivalent(model):
    """Replace, in place, every mixtral MoE block of `model` by its DenseEquivalentMoE."""
    for layer in moe_blocks(model):
        if not isinstance(layer.block_sparse_moe, DenseEquivalentMoE):
            layer.block_sparse_moe = DenseEquivalentMoE(layer.block_sparse_moe)
    return model


def set_trainable(model, trainable: str):
    """Freeze everything, then unfreeze the routers ("routers"), the experts' weights ("experts")
    or both ("both")."""
    if trainable not in TRAINABLE:
        raise FlashError(f"--finetune-train {trainable}: expected one of {', '.join(TRAINABLE)}")
    model.freeze()
    for layer in moe_blocks(model):
        if trainable in ("routers", "both"):
            layer.block_sparse_moe.gate.unfreeze()
        if trainable in ("experts", "both"):
            layer.block_sparse_moe.switch_mlp.unfreeze()


def load_student(folder: Path):
    """(mixtral model in float32 with dense-equivalent MoE blocks, its config) of a moefy folder."""
    from ..models import load_model

    config = read_config(folder)
    if config.get("model_type") != "mixtral" or "quantization" in config:
        raise FlashError(f"{folder}: expected a float moefied mixtral folder (python -m mlx_flash.moefy's)")
    model, _ = load_model(Path(folder), lazy=False)
    model.set_dtype(mx.float32)
    model.eval()
    return use_dense_equivalent(model), config


def train_step_fn(model, optimizer, teacher, *, ce_weight: float = 0.0, clip: float = 1.0,
                  compiled: bool = True):
    """step(tokens mx.array [B, L]) -> (loss, ce, kl) as floats after one AdamW update; loss =
    KL(teacher || model) + ce_weight x cross-entropy (nats per position)."""

    def loss_fn(tokens):
        logits = model(tokens)
        ce, kl = ce_and_kl(logits, tokens, mx.stop_gradient(teacher(tokens)))
        return kl + ce_weight * ce, ce, kl

    update = compiled_update(model, optimizer, loss_fn, clip=clip, compiled=compiled,
                             inputs=[teacher.state])

    def step(tokens):
        with kernels_off():
            loss, ce, kl = update(tokens)
            mx.eval(loss, ce, kl, model.parameters(), optimizer.state)
        return float(loss.item()), float(ce.item()), float(kl.item())

    return step


def spread_files(files, seed: int) -> list:
    """The files sorted, then shuffled by `seed`: a token budget then samples the whole set,
    not its alphabetical start."""
    files = sorted({str(Path(f)) for f in files})
    random.Random(seed).shuffle(files)
    return files


def finetune_moe(start: Path, teacher_src: Path, train_files, out: Path, *, steps: int,
                 trainable: str = "routers", lr: float = 1e-4, warmup: int = 10,
                 decay: str = "constant", batch_size: int = 1, seq_len: int = SEQ_LEN,
                 ce_weight: float = 0.0, max_train_tokens: int = 262144, checkpoint_every: int = 50,
                 keep_checkpoints: int = 2, resume: bool = False, max_minutes=None,
                 eval_files=(), eval_tokens: int = 4096, compiled: bool = True, seed: int = 0,
                 top_k: int = None, progress: bool = True, log=print) -> dict:
    """Distill the moefied model in `start` from the dense model `teacher_src` (module docstring)
    for `steps` AdamW steps of batch_size x seq_len tokens of `train_files` (at most
    max_train_tokens, the files in spread_files' order); checkpoints (every `checkpoint_every`
    steps, newest `keep_checkpoints` kept) and the final model go to `out`.

    top_k: route the start model to this many experts first (moe.quality.set_moefied_top_k: a
    moefy split does not depend on its top-k, only its down matrices' scale), e.g. a top-4 model
    from a top-8 one; None keeps start's.
    resume: continue from out's newest checkpoint (same batches as an unbroken run). max_minutes:
    stop after the step that crosses it, checkpoint, and write the model. eval_files: perplexity
    on eval_tokens of them (never training text) before training and at every checkpoint.
    Returns the report written to out/moe_finetune.json: {"steps", "tokens_trained", "seconds",
    "losses" [{"step", "loss", "ce", "kl"}], "eval" [{"step", "seconds", "ppl"}]}.
    """
    from ..models import load_tokenizer
    from .relufication import load_float32, measure

    start, out = Path(start), Path(out)
    if steps < 1:
        raise FlashError(f"--finetune-steps {steps}: must be at least 1")
    if batch_size < 1 or seq_len < 2:
        raise FlashError(f"--finetune-batch-size {batch_size}: must be at least 1")
    if not resume and checkpoint_dirs(out):
        raise FlashError(f"--out {out}: already holds a fine-tune's checkpoints (pass --resume to continue it)")
    existing = start_run(out, resume, train_files, eval_files, log)
    tokenizer_src = existing[-1] if resume else start  # tokenizer files: copied into every checkpoint
    tokenizer = load_tokenizer(tokenizer_src)
    files = spread_files(train_files, seed)
    sequences = text_sequences(files, tokenizer, seq_len, max_train_tokens, flag="--finetune-text")
    eval_seqs = text_sequences(eval_files, tokenizer, seq_len, eval_tokens, flag="--eval-text") \
        if eval_files else None
    teacher, _ = load_float32(teacher_src)
    optimizer = make_optimizer(lr, warmup, steps=steps, decay=decay)
    if resume:
        student, config = load_student(existing[-1])
        state = restore_trainer(existing[-1], optimizer)
        if state.get("trainable") != trainable:
            raise FlashError(f"--resume: {existing[-1]} trained {state.get('trainable')}, this run "
                             f"asks for --finetune-train {trainable}")
        log(f"resuming {existing[-1]} at step {state['step']} ({state['tokens_trained']} tokens trained)")
    else:
        student, config = load_student(start)
        state = {"step": 0, "tokens_trained": 0, "seconds": 0.0, "losses": [], "eval": []}
    config = dict(config)
    if top_k is not None and top_k != config["num_experts_per_tok"]:
        from ..moe.quality import set_moefied_top_k

        if resume or not 1 <= top_k <= config["num_local_experts"]:
            raise FlashError(f"--top-k {top_k}: must be in 1..{config['num_local_experts']} and "
                             f"not change on --resume (the checkpoint routes to {config['num_experts_per_tok']})")
        set_moefied_top_k(student, top_k)
        config["num_experts_per_tok"] = top_k
        config["moefied"] = {**config.get("moefied", {}), "top_k": top_k}
    state.update(trainable=trainable, lr=lr, warmup=warmup, decay=decay, batch_size=batch_size,
                 seq_len=seq_len, ce_weight=ce_weight, steps_planned=steps, seed=seed,
                 train_sequences=int(len(sequences)), train_files=files, start=str(start),
                 teacher=str(teacher_src))
    config["moefied"] = {**config.get("moefied", {}), "finetune": {
        "method": "distilled end to end from the dense model (KL of next-token distributions)",
        "trainable": trainable, "lr": lr, "batch": [batch_size, seq_len], "ce_weight": ce_weight}}

    def evaluate():
        if eval_seqs is None:
            return
        student.eval()
        with kernels_off():  # as the training steps run the model
            ppl = measure(student, eval_seqs)["ppl"]
        state["eval"].append({"step": state["step"], "seconds": state["seconds"], "ppl": ppl,
                              "tokens": int(eval_seqs[:, 1:].size)})
        log(f"step {state['step']}: validation perplexity {ppl:.3f} ({eval_seqs[:, 1:].size} tokens)")

    def checkpoint():
        nonlocal tokenizer_src
        config["moefied"]["finetune"].update(steps=state["step"], tokens=state["tokens_trained"])
        evaluate()
        tokenizer_src = save_checkpoint(out, student, optimizer, config, tokenizer_src, state,
                                        keep_checkpoints)

    if not resume:
        evaluate()
    set_trainable(student, trainable)
    student.train()
    step_fn = train_step_fn(student, optimizer, teacher, ce_weight=ce_weight, compiled=compiled)
    train_loop(step_fn, state, sequences, steps=steps, batch_size=batch_size, seed=seed,
               names=("loss", "ce", "kl"), checkpoint=checkpoint, checkpoint_every=checkpoint_every,
               max_minutes=max_minutes, desc="moe finetune", lr_flag="--finetune-lr", progress=progress,
               postfix=lambda v: {"kl": f"{v['kl']:.3f}", "ce": f"{v['ce']:.3f}"}, log=log)
    student.eval()
    write_model_folder(out, student, config, tokenizer_src)
    report = {k: state[k] for k in ("steps_planned", "tokens_trained", "seconds", "losses", "eval",
                                    "trainable", "lr", "ce_weight", "batch_size", "seq_len")}
    report["steps"] = state["step"]
    write_json_atomic(out / REPORT_JSON, report)
    return report
