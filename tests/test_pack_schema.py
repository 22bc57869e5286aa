"""pack/schema.py: manifest.json is untrusted input. Every bad value gives one FlashError line naming
the file and the field before anything is allocated or read; never wrong text, a hang or a crash."""

import json
import math
import os

import pytest
from conftest import flash_error_within

from mlx_flash.errors import FlashError
from mlx_flash.pack import load_pack_weights, read_manifest, write_pack
from mlx_flash.pack.schema import CHECKSUM_KEY, metadata_crc32, write_metadata


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    from conftest import write_tiny_llama

    root = tmp_path_factory.mktemp("schema")
    src = write_tiny_llama(root / "src", layers=2, intermediate=96, quantize=(4, 32))
    return write_pack(src, root / "pack", progress=False)


@pytest.fixture
def edit(pack, tmp_path):
    """edit(change, resign=True) -> a copy of the pack whose manifest `change(manifest)` edited
    (re-signed with a fresh checksum unless resign=False, so the schema checks are reached)."""
    import shutil

    def make(change, resign=True):
        out = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
        shutil.copytree(pack, out)
        m = json.loads((out / "manifest.json").read_text())
        change(m)
        if resign:
            write_metadata(out / "manifest.json", m)
        else:
            (out / "manifest.json").write_text(json.dumps(m))
        return out

    return make


def assert_refused(path, match):
    with pytest.raises(FlashError, match=match) as e:
        read_manifest(path)
    assert "\n" not in str(e.value) and "manifest.json" in str(e.value)


def test_written_manifest_carries_its_checksum(pack):
    m = json.loads((pack / "manifest.json").read_text())
    assert m[CHECKSUM_KEY] == metadata_crc32(m)
    read_manifest(pack)


def test_edit_without_checksum_is_refused(edit):
    def relabel(m):  # float16 scales relabelled as bfloat16: same length, wrong values
        comp = next(c for c in m["bundles"][0]["components"] if c["name"] == "up.scales")
        comp["dtype"] = "bfloat16" if comp["dtype"] != "bfloat16" else "float16"

    assert_refused(edit(relabel, resign=False), "metadata_crc32 does not match")
    assert_refused(edit(lambda m: m.pop(CHECKSUM_KEY), resign=False), "metadata_crc32 is missing")


def _bundle(i, key, value):
    def change(m):
        m["bundles"][i][key] = value
    return change


def _config(key, value):
    def change(m):
        m["config"][key] = value
    return change


def _comp(name, key, value):
    def change(m):
        next(c for c in m["bundles"][0]["components"] if c["name"] == name)[key] = value
    return change


