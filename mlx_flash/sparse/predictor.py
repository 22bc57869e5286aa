"""Activation predictors: which FFN neurons a token needs, stored inside a flash pack.

`python -m mlx_flash.calibrate` writes two files into the pack directory:

    predictors.json          format, format_version, the pack it belongs to (resident crc32), the
                             FFN activation, calibration settings and text, and per layer:
                             kind, n_neurons, rank, threshold, prob_threshold, stats (recall,
                             over-prediction, ...), capacity (Req_i for windows 1..max_window)
    predictors.safetensors   low-rank factors, float16: layers.{i}.A [rank, hidden],
                             layers.{i}.B [n_neurons, rank], layers.{i}.bias [n_neurons]
                             (its crc32 is in predictors.json, so the pair is checked on load);
                             the same names for "low-rank-gate" (B A x + bias approximates gate x);
                             "quant-gate": layers.{i}.gate.weight / .scales / .biases (/ .bias),
                             the gate MLX-quantized at the entry's `bits` and `group_size`;
                             "quant-glu": the same plus layers.{i}.up.weight / .scales / .biases
                             (/ .bias), the up projection quantized alike

Predictor kinds (`LayerPredictor.kind`), for FFN input x (the normalised attention output):
    "all"             sparsity off: every neuron
    "exact-relu"      ReLU models, resident up projection: mask = up(x) + b > 0 (exact)
    "gate-threshold"  gated models, resident gate: mask = |act(gate x)| > threshold (exact for the
                      thresholded model; a CATS relu_llama's threshold is its trained one)
    "low-rank"        the paper's predictor: mask = sigmoid(B (A x) + bias) > prob_threshold
    "low-rank-gate"   gated models, gate streamed with the bundle: g = B (A x) + bias is a rank-r
                      approximation of gate x (fitted to calibration activations), and
                      mask = |act(g)| > cut, with cut set per layer for a target recall
    "quant-gate"      gated models, gate streamed with the bundle: g = a 2..8-bit quantized copy of
                      the gate times x, mask as "low-rank-gate"'s (a float16 model's exact gate
                      costs 4x a 4-bit copy's memory; the FFN computes with the bundle's gate)
    "quant-glu"       product-threshold models (relufy --activation product): quantized copies of
                      the gate and up, mask = |act(g) * u| > cut, the cut set per layer for a
                      target recall (the FFN computes with the bundle's rows); on a pack with a
                      resident gate (convert --gate-bits) only up is copied and g is the model's
                      own gate x, the one matvec the rows use too
Gate/up rows in the bundles are read from the pack's bundle files when the predictors are loaded;
a resident gate (convert --gate-bits) is the model's own resident tensor, which the model loader
gives the predictor (`LayerPredictor.share_gate`): the resident tensors file is read once.

What the runtime must do with `LayerPredictor.threshold` (float >= 0, activation units): compute
only the predicted neurons, and of those keep neuron i only where |act(gate_i x)| > threshold:
    h_i = act(gate_i x) * (up_i x)  if |act(gate_i x)| > threshold else 0     (gated models)
    h_i = relu(up_i x + b_i)                                                  (ReLU models, t = 0)
    y = down[:, active] h[active] (+ down bias)
so a false positive of the predictor only costs I/O and the model computed is the thresholded one
(CATS), not a truncated one; a false negative drops a neuron the thresholded model would keep.
With threshold 0 the rule changes nothing (only exact zeros are dropped).
"""

import json
import math
import os
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import FlashError
from ..cpu.ops import ACTIVATIONS, activation_fn, half_matvec, quantized_matvec
from ..pack import layer_bundles, read_layer_components, read_manifest
from ..pack.schema import FieldCheck, check_checksum, check_pack_file, read_json_file, write_metadata
from ..paths import load_safetensors, write_file_atomic

