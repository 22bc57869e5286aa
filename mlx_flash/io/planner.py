"""Read planner: merge neighbouring bundles into one larger read when the cost model says so.

The cost of one read is a measured curve (io/read_cost.py): seconds per read at several read
sizes and depths (reads in flight), measured cold once per machine, storage device and I/O engine
(`calibrate`) and kept in $MLX_FLASH_HOME/io_profile.json (default ~/.cache/mlx_flash). Two
requested ranges are read as one when one read of both and the gap between costs no more than two
reads (the paper's "read more than needed, in larger chunks, and discard"). `ReadCost`, a straight
line latency + n / bandwidth, remains for explicit models (tests, older profiles).
"""

import importlib
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import FlashError
from ..paths import flash_home, read_json_file, write_json_atomic
from .files import FileLayer
from .read_cost import (DEFAULT_DEPTHS, DEFAULT_SIZES, LANDING_VERSION, MEASURED_FORMAT, ReadCostCurve,
                        measure_curve, warn_if_loaded)

DEFAULT_MAX_READ = 1 << 20  # bytes; larger merged reads stop helping and cost parallelism


def _plan_strided_kernel():
    """The kernels' plan_strided_reads (one pass per layer's ids, ~20x the numpy version's speed on
    a few hundred ids), or None when the extension is missing or older."""
    try:
        return importlib.import_module("mlx_flash._ext").plan_strided_reads  # by name: optional module
    except (ImportError, AttributeError):
        return None


plan_strided_kernel = _plan_strided_kernel()


@dataclass
class ReadCost:
    """Per-read latency (seconds) and streaming bandwidth (bytes/second) of one device; optionally
    the seconds per destination segment beyond a read's first and the bytes per second of read
    time that copying staged rows out adds (read_cost.stage_saves_time; 0: unmeasured, reads
    land zero copy)."""
    latency_s: float
    bandwidth: float
    segment_s: float = 0.0
    copy_bandwidth: float = 0.0

    def seconds(self, nbytes):
        """Seconds per read of `nbytes` (scalar or numpy array)."""
        return self.latency_s + np.asarray(nbytes) / self.bandwidth

    @property
    def merge_gap(self) -> int:
        """Largest gap (bytes) worth reading through instead of issuing another read."""
        return int(self.latency_s * self.bandwidth)

    def merge_gap_for(self, length: int) -> int:
        """The merge gap between requests of `length` bytes (the same for every length here)."""
        return self.merge_gap


def _profile_key(path, threads, engine) -> str:
    return f"dev{os.stat(path).st_dev}-t{threads}-{engine}"


def _curve_key(path, engine) -> str:
    return f"dev{os.stat(path).st_dev}-{engine}-curve"


def profile_file():
    """Where the device read-cost profiles are stored: $MLX_FLASH_HOME/io_profile.json."""
    return flash_home() / "io_profile.json"


def _stored_profiles(f, say=True) -> dict:
    """The profiles stored in `f` (profile_file()), {} when there is none; a damaged file (not
    JSON, not an object, unreadable, too large) counts as none, with one stderr line naming it:
    every profile in it is measured again and the file rewritten on the next save (which says
    nothing: `say` False)."""
    if not os.path.lexists(f):
        return {}
    try:
        return read_json_file(f, "read-cost profile")
    except FlashError as e:
        if say:
            print(f"mlx_flash: ignoring the read-cost profiles in {e}; they are measured again", file=sys.stderr)
        return {}


def load_cost(path, threads, engine="threads") -> ReadCostCurve | ReadCost | None:
    """The stored cost model of the device holding `path` for reads issued by `engine` ('threads'
    or 'aio'): its measured curve priced at `threads` reads in flight, else an older straight-line
    profile measured at exactly `threads`, else None. An AIO curve whose segment and copy terms
    were measured an older way (read_cost.LANDING_VERSION) counts as none: measured again once.
    A curve measured on a loaded machine is used, with one stderr line (read_cost.warn_if_loaded);
    a damaged file or entry counts as none, with one stderr line (_stored_profiles)."""
    f = profile_file()
    data = _stored_profiles(f)
    key = _curve_key(path, engine)
    curve = data.get(key)
    try:
        if curve and (engine != "aio" or curve.get("landing_version", 1) >= LANDING_VERSION):
            cost = ReadCostCurve.from_dict(curve, depth=threads, engine=engine)
            warn_if_loaded(cost, f, key)
            return cost
        if curve:
            return None
        key = _profile_key(path, threads, engine)
        entry = data.get(key)
        return ReadCost(float(entry["latency_s"]), float(entry["bandwidth"])) if entry else None
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        print(f"mlx_flash: ignoring the read-cost profile {f} [{key}]: damaged entry ({type(e).__name__}: "
              f"{str(e)[:120]}); it is measured again", file=sys.stderr)
        return None


