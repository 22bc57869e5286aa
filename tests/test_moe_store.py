"""moe/store.py: expert widths of a pack and how a layer's slots split over its width banks."""

import pytest
from conftest import write_tiny_moe

from mlx_flash.moe.store import expert_layers, expert_widths, split_slots, width_groups
from mlx_flash.pack import read_manifest, write_pack


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    src = write_tiny_moe(root / "src", "mixtral", experts=6, layers=2)
    bits = {0: [2, 4, 4, 8, 2, 2], 1: [3, 3, 3, 3, 3, 3]}
    return (read_manifest(write_pack(src, root / "mixed", progress=False, expert_bits=bits,
                                     group_size=32)),
            read_manifest(write_pack(src, root / "float", progress=False)), bits)


def test_expert_widths_and_groups(packs):
    mixed, dense, bits = packs
    assert expert_widths(mixed) == bits
    assert expert_widths(dense) == {0: [16] * 6, 1: [16] * 6}
    groups = width_groups(expert_layers(mixed)[0])
    assert {w: ids.tolist() for w, (_, ids) in groups.items()} == {2: [0, 4, 5], 4: [1, 2], 8: [3]}
    assert {w: key for w, (key, _) in groups.items()} == {2: (0, 2), 4: (0, 4), 8: (0, 8)}


def test_slots_split_over_widths_by_their_share_of_experts(packs):
    mixed, dense, _ = packs
    layer0 = expert_layers(mixed)[0]
    assert split_slots(layer0, 6) == {2: 3, 4: 2, 8: 1}
    assert split_slots(layer0, 2) == {2: 1, 4: 1, 8: 1}   # every width keeps one slot
    assert split_slots(expert_layers(mixed)[1], 4) == {3: 4}
    assert split_slots(expert_layers(dense)[0], 4) == {0: 4}