FORMAT = "mlx-flash-predictors"
FORMAT_VERSION = 1
PREDICTORS_JSON = "predictors.json"
PREDICTORS_FILE = "predictors.safetensors"
KINDS = ("all", "exact-relu", "gate-threshold", "low-rank", "low-rank-gate", "quant-gate", "quant-glu")
LOW_RANK = ("low-rank", "low-rank-gate")  # kinds with low-rank factors
COPIES = {"quant-gate": ("gate",), "quant-glu": ("gate", "up")}  # kinds holding quantized copies: of these roles
STORED = LOW_RANK + tuple(COPIES)  # kinds whose tensors live in predictors.safetensors
GATE_ESTIMATES = ("low-rank-gate", "quant-gate")  # mask = gate_score(x) > cut
GATE_MASKS = ("gate-threshold",) + GATE_ESTIMATES  # kinds whose mask reads the gate alone
SCORED = GATE_ESTIMATES + ("quant-glu",)  # kinds whose mask is gate_score(x) > cut
QUANTIZED = ("weight", "scales", "biases")  # the tensors of a quantized copy, per role


def monotone(activation: str) -> bool:
    """ReLU-family activations: zero below a threshold, increasing above it."""
    return activation == "relu" or str(activation).startswith("fatrelu:")


def _logit(p: float) -> float:
    return float(np.log(p) - np.log1p(-p))


class LayerPredictor:
    """Predicted active neurons of one layer's FFN: `predictor(x) -> bool [..., n_neurons]`.

    Attributes: layer, kind, n_neurons, rank (0 unless low-rank), threshold (activation cutoff the
    runtime applies, see the module docstring), prob_threshold (sigmoid cutoff, low-rank only),
    cut (gate_score cutoff, low-rank-gate only), activation (name), stats
    (calibration numbers), nbytes (bytes of the arrays it holds, counted in the memory budget).
    """

    def __init__(self, layer, kind, n_neurons, *, threshold=0.0, prob_threshold=0.5, rank=0,
                 activation="silu", stats=None, tensors=None, quantization=None, cut=0.0,
                 resident_gate=False, gate_quantization=None):
        if kind not in KINDS:
            raise FlashError(f"{PREDICTORS_JSON}: layer {layer} has unknown kind {kind!r}")
        self.layer, self.kind, self.n_neurons = layer, kind, int(n_neurons)
        self.threshold, self.prob_threshold = float(threshold), float(prob_threshold)
        self.cut = float(cut)
        self.rank, self.activation, self.stats = int(rank), activation, dict(stats or {})
        self._t = dict(tensors or {})
        self._q = quantization  # {"group_size", "bits"} when the resident rows are quantized
        # the gate rows' quantization: a resident gate's own (None: not quantized), else the rows'
        self._gate_q = gate_quantization if resident_gate else quantization
        self._act = activation_fn(activation)
        self._logit_cut = _logit(self.prob_threshold) if kind == "low-rank" else None
        # a pack's resident gate (convert --gate-bits) is counted with the resident tensors, and the
        # runtime gives this predictor the model's own arrays (share_gate); what it holds besides
        # (quant-glu's up copy) is its own
        self.resident_gate = bool(resident_gate)
        self.nbytes = int(sum(a.nbytes for k, a in self._t.items()
                              if not (self.resident_gate and k.startswith("gate."))))

    def share_gate(self, tensors: dict):
        """Use `tensors` ({"weight", "scales", "biases"[, "bias"]}: the model's resident gate) as
        this predictor's gate rows instead of its own copy."""
        self._t = {k: v for k, v in self._t.items() if not k.startswith("gate.")}
        self._t.update({f"gate.{k}": v for k, v in tensors.items()})

    def mask_from_gate(self, g, x=None):
        """The mask from the gate's output g = gate x [..., n_neurons] computed elsewhere (the
        runtime's resident gate: one matvec for both): "gate-threshold" |act(g)| > threshold;
        "quant-glu" |act(g) * quantized up x| > cut (x: the FFN input)."""
        if self.kind == "quant-glu":
            return self.gate_score(x, g) > self.cut
        return mx.abs(self._act(g)) > self.threshold

    def _rows(self, role, x):
        """x @ rows.T (+ bias) for resident `role` rows ("gate" or "up"), quantized or not."""
        if f"{role}.weight" not in self._t:
            raise FlashError(f"layer {self.layer}: this predictor's gate is the model's resident gate; "
                             "call share_gate with it first (build_flash_model does)")
        w = self._t[f"{role}.weight"]
        q = self._gate_q if role == "gate" else self._q
        if q:
            y = quantized_matvec(x, w, self._t[f"{role}.scales"], self._t[f"{role}.biases"],
                                 q["group_size"], q["bits"])
        else:
            y = half_matvec(x, w)  # our kernel for half weights, x @ w.T otherwise
        if f"{role}.bias" in self._t:
            y = y + self._t[f"{role}.bias"]
        return y

    def gate_activation(self, x):
        """act(gate x) [..., n_neurons] from the resident gate ("gate-threshold" only)."""
        return self._act(self._rows("gate", x))

    def gate_score(self, x, g=None):
        """The "low-rank-gate" score, active where > cut: the gate estimate itself for ReLU-family
        activations (monotone and zero below their threshold, so the cut may lie below the
        threshold and keep neurons the estimate puts just under it), |act(estimate)| otherwise;
        "quant-glu": |act(quantized gate x) * quantized up x| (g: gate x when already computed)."""
        if self.kind == "quant-glu":
            a = self.gate_estimate(x) if g is None else self._act(g.astype(mx.float32))
            return mx.abs(a * self._rows("up", x).astype(mx.float32))
        if monotone(self.activation):
            return self.logits(x)
        return mx.abs(self.gate_estimate(x))

    def gate_estimate(self, x):
        """act(estimated gate x) [..., n_neurons], float32 ("low-rank-gate", "quant-gate", "quant-glu")."""
        return self._act(self.logits(x))

    def logits(self, x):
        """B (A x) + bias [..., n_neurons], float32 ("low-rank", "low-rank-gate"); the quantized
        gate copy times x ("quant-gate", "quant-glu")."""
        if self.kind in COPIES:
            return self._rows("gate", x).astype(mx.float32)
        a, b = self._t["A"], self._t["B"]
        h = (x.astype(a.dtype) @ a.T) @ b.T
        return h.astype(mx.float32) + self._t["bias"].astype(mx.float32)

    def __call__(self, x):
        if self.kind == "all":
            return mx.ones((*x.shape[:-1], self.n_neurons), dtype=mx.bool_)
        if self.kind == "exact-relu":
            return self._rows("up", x) > 0
        if self.kind == "gate-threshold":
            return self.mask_from_gate(self._rows("gate", x))
        if self.kind in SCORED:
            return self.gate_score(x) > self.cut
        return self.logits(x) > self._logit_cut

    def __repr__(self):
        return (f"LayerPredictor(layer={self.layer}, kind={self.kind!r}, n={self.n_neurons}, "
                f"rank={self.rank}, threshold={self.threshold:.4g}, "
                f"prob_threshold={self.prob_threshold:.3g}, cut={self.cut:.4g}, nbytes={self.nbytes})")



