"""Training pieces shared by the fine-tunes in calibration/ (relufication.py, moe_finetune.py):
the losses (cross-entropy, KL to a teacher, both fused), the learning-rate schedules, the
mx.compile'd AdamW step, seeded batches, and checkpoints a run can --resume from.

A run's folder (`out`):
    checkpoints/step-NNNNNN/   a loadable model folder (config.json, model.safetensors, tokenizer)
                               + trainer.json (step, tokens trained, seconds, losses); the newest
                               also holds optimizer.safetensors (AdamW state) for --resume;
                               only the newest `keep` are kept (0: all)
Every file is written to a temporary name, fsynced and renamed; a checkpoint directory is renamed
into place whole.
"""

import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import FlashError
from ..model_folder import WEIGHTS_FILE, write_model_files, write_weights
from ..nll import token_nll
from ..paths import atomic_dir, read_json_file, write_json_atomic
from .relufication_choices import DECAYS

SEQ_LEN = 256             # tokens per training / evaluation sequence
CHECKPOINTS = "checkpoints"
TRAINER_JSON = "trainer.json"
OPTIMIZER_FILE = "optimizer.safetensors"


# ---- the start of a run ----------------------------------------------------------------------------

def check_disjoint(train_files, eval_files):
    """FlashError when a held-out (--eval-text) file is also training text."""
    both = {Path(f).resolve() for f in train_files} & {Path(f).resolve() for f in eval_files}
    if both:
        raise FlashError(f"--eval-text {sorted(map(str, both))[0]}: also training text; the two must be disjoint")


def start_run(out: Path, resume: bool, train_files, eval_files, log=print) -> list:
    """The checks a fine-tune makes before loading anything (--resume needs a checkpoint in `out`;
    training and held-out text are disjoint), and a note when float32 training will run without
    OpenBLAS on Linux; returns the run's checkpoints (checkpoint_dirs)."""
    existing = checkpoint_dirs(out)
    if resume and not existing:
        raise FlashError(f"--resume: {out} has no checkpoint to resume from")
    check_disjoint(train_files, eval_files)
    if sys.platform == "linux" and "openblas" not in os.environ.get("LD_PRELOAD", "").lower():
        log("note: OpenBLAS is not preloaded; float32 training is much slower (README, Linux notes)")
    return existing


# ---- text ------------------------------------------------------------------------------------------

def text_sequences(files, tokenizer, seq_len: int = SEQ_LEN, max_tokens=None, flag="--text") -> np.ndarray:
    """int32 [n, seq_len] token ids: the files' text (dense_pass.text_tokens: each file encoded
    separately, then joined) cut into consecutive sequences; the remainder is dropped."""
    from .dense_pass import text_tokens

    tokens = text_tokens(files, tokenizer, max_tokens, flag=flag, min_tokens=seq_len)
    n = len(tokens) // seq_len
    return tokens[: n * seq_len].reshape(n, seq_len)


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> np.ndarray:
    """Sequence indices of training step `step` (0-based): a fresh permutation per epoch, from the
    seed alone, so a resumed run sees exactly the batches an uninterrupted one would."""
    start = step * batch_size
    out = []
    for k in range(start, start + batch_size):
        epoch, pos = divmod(k, n)
        out.append(np.random.default_rng(seed + epoch).permutation(n)[pos])
    return np.asarray(out)


# ---- losses ------------------------------------------------------------------------------------------

def next_token_nll(logits, tokens):
    """Per position negative log-likelihood (nats) of tokens[:, 1:] given logits[:, :-1]
    (logits of model(tokens))."""
    return token_nll(logits[:, :-1], tokens[:, 1:])


def distill_kl(student_logits, teacher_logits):
    """Mean over positions of KL(teacher || student) (nats), both over the whole vocabulary."""
    t = teacher_logits - mx.logsumexp(teacher_logits, axis=-1, keepdims=True)
    s = student_logits - mx.logsumexp(student_logits, axis=-1, keepdims=True)
    return mx.mean(mx.sum(mx.exp(t) * (t - s), axis=-1))


