"""ENDOR: unstructured pruning (prune.py) and the bitmap + non-zeros encoding of pruned rows.

The encoding is on-disk format, so it lives in mlx_flash.pack.bitmap (numpy reference + dispatch
to the C++ decode kernel kernels/endor_decode.cpp); it is re-exported here as `bitmap`.
"""

from ..pack import bitmap

__all__ = ["bitmap"]