def save_predictors(pack_dir, meta: dict, layers: dict, factors: dict) -> Path:
    """Write predictors.safetensors then predictors.json into `pack_dir`, each atomically.

    meta: top-level fields (activation, calibration, ...); layers: {layer: {kind, n_neurons, rank,
    threshold, prob_threshold, cut, stats, capacity}}; factors: {layer: {"A", "B", "bias"}} (low-rank
    kinds).
    The json carries the safetensors crc32, so a crash between the two renames is caught on load.
    """
    pack = Path(pack_dir)
    manifest = read_manifest(pack)
    arrays = {f"layers.{i}.{k}": v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
              for i, f in factors.items() for k, v in f.items()}
    st_path, js_path = pack / PREDICTORS_FILE, pack / PREDICTORS_JSON
    try:
        if arrays:
            # the temporary keeps the suffix: mx.save_safetensors appends ".safetensors" otherwise
            write_file_atomic(st_path, lambda p: mx.save_safetensors(str(p), arrays), suffix=st_path.suffix)
            crc = zlib.crc32(st_path.read_bytes())
        else:
            st_path.unlink(missing_ok=True)
            crc = None
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION,
               "pack_resident_crc32": manifest.resident.crc32,
               "tensors_file": PREDICTORS_FILE if arrays else None, "tensors_crc32": crc, **meta,
               "layers": {str(i): layers[i] for i in sorted(layers)}}
        write_metadata(js_path, doc)
    except RuntimeError as e:  # MLX's bare error for a failed write (full disk)
        raise FlashError(f"{st_path}: cannot write predictors ({e})") from None
    except OSError as e:
        raise FlashError(f"{e.filename or pack}: cannot write predictors ({e.strerror or e})") from None
    return js_path