def ce_and_kl(logits, tokens, teacher_logits):
    """(next-token cross-entropy, KL(teacher || student)), both means over positions (nats), with
    three passes of exp over the vocabulary instead of next_token_nll's and distill_kl's six (on
    one CPU core an exp pass over 256 x 49152 logits takes ~0.2 s): the student's log-sum-exp
    (and its backward pass) is shared, the teacher's softmax is one pass, and
    KL = lse_s - sum p s - (lse_t - sum p t) with p the teacher's softmax."""
    lse = mx.logsumexp(logits, axis=-1)
    target = mx.take_along_axis(logits[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    ce = mx.mean(lse[:, :-1] - target)
    if teacher_logits is None:
        return ce, mx.array(0.0)
    t_max = mx.max(teacher_logits, axis=-1, keepdims=True)
    e = mx.exp(teacher_logits - t_max)
    z = mx.sum(e, axis=-1, keepdims=True)
    p = e / z
    lse_t = (t_max + mx.log(z))[..., 0]
    kl = mx.mean(lse - mx.sum(p * logits, axis=-1) - (lse_t - mx.sum(p * teacher_logits, axis=-1)))
    return ce, kl


# ---- schedules and the step ------------------------------------------------------------------------

FINAL_LR_FRACTION = 0.1  # cosine decay ends at this fraction of the peak rate


def make_optimizer(lr: float, warmup: int, weight_decay: float = 0.0, *, steps: int = 0, decay: str = "constant"):
    """AdamW with a linear warm-up over `warmup` steps, then the peak rate held ("constant") or
    decayed along a cosine to FINAL_LR_FRACTION of it at step `steps` ("cosine")."""
    import mlx.optimizers as optim

    if decay not in DECAYS:
        raise FlashError(f"--decay {decay}: expected one of {', '.join(DECAYS)}")
    after = optim.cosine_decay(lr, steps - warmup, lr * FINAL_LR_FRACTION) \
        if decay == "cosine" and steps > warmup else (lambda _: mx.array(lr))
    schedule = optim.join_schedules([optim.linear_schedule(lr / warmup, lr, warmup), after],
                                    [warmup]) if warmup > 0 else after
    return optim.AdamW(learning_rate=schedule, weight_decay=weight_decay)


def compiled_update(model, optimizer, loss_fn, *, clip: float = 1.0, compiled: bool = True,
                    inputs=()):
    """update(*args) -> loss_fn(*args)'s outputs (a tuple, the loss first), after one optimizer
    step on `model`'s trainable parameters with the gradient of the loss, its global norm clipped
    to `clip` (0: not clipped). compiled: the whole step (forward, backward, clipping, update) is
    one mx.compile'd function of the model's and the optimizer's state (plus `inputs`: other
    modules' state it reads, e.g. a frozen teacher's); a new argument shape retraces it."""
    import mlx.optimizers as optim

    grad_fn = nn.value_and_grad(model, loss_fn)

    def update(*args):
        outputs, grads = grad_fn(*args)
        if clip:
            grads, _ = optim.clip_grad_norm(grads, clip)
        optimizer.update(model, grads)
        return outputs

    if not compiled:
        return update
    # the compiled function takes and returns the state's arrays: every one must exist first
    optimizer.init(model.trainable_parameters())
    state = [model.state, optimizer.state]
    return mx.compile(update, inputs=state + list(inputs), outputs=state)


def train_loop(step_fn, state: dict, sequences: np.ndarray, *, steps: int, batch_size: int, seed: int,
               names: tuple, checkpoint, checkpoint_every: int = 0, max_minutes=None,
               postfix=None, desc: str = "train", lr_flag: str = "--lr", progress: bool = True,
               log=print):
    """Run step_fn (tokens [batch_size, L] -> floats named `names`, the loss first) on the seeded
    batches (batch_indices) of `sequences` [n, L] from state["step"] up to `steps`, updating
    `state` ("step", "tokens_trained", "seconds", "losses" += {"step", name: value}); a progress
    bar shows postfix(values dict); checkpoint() is called every `checkpoint_every` steps and at
    the end if the last step was not saved. max_minutes: stop after the step that crosses it."""
    from tqdm import tqdm

    t_start, t_run = time.perf_counter(), state["seconds"]
    deadline = None if max_minutes is None else t_start + 60 * max_minutes
    last_saved = state["step"]
    bar = tqdm(total=steps, initial=state["step"], desc=desc, unit="step", disable=not progress)
    try:
        while state["step"] < steps:
            idx = batch_indices(state["step"], batch_size, len(sequences), seed)
            values = dict(zip(names, step_fn(mx.array(sequences[idx]))))
            loss = values[names[0]]
            if not math.isfinite(loss):
                raise FlashError(f"step {state['step']}: loss is {loss}; lower {lr_flag}")
            state["step"] += 1
            state["tokens_trained"] += int(batch_size * sequences.shape[1])
            state["seconds"] = t_run + time.perf_counter() - t_start
            state["losses"].append({"step": state["step"], **values})
            bar.update(1)
            if postfix is not None:
                bar.set_postfix(postfix(values))
            if checkpoint_every and state["step"] % checkpoint_every == 0:
                checkpoint()
                last_saved = state["step"]
            if deadline is not None and time.perf_counter() > deadline:
                log(f"--max-minutes {max_minutes}: stopping at step {state['step']}")
                break
    finally:
        bar.close()
        if state["step"] != last_saved:
            checkpoint()


@contextmanager
def kernels_off():
    """Our CPU kernels have no gradients (vjp); MLX's ops do: the kernels are off inside."""
    from ..cpu import ops

    kernels = ops.kernels_active()
    ops.set_kernels_enabled(False)
    try:
        yield
    finally:
        ops.set_kernels_enabled(kernels)


# ---- files -------------------------------------------------------------------------------------------

def write_model_folder(dst: Path, model, config: dict, tokenizer_src: Path):
    """`model` as an mlx-lm model in folder `dst` (created if missing; a run's folder keeps its
    checkpoints and reports beside it): model_folder.write_model_files, each file whole."""
    from mlx.utils import tree_flatten

    dst.mkdir(parents=True, exist_ok=True)
    write_model_files(dst, dict(tree_flatten(model.parameters())), config, tokenizer_src)


def restore_trainer(ckpt: Path, optimizer) -> dict:
    """The trainer state (trainer.json) of checkpoint `ckpt`, with `optimizer`'s state restored in
    place from it (save_checkpoint's counterpart); FlashError when it has no optimizer state."""
    from mlx.utils import tree_unflatten

    if not (ckpt / OPTIMIZER_FILE).is_file():
        raise FlashError(f"{ckpt}: no {OPTIMIZER_FILE} (only the newest checkpoint can be resumed)")
    optimizer.state = tree_unflatten(list(mx.load(str(ckpt / OPTIMIZER_FILE)).items()))
    return trainer_state(ckpt)


def trainer_state(ckpt: Path) -> dict:
    """The trainer state of checkpoint `ckpt` (trainer.json: step, tokens trained, seconds, losses);
    a missing or damaged file is one FlashError naming it (paths.read_json_file)."""
    return read_json_file(Path(ckpt) / TRAINER_JSON, "trainer state")


def checkpoint_dirs(out: Path) -> list:
    """The run's checkpoint folders, oldest first."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and d.name.startswith("step-")
                  and (d / TRAINER_JSON).is_file())


def save_checkpoint(out: Path, model, optimizer, config: dict, tokenizer_src: Path, state: dict,
                    keep: int = 0) -> Path:
    """checkpoints/step-NNNNNN: model folder + trainer.json + optimizer state, renamed into place
    whole; older checkpoints keep their model (for the curve) and drop their optimizer state.
    keep > 0: then only the newest `keep` checkpoints stay (prune_checkpoints; a checkpoint of
    a 135M float32 model is ~1.6 GB); 0 keeps all."""
    from mlx.utils import tree_flatten

    final = Path(out) / CHECKPOINTS / f"step-{state['step']:06d}"
    with atomic_dir(final, replace=True) as tmp:
        write_model_folder(tmp, model, config, tokenizer_src)
        write_weights(tmp / OPTIMIZER_FILE, dict(tree_flatten(optimizer.state)))
        write_json_atomic(tmp / TRAINER_JSON, state)
    for older in checkpoint_dirs(out):
        if older != final and (older / OPTIMIZER_FILE).exists():
            (older / OPTIMIZER_FILE).unlink()
    if keep:
        prune_checkpoints(out, keep, final)
    return final


def prune_checkpoints(out: Path, keep: int, newest: Path) -> list:
    """Delete all but the newest `keep` (>= 1) checkpoints of the run, never `newest` (the one just
    written, which --resume continues from). Each is renamed out of checkpoint_dirs' sight before
    its files go, so an interrupted delete never leaves a half checkpoint (its leftovers go on the
    next prune). Returns the deleted."""
    doomed = [d for d in checkpoint_dirs(out)[:-keep] if d != newest]
    for d in doomed:
        os.rename(d, d.with_name(f".{d.name}.deleting-{os.getpid()}"))
    for gone in (Path(out) / CHECKPOINTS).glob(".step-*.deleting-*"):
        shutil.rmtree(gone)
    return doomed
