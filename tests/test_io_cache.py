"""io/cache.py: page-cache eviction and residency."""

import os
import sys

import pytest

from mlx_flash.io import evict, residency

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page cache")


@linux_only
def test_evict_and_residency(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(4 << 20))
    f.read_bytes()
    assert residency(f) > 0.9
    result = evict(tmp_path)
    assert result["method"] == "posix_fadvise(DONTNEED)"
    assert result["residency"] < 0.05 and residency([f]) < 0.05