def read_predictors_json(pack_dir, manifest=None):
    """The validated predictors.json of a pack, or None when the pack has none; `manifest`: the
    pack's Manifest when the caller has read it already."""
    return _read_predictors(pack_dir, manifest)[0]


def _read_predictors(pack_dir, manifest=None):
    """(validated predictors.json, the pack's Manifest it was checked against), or (None, None)
    when the pack has no predictors."""
    path = Path(pack_dir) / PREDICTORS_JSON
    if not os.path.lexists(path):
        return None, None
    doc = read_json_file(path, "predictors file")
    if doc.get("format") != FORMAT:  # read_json_file returns only objects
        raise FlashError(f"{path}: not a predictors file")
    if doc.get("format_version") != FORMAT_VERSION:
        raise FlashError(f"{path}: predictors format version {doc.get('format_version')}, this "
                         f"mlx-flash reads {FORMAT_VERSION}; re-run python -m mlx_flash.calibrate")
    manifest = manifest or read_manifest(pack_dir)
    if doc.get("pack_resident_crc32") != manifest.resident.crc32:
        raise FlashError(f"{path}: calibrated for a different pack; re-run python -m mlx_flash.calibrate")
    validate_predictors(doc, path, manifest)
    return doc, manifest


def validate_predictors(doc: dict, path, manifest) -> None:
    """FlashError naming `path` and the field unless predictors.json is consistent with itself
    and with the pack: checksum, one entry per FFN layer of the pack, neuron counts equal to the
    bundle counts, finite non-negative thresholds and cuts, probabilities in (0, 1), capacities
    1..n non-decreasing, a known activation (no gate-based kind for a product-threshold model)."""
    c = FieldCheck(path)
    check_checksum(doc, path)
    doc_act = c.str(doc.get("activation", "silu"), "activation", (*ACTIVATIONS, "fatrelu", "cats", "product"))
    if doc.get("tensors_file") is not None:
        c.str(doc["tensors_file"], "tensors_file", (PREDICTORS_FILE,))
        c.int(c.get(doc, "tensors_crc32"), "tensors_crc32", 0, 2 ** 32 - 1)
    layers = c.dict(c.get(doc, "layers"), "layers")
    counts = {b.layer: b.count for b in manifest.bundles}
    seen = set()
    for key, entry in layers.items():
        f = f"layers[{key!r}]"
        if not key.isdigit() or int(key) in seen:
            c.fail(f, "is not a distinct layer number")
        seen.add(int(key))
        c.dict(entry, f)
        kind = c.str(c.get(entry, "kind", f"{f}.kind"), f"{f}.kind", KINDS)
        if doc_act == "product" and kind in GATE_MASKS:
            c.fail(f"{f}.kind", f"= {kind!r}: a product-threshold model's mask is not the gate's")
        if doc_act != "product" and kind == "quant-glu":
            c.fail(f"{f}.kind", f"= {kind!r}: only for a product-threshold model (activation product)")
        n = c.int(c.get(entry, "n_neurons", f"{f}.n_neurons"), f"{f}.n_neurons", 1, 1 << 24)
        if int(key) in counts and n != counts[int(key)]:
            c.fail(f"{f}.n_neurons", f"= {n}, but the pack's layer {key} has {counts[int(key)]} neurons")
        c.int(entry.get("rank", 0), f"{f}.rank", 0, n)
        if kind in LOW_RANK and entry.get("rank", 0) < 1:
            c.fail(f"{f}.rank", f"must be at least 1 for a {kind} predictor")
        c.num(entry.get("threshold", 0.0), f"{f}.threshold", 0)
        act = c.str(entry.get("activation", doc.get("activation", "silu")), f"{f}.activation")
        try:
            activation_fn(act)
        except (FlashError, ValueError):
            c.fail(f"{f}.activation", f"= {act!r} is not a known activation (silu, relu, fatrelu:T, ...)")
        # ReLU-family layers score the gate estimate itself, whose cut may be negative
        c.num(entry.get("cut", 0.0), f"{f}.cut", -math.inf if monotone(act) else 0)
        if kind in COPIES:
            c.int(c.get(entry, "bits", f"{f}.bits"), f"{f}.bits", 2, 8)
            c.int(c.get(entry, "group_size", f"{f}.group_size"), f"{f}.group_size", 32, 128)
        c.num(entry.get("prob_threshold", 0.5), f"{f}.prob_threshold", 0, 1, lo_open=True)
        if entry.get("prob_threshold", 0.5) >= 1:
            c.fail(f"{f}.prob_threshold", "must be below 1")
        caps = c.list(c.get(entry, "capacity", f"{f}.capacity"), f"{f}.capacity")
        if not caps:
            c.fail(f"{f}.capacity", "is empty")
        for k, v in enumerate(caps):
            c.int(v, f"{f}.capacity[{k}]", 1, n)
        if any(a > b for a, b in zip(caps, caps[1:])):
            c.fail(f"{f}.capacity", "must not decrease with the window")
        if entry.get("stats") is not None:
            c.dict(entry["stats"], f"{f}.stats")
    if seen != set(counts):
        c.fail("layers", f"do not match the pack's {len(counts)} FFN layers")