def save_cost(path, threads, cost, engine="threads"):
    """Store a ReadCostCurve for the device of `path` (all depths) or a ReadCost at `threads`."""
    f = profile_file()
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only cache home: the profile is measured again next time
        return
    data = _stored_profiles(f, say=False)
    measured = {"measured": getattr(cost, "measured", None) or time.strftime(MEASURED_FORMAT)}
    if isinstance(cost, ReadCostCurve):
        data[_curve_key(path, engine)] = {**cost.to_dict(), **measured}
    else:
        data[_profile_key(path, threads, engine)] = {**asdict(cost), **measured}
    try:
        write_json_atomic(f, data)
    except FlashError:  # a read-only or full cache home: the profile is measured again next time
        pass


def calibrate(directory=None, *, threads=32, file_bytes=64 << 20, sizes=DEFAULT_SIZES, depths=DEFAULT_DEPTHS,
              max_reads=512, repeats=2, files: FileLayer | None = None, save=True, key_path=None,
              engine="threads", read_path=None) -> ReadCostCurve:
    """Measure the read-cost curve cold on an existing file (`read_path`, opened read-only, e.g. a
    pack's largest bundle file: nothing is written) or on a scratch file written in `directory`
    (read_cost.measure_curve: every size at every depth, `threads` among the depths) and store it
    for the device of `key_path` (default: `read_path` or `directory`). Returns it priced at
    `threads` in flight. ~5-15 s. A curve measured on a loaded machine is stored (with its load)
    and reported in one stderr line (read_cost.warn_if_loaded).
    """
    depths = sorted(set(depths) | {threads})
    curve = measure_curve(directory, sizes=sizes, depths=depths, file_bytes=file_bytes, engine=engine,
                          files=files, repeats=repeats, max_reads=max_reads,
                          read_path=read_path).at_depth(threads)
    if save:
        key_path = key_path or read_path or directory
        save_cost(key_path, threads, curve, curve.engine)
        warn_if_loaded(curve, profile_file(), _curve_key(key_path, curve.engine))
    return curve