CASES = {
    "smaller count": (_bundle(0, "count", 64), r"bundles\[0\]\.(length|count)"),
    "count and length shrunk together": (
        lambda m: m["bundles"][0].update(count=64, length=64 * m["bundles"][0]["stride"]),
        r"bundles\[0\]\.(count = 64, but the config|checksums.length)"),
    "huge count": (_bundle(0, "count", 1 << 40), r"bundles\[0\]\.count = \d+ is out of range"),
    "duplicate layer": (_bundle(1, "layer", 0), r"bundles\[1\]\.layer = 0 appears twice"),
    "layer past the model": (_bundle(1, "layer", 1000), "layer 1000 is beyond config.num_hidden_layers"),
    "zero stride": (_bundle(0, "stride", 0), r"bundles\[0\]\.stride = 0 is out of range"),
    "zero alignment": (lambda m: m.update(alignment=0), "alignment = 0 is out of range"),
    "odd alignment": (lambda m: m.update(alignment=1000), "alignment = 1000 is not a power of two"),
    "missing bundles": (lambda m: m.pop("bundles"), "bundles is missing"),
    "missing component offset": (_comp("up.weight", "offset", None), r"components\[\d\]\.offset must be an integer"),
    "missing key in a bundle": (lambda m: m["bundles"][0].pop("stride"), r"bundles\[0\]\.stride is missing"),
    "string where a number goes": (_bundle(0, "offset", "0"), r"bundles\[0\]\.offset must be an integer"),
    "unknown dtype": (_comp("up.weight", "dtype", "float128"), r"dtype = 'float128' is not one of"),
    "dtype of another width": (_comp("up.scales", "dtype", "float16"), r"length = \d+ bytes, but shape"),
    "component past the stride": (_comp("up.biases", "offset", 1 << 20), r"offset = \d+ is out of range"),
    "NaN rms_norm_eps": (_config("rms_norm_eps", math.nan), "config.rms_norm_eps must be a finite number"),
    "negative rms_norm_eps": (_config("rms_norm_eps", -1.0), "config.rms_norm_eps = -1.0 is out of range"),
    "huge vocab_size": (_config("vocab_size", 1 << 40), "config.vocab_size = \\d+ is out of range"),
    "vocab_size vs embedding": (_config("vocab_size", 4096), "config.vocab_size = 4096, but model.embed_tokens"),
    "hidden_size vs rows": (_config("hidden_size", 128), r"hidden_size 128 needs"),
    "group_size 0": (lambda m: m["config"]["quantization"].update(group_size=0),
                     "config.quantization.group_size = 0 is out of range"),
    "bits 0": (_comp("up.weight", "quantization", {"group_size": 32, "bits": 0}),
               r"quantization.bits = 0 is out of range"),
    "checksum table too short": (lambda m: m["bundles"][0]["checksums"].update(length=4),
                                 r"checksums.length = 4, but 96 bundles need 384"),
    "file shorter than its regions": (_bundle(0, "file_length", 4096), r"run past file_length 4096"),
    "not an object": (lambda m: m.update(bundles=[17]), r"bundles\[0\] must be an object"),
    "bundles not a list": (lambda m: m.update(bundles=True), "bundles must be a list"),
    "resident.endor null": (lambda m: m["resident"].update(endor=None), "resident.endor must be an object"),
    "resident.endor without shape": (lambda m: m["resident"].update(endor={"w": {"payload": {}}}),
                                     r"resident.endor\['w'\].shape is missing"),
    # the memory plan adds memory_length up (a string gave a TypeError in sparse/budget.py)
    "resident.memory_length a string": (lambda m: m["resident"].update(memory_length="x"),
                                        "resident.memory_length must be an integer"),
    "resident.memory_length a list": (lambda m: m["resident"].update(memory_length=[1]),
                                      "resident.memory_length must be an integer"),
    "resident.memory_length below length": (lambda m: m["resident"].update(memory_length=-5),
                                            "resident.memory_length = -5 is out of range"),
    "resident.memory_length without ENDOR": (
        lambda m: m["resident"].update(memory_length=m["resident"]["length"] + 4),
        r"resident.memory_length = \d+, but with no ENDOR tensors it is resident.length"),
    "rope_theta null": (_config("rope_theta", None), "config.rope_theta must be a finite number"),
    "rms_norm_eps null": (_config("rms_norm_eps", None), "config.rms_norm_eps must be a finite number"),
    "resident.endor without nnz": (
        lambda m: m["resident"].update(endor={"w": {"shape": [4, 4], "dtype": "float16", "payload": {}}}),
        r"resident.endor\['w'\].nnz is missing"),
    "resident.endor without dtype": (
        lambda m: m["resident"].update(endor={"w": {"shape": [4, 4], "nnz": 3, "payload": {}}}),
        r"resident.endor\['w'\].dtype is missing"),
    "resident.endor nnz past its shape": (
        lambda m: m["resident"].update(endor={"w": {"shape": [4, 4], "dtype": "float16", "nnz": 17,
                                                    "payload": {}}}),
        r"resident.endor\['w'\].nnz = 17 is out of range 0..16"),
    "resident.endor without its pieces": (
        lambda m: m["resident"].update(endor={"w": {"shape": [4, 4], "dtype": "float16", "nnz": 3,
                                                    "payload": {}}}),
        r"resident.endor\['w'\] needs the resident tensor w.endor_bitmap"),
    "config null": (lambda m: m.update(config=None), "config must be an object"),
    "resident null": (lambda m: m.update(resident=None), "resident must be an object"),
    "config without resident": (lambda m: m.pop("resident"), "resident is missing"),
    "no model_type": (lambda m: m["config"].pop("model_type"), "config.model_type is missing"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_field_is_one_line_naming_it(edit, case):
    change, match = CASES[case]
    assert_refused(edit(change), match)


@pytest.mark.parametrize("target, match", [
    ("../../../../etc/passwd", "must be a relative path inside the pack"),
    ("/dev/zero", "must be a relative path inside the pack"),
    ("bundles/../../outside.bin", "must be a relative path inside the pack"),
    ("bundles/link.bin", "leads outside the pack"),
    ("bundles/fifo.bin", "is not a regular file"),
    ("bundles/dev.bin", "leads outside the pack"),  # a symlink to /dev/zero
    ("bundles/missing.bin", "cannot read"),
])
def test_bundle_file_names_only_regular_files_inside_the_pack(edit, target, match, tmp_path):
    def change(m):
        m["bundles"][0]["file"] = target

    path = edit(change)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\0" * (1 << 20))
    os.symlink(outside, path / "bundles" / "link.bin")
    os.mkfifo(path / "bundles" / "fifo.bin")
    os.symlink("/dev/zero", path / "bundles" / "dev.bin")
    error = flash_error_within(lambda: load_pack_weights(path))
    assert match in error, error


def test_manifest_that_is_a_fifo_or_huge_is_refused(tmp_path):
    os.mkfifo(tmp_path / "manifest.json")
    with pytest.raises(FlashError, match="not a regular file"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # deep nesting
    with pytest.raises(FlashError, match=r"manifest\.json: not JSON this reader can parse \(nested too deeply\)"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('["mlx-flash-pack"]')
    with pytest.raises(FlashError, match=r"manifest\.json: not a JSON object \(an array\)"):
        read_manifest(tmp_path)


def test_resident_file_is_checked_like_bundles(edit):
    def change(m):
        m["resident"]["file"] = "/etc/passwd"

    assert_refused(edit(change), "resident.file = '/etc/passwd' must be a relative path")


@pytest.fixture(scope="module")
def mixed_pack(tmp_path_factory):
    from conftest import write_tiny_moe

    root = tmp_path_factory.mktemp("mixed")
    src = write_tiny_moe(root / "src", "mixtral", experts=4, layers=2)
    return write_pack(src, root / "pack", progress=False, group_size=32,
                      expert_bits={0: [2, 4, 8, 4], 1: [3, 3, 3, 3]})


def _edited(pack, tmp_path, change):
    import shutil

    out = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
    shutil.copytree(pack, out)
    m = json.loads((out / "manifest.json").read_text())
    change(m)
    write_metadata(out / "manifest.json", m)
    return out


def _set(path, value):
    def change(m):
        *keys, last = path
        d = m
        for k in keys:
            d = d[k]
        d[last] = value(d[last]) if callable(value) else value
    return change


def _group_comp(layer, group, name, key, value):
    def change(m):
        comp = next(c for c in m["bundles"][layer]["groups"][group]["components"] if c["name"] == name)
        comp[key] = value
    return change


def _relabel_layer_bits(m, layer=1, bits=4):
    """Every width record of a one-group layer says `bits`; its blocks stay 3-bit."""
    b = m["bundles"][layer]
    b["expert_bits"] = [bits] * len(b["expert_bits"])
    b["groups"][0]["bits"] = bits
    for c in b["groups"][0]["components"]:
        if c.get("quantization"):
            c["quantization"]["bits"] = bits


@pytest.mark.parametrize("change, match", [
    (_relabel_layer_bits, r"groups\[0\]\.components\['gate\.weight'\] shape \[.*\] is not 4-bit"),
    (_set(("bundles", 0, "expert_bits", 1), 2), r"expert_bits\[1\] = 2, but its block is in the 4-bit group"),
    (_set(("bundles", 0, "expert_bits", 0), 7), r"expert_bits\[0\] = 7 is not one of"),
    (_set(("bundles", 0, "expert_bits"), [2, 4, 8]), r"expert_bits has 3 widths for 4 experts"),
    (_set(("bundles", 1, "groups", 0, "bits"), 4), r"expert_bits\[0\] = 3, but its block is in the 4-bit"),
    (_group_comp(0, 1, "up.weight", "quantization", {"group_size": 32, "bits": 2}),
     r"groups\[1\]\.components\['up\.weight'\]\.quantization = .* but the group is 4-bit"),
    (_set(("bundles", 0, "groups", 1, "experts"), [1, 0]), r"expert 0 is in two groups"),
    (_set(("bundles", 0, "groups", 0, "offset"), 4096), r"groups\[0\]|overlap"),
])
def test_mixed_width_pack_whose_widths_disagree_with_its_blocks(mixed_pack, tmp_path, change, match):
    read_manifest(mixed_pack)
    assert_refused(_edited(mixed_pack, tmp_path, change), match)


def test_mixed_width_blocks_differ_in_size_and_load_whole_refuses(mixed_pack):
    m = read_manifest(mixed_pack)
    groups = {g.bits: g for g in m.bundles[0].groups}
    assert sorted(groups) == [2, 4, 8] and groups[4].experts == (1, 3)
    assert groups[2].stride < groups[4].stride < groups[8].stride
    assert all(g.stride % m.alignment == 0 for g in groups.values())
    with pytest.raises(FlashError, match="mixed bit widths"):
        load_pack_weights(mixed_pack)


def test_unknown_expert_width_exits_2_in_one_line_from_the_cli(mixed_pack, tmp_path):
    import subprocess
    import sys

    bad = _edited(mixed_pack, tmp_path, _set(("bundles", 0, "expert_bits", 2), 7))
    r = subprocess.run([sys.executable, "-m", "mlx_flash.generate", "--model", str(bad),
                        "--prompt", "hi", "--max-tokens", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "expert_bits[2] = 7 is not one of" in r.stderr