def load_predictors(pack_dir, manifest=None, doc=None):
    """{layer: LayerPredictor} from a pack's predictors files, or None when it has none.

    manifest / doc: the pack's Manifest and its validated predictors.json (read_predictors_json)
    when the caller has read them already. Raises FlashError naming the file when a file is
    corrupt, truncated or from another pack.
    """
    pack = Path(pack_dir)
    if doc is None:
        doc, manifest = _read_predictors(pack, manifest)  # the manifest is read once
    else:
        manifest = manifest or read_manifest(pack)
    if doc is None:
        return None
    factors = {}
    if doc.get("tensors_file"):
        st_path = pack / doc["tensors_file"]
        check_pack_file(pack, doc["tensors_file"], "tensors_file", pack / PREDICTORS_JSON)
        try:
            raw = st_path.read_bytes()
        except OSError as e:
            raise FlashError(f"{st_path}: cannot read predictors ({e.strerror})") from None
        if zlib.crc32(raw) != doc.get("tensors_crc32"):
            raise FlashError(f"{st_path}: checksum mismatch with {PREDICTORS_JSON} (corrupt or "
                             "from another calibration run)")
        factors = load_safetensors(st_path)
    bundles = layer_bundles(manifest)
    out = {}
    for key, entry in doc["layers"].items():
        i, kind = int(key), entry["kind"]
        tensors, quant = {}, None
        gate = bundles[i].resident_gate
        gate_quant = {"group_size": gate["group_size"], "bits": gate["bits"]} if gate else None
        if kind in LOW_RANK:
            names = {k: f"layers.{i}.{k}" for k in ("A", "B", "bias")}
            missing = [v for v in names.values() if v not in factors]
            if missing:
                raise FlashError(f"{pack / PREDICTORS_FILE}: missing tensor {missing[0]}")
            tensors = {k: factors[v] for k, v in names.items()}
            r, n = int(entry["rank"]), int(entry["n_neurons"])
            if tensors["A"].shape[0] != r or tensors["B"].shape != (n, r) or tensors["bias"].shape != (n,):
                raise FlashError(f"{pack / PREDICTORS_FILE}: layer {i} factors do not match rank "
                                 f"{r} and {n} neurons")
        elif kind in COPIES:
            roles = copied_roles(kind, gate)
            need = [f"{r}.{k}" for r in roles for k in QUANTIZED]
            names = {k: f"layers.{i}.{k}" for k in (*need, *(f"{r}.bias" for r in roles))}
            missing = [names[k] for k in need if names[k] not in factors]
            if missing:
                raise FlashError(f"{pack / PREDICTORS_FILE}: missing tensor {missing[0]}")
            tensors = {k: factors[v] for k, v in names.items() if v in factors}
            n, quant = int(entry["n_neurons"]), {"bits": int(entry["bits"]), "group_size": int(entry["group_size"])}
            for r in roles:
                if any(tensors[f"{r}.{k}"].shape[0] != n for k in QUANTIZED) or \
                        tensors[f"{r}.weight"].shape[1] * 32 // quant["bits"] != \
                        tensors[f"{r}.scales"].shape[1] * quant["group_size"]:
                    raise FlashError(f"{pack / PREDICTORS_FILE}: layer {i} quantized {r} does not match "
                                     f"{n} neurons at {quant['bits']} bits, group size {quant['group_size']}")
        elif kind == "gate-threshold" and gate:
            # the gate rows are the model's resident tensors: the model loader gives them (share_gate)
            quant = gate_quant
        elif kind in ("exact-relu", "gate-threshold"):
            role = "up" if kind == "exact-relu" else "gate"
            comps = read_layer_components(pack, bundles[i])
            tensors = {k: v for k, v in comps.items() if k.startswith(role + ".")}
            if f"{role}.weight" not in tensors:
                raise FlashError(f"{pack / bundles[i]['file']}: no {role} rows for a {kind} predictor")
            meta = next(c for c in bundles[i].components if c.name == f"{role}.weight")
            quant = meta.quantization
            del comps
        out[i] = LayerPredictor(i, kind, entry["n_neurons"], threshold=entry.get("threshold", 0.0),
                                prob_threshold=entry.get("prob_threshold", 0.5),
                                rank=entry.get("rank", 0),
                                activation=entry.get("activation", doc.get("activation", "silu")),
                                stats=entry.get("stats"), tensors=tensors, quantization=quant,
                                cut=entry.get("cut", 0.0), resident_gate=shares_resident_gate(kind, gate),
                                gate_quantization=gate_quant)
    return out