def plan_read_arrays(starts, length, *, align=1, cost: ReadCost | None = None,
                     max_read=DEFAULT_MAX_READ):
    """Group sorted request start offsets (bytes, each request `length` bytes: an int, or one per
    request for variable-length ENDOR bundles, whose mean sets the merge gap) into reads.

    Returns numpy arrays (read_start, read_end, first_request): read k covers requests
    first_request[k] .. first_request[k+1]-1, with its bounds rounded out to `align`.
    cost=None: one read per request (no merging). Otherwise a request joins the previous read
    when the gap between them is at most the cost model's merge gap for requests of `length`
    bytes (one read through the gap costs no more than two reads) and the read stays <= max_read
    bytes (or holds a single request).
    """
    starts = np.asarray(starts, np.int64)
    n = len(starts)
    a0 = starts // align * align
    a1 = -(-(starts + length) // align) * align
    if n == 0 or cost is None:
        return a0, a1, np.arange(n)
    mean_length = int(length) if np.ndim(length) == 0 else int(np.mean(length))
    new = np.ones(n, bool)  # sorted, non-overlapping requests: a1 never decreases
    new[1:] = a0[1:] - a1[:-1] > cost.merge_gap_for(mean_length)
    first = np.flatnonzero(new)
    bounds = np.append(first, n)
    long_runs = np.flatnonzero(a1[bounds[1:] - 1] - a0[first] > max_read)
    if len(long_runs):  # split each run longer than max_read greedily
        cut, lo_list, hi_list = [], a0.tolist(), a1.tolist()  # Python ints: ~10x numpy scalars
        for lo, hi in zip(bounds[long_runs].tolist(), bounds[long_runs + 1].tolist()):
            r0 = lo_list[lo]
            for j in range(lo + 1, hi):
                if hi_list[j] - r0 > max_read:
                    cut.append(j)
                    r0 = lo_list[j]
        first = np.sort(np.concatenate([first, np.array(cut, np.int64)]))
        bounds = np.append(first, n)
    return a0[first], a1[bounds[1:] - 1], first


def member_reads(first, n: int) -> np.ndarray:
    """The read holding each of `n` bundles, reads k holding bundles first[k]..first[k + 1] - 1."""
    return np.repeat(np.arange(len(first)), np.diff(np.append(first, n)))


def sort_bundle_ids(ids, count, path="bundle file"):
    """(sorted ids, index: where each was in `ids`, a stable sort) of bundle ids (int64); FlashError
    naming `path` for an id outside 0..count-1 or a repeated id."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(ids) and (ids.min() < 0 or ids.max() >= count):
        raise FlashError(f"{path}: bundle id out of range 0..{count - 1}")
    index = np.argsort(ids, kind="stable")
    ids = ids[index]
    if len(ids) > 1 and not (np.diff(ids) > 0).all():
        raise FlashError(f"{path}: duplicate bundle ids in one read")
    return ids, index


def plan_strided(ids, count, offset, stride, *, align=1, cost: ReadCost | None = None,
                 max_read=DEFAULT_MAX_READ, path="bundle file"):
    """The reads of bundles `ids` (int64, any order) of a plain layer whose bundle i is `stride`
    bytes at file offset `offset + i * stride` (bytes): (sorted ids, index, starts, lengths, r0,
    r1, first, member_read) where index[i] is the position of ids[i] in `ids`, starts / lengths
    each bundle's file range, reads r0..r1 hold bundles first[k].. as plan_read_arrays plans
    them, and member_read[i] is the read holding bundle i. The kernels' one pass when built, else
    numpy; FlashError naming `path` for an id outside 0..count-1 or a repeated id."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if plan_strided_kernel is not None:
        gap = cost.merge_gap_for(int(stride)) if cost is not None and len(ids) else 0
        out = np.empty((8, len(ids)), np.int64)
        k = plan_strided_kernel(ids, count, offset, stride, align, cost is not None, gap, max_read, out)
        if k >= 0:
            ids, index, starts, lengths, r0, r1, first, member_read = out
            return ids, index, starts, lengths, r0[:k], r1[:k], first[:k], member_read
    ids, index = sort_bundle_ids(ids, count, path)
    starts = offset + ids * stride
    r0, r1, first = plan_read_arrays(starts, stride, align=align, cost=cost, max_read=max_read)
    return ids, index, starts, np.full(len(ids), stride, np.int64), r0, r1, first, member_reads(first, len(ids))


@dataclass
class ReadPlan:
    """The planned reads of some bundles of one layer (FlashLoader.plan). Read k covers file bytes
    r0[k]..r1[k] and bundles ids[first[k]: first[k + 1]]; ids are sorted and index[i] is where
    ids[i] was in the array the plan was made from. starts / lengths: each bundle's file range
    (bytes); align: the alignment the reads are rounded out to (bytes); member_read: the read
    holding each bundle when the planner gave it (else None: derived from `first`)."""
    layer: object
    ids: np.ndarray
    index: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    r0: np.ndarray
    r1: np.ndarray
    first: np.ndarray
    align: int
    member_read: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def read_bytes(self) -> int:
        """Bytes its reads cover (what they stage)."""
        return int((self.r1 - self.r0).sum())

    def take(self, lo: int, hi: int) -> "ReadPlan":
        """The plan of bundles ids[lo:hi] alone: the reads between keep their bounds; a read cut
        at either end covers just its bundles on this side, rounded out to `align`."""
        if hi <= lo:
            empty = np.zeros(0, np.int64)
            return ReadPlan(self.layer, empty, empty, empty, empty, empty, empty, empty, self.align)
        k0 = int(np.searchsorted(self.first, lo, side="right")) - 1
        k1 = int(np.searchsorted(self.first, hi - 1, side="right"))
        r0, r1 = self.r0[k0:k1].copy(), self.r1[k0:k1].copy()
        r0[0] = self.starts[lo] // self.align * self.align
        r1[-1] = -(-(self.starts[hi - 1] + self.lengths[hi - 1]) // self.align) * self.align
        first = np.maximum(self.first[k0:k1], lo) - lo
        return ReadPlan(self.layer, self.ids[lo:hi], self.index[lo:hi], self.starts[lo:hi],
                        self.lengths[lo:hi], r0, r1, first, self.align)


def plan_reads(starts, length, *, align=1, cost: ReadCost | None = None,
               max_read=DEFAULT_MAX_READ):
    """plan_read_arrays as a list [(read_start, read_end, [request indices])]."""
    r0, r1, first = plan_read_arrays(starts, length, align=align, cost=cost, max_read=max_read)
    bounds = np.append(first, len(starts)).tolist()
    return [(int(a), int(b), list(range(bounds[k], bounds[k + 1])))
            for k, (a, b) in enumerate(zip(r0.tolist(), r1.tolist()))]