def shares_resident_gate(kind: str, resident_gate) -> bool:
    """True when a predictor of `kind` takes its gate rows from the pack's resident gate (convert
    --gate-bits; `resident_gate` the bundle's record of it, falsy without one): gate-threshold's
    whole predictor, quant-glu's gate beside its up copy (copied_roles)."""
    return bool(resident_gate) and (kind == "gate-threshold"
                                    or kind in COPIES and "gate" not in copied_roles(kind, resident_gate))


def copied_roles(kind: str, resident_gate) -> tuple:
    """The roles a COPIES kind holds quantized copies of: quant-glu on a pack with a resident gate
    (convert --gate-bits) holds only up, and takes the model's gate (exact, one matvec for the
    mask and the rows)."""
    roles = COPIES[kind]
    return tuple(r for r in roles if r != "gate") if kind == "quant-glu" and resident_gate else roles


def predicted_density(pack_dir, doc=None) -> dict | None:
    """{layer: fraction of the layer's neurons predicted active per token} from a pack's
    calibration: the held-out `predicted` statistic, a synthetic pack's designed fraction, or
    Req_1 / n_neurons; None when the pack has no predictors. doc: the pack's predictors.json
    when already read (read_predictors_json), as for the functions below."""
    doc = doc if doc is not None else read_predictors_json(pack_dir)
    if doc is None:
        return None
    out = {}
    for key, entry in doc["layers"].items():
        n, stats = int(entry["n_neurons"]), entry.get("stats") or {}
        if entry["kind"] == "all":
            out[int(key)] = 1.0
        elif "predicted" in stats:
            out[int(key)] = float(stats["predicted"])
        elif "designed_active_fraction" in stats:
            out[int(key)] = float(stats["designed_active_fraction"])
        else:
            out[int(key)] = min(1.0, entry["capacity"][0] / n)
    return out


def sparse_read_fraction(pack_dir, window: int, doc=None) -> dict | None:
    """{layer: (with a neuron cache of `window` tokens, without a cache): seconds a sparse layer
    reads per token / seconds to read it whole}, from the read costs calibration measured on its
    held-out predictions (stats.read_s: budget.measured_read_seconds; windows beyond the measured
    ones use the largest), for the layers that have them; None when the pack has no predictors
    or none has measured reads."""
    out = {}
    for layer, read, whole in _measured_reads(pack_dir, doc):
        per_window = read.get("window_s")
        if per_window:
            out[layer] = (float(per_window[min(window, len(per_window)) - 1]) / whole, float(per_window[0]) / whole)
    return out or None


def cache_read_fraction(pack_dir, window: int, doc=None) -> dict | None:
    """{layer: [(neuron-cache rows, seconds a sparse layer with that cache reads per token /
    seconds to read it whole)]}, from the read costs calibration measured for caches smaller than
    the window's union (stats.read_s.cache: budget.measured_cache_read_seconds) at this `window`;
    None when the pack has no predictors or none was measured at this window."""
    out = {}
    for layer, read, whole in _measured_reads(pack_dir, doc):
        cache = read.get("cache")
        if isinstance(cache, dict) and cache.get("window") == window:
            out[layer] = [(int(r), float(s) / whole) for r, s in zip(cache["rows"], cache["seconds"])]
    return out or None


def sparse_read_calls(pack_dir, window: int, doc=None) -> dict | None:
    """{layer: {"window": [reads, bytes], "uncached": [reads, bytes], "cache": [(rows, reads,
    bytes)]}}: the mean reads and bytes per token calibration's held-out predictions issued
    through the read planner (stats.read_s.window_reads: with a neuron cache of `window` tokens,
    windows beyond the measured ones use the largest; "uncached": window 1; "cache": the smaller
    caches of stats.read_s.cache when measured at this window), for budget.priced_read_fractions
    to price with the machine's current cost model; None when the pack has no such record
    (calibrated before it was kept: use sparse_read_fraction)."""
    out = {}
    for layer, read, _ in _measured_reads(pack_dir, doc):
        per_window = read.get("window_reads")
        if not per_window:
            continue
        cache = read.get("cache")
        by_rows = [(int(r), *map(float, rb)) for r, rb in zip(cache["rows"], cache["reads"])] \
            if isinstance(cache, dict) and cache.get("window") == window and cache.get("reads") else []
        out[layer] = {"window": [float(v) for v in per_window[min(window, len(per_window)) - 1]],
                      "uncached": [float(v) for v in per_window[0]], "cache": by_rows}
    return out or None


def _measured_reads(pack_dir, doc=None) -> list:
    """[(layer, stats.read_s, seconds to read the layer whole)] for the layers whose predictors
    carry calibration's measured read costs ([] when the pack has no predictors)."""
    doc = doc if doc is not None else read_predictors_json(pack_dir)
    out = []
    for key, entry in (doc or {}).get("layers", {}).items():
        read = (entry.get("stats") or {}).get("read_s")
        if isinstance(read, dict) and read.get("whole_s"):
            out.append((int(key), read, float(read["whole_s"])))
    return out


def calibrated_capacity(pack_dir, window: int, doc=None) -> dict:
    """{layer: Req_i}: neuron rows that hold the union of predicted-active neurons over the last
    `window` tokens (the calibration text's 99th percentile, windows 1..max_window measured).

    Beyond the measured windows the union's last increment is extrapolated linearly (an upper
    bound, the union grows concavely), capped at the layer's neuron count.
    """
    if window < 1:
        raise FlashError(f"window {window}: must be at least 1 token")
    doc = doc if doc is not None else read_predictors_json(pack_dir)
    if doc is None:
        raise FlashError(f"{Path(pack_dir) / PREDICTORS_JSON}: missing; run python -m mlx_flash.calibrate")
    out = {}
    for key, entry in doc["layers"].items():
        caps, n = entry["capacity"], int(entry["n_neurons"])
        if window <= len(caps):
            out[int(key)] = int(caps[window - 1])
        else:
            step = caps[-1] - caps[-2] if len(caps) > 1 else caps[-1]
            out[int(key)] = int(min(n, caps[-1] + step * (window - len(caps))))
    return out
