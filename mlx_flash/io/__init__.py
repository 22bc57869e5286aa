"""The flash loader: direct (uncached), parallel reads of pack bundles into MLX arrays.

    loader = FlashLoader(pack_dir, threads=32)          # opens bundle files lazily
    dest = loader.alloc(layer, n_slots)                 # {"up.weight": mx.array [n, ...], ...}
    stats = loader.read(layer, neuron_ids, dest, slots) # bundle ids[k] -> row slots[k]

Destination design. A compute module wants each component as its own array (gate/up rows and
their scales/biases for quantized_matmul(transpose=True), down_t rows for transpose=False), so
`alloc` gives one contiguous MLX array per component with one row per cache slot, and a read
scatters each bundle into those rows: the arrays' memory is reached through the buffer protocol
(`memoryview(arr)` of an evaluated, row-contiguous MLX array is writable and shares memory; see
tests/test_io.py::test_buffer_is_zero_copy). `alloc_raw` instead gives one page-aligned uint8
[n, stride] array of whole bundles (for the I/O benchmark and future compressed encodings).

Copies. Through the page cache (buffered fallback) a read is one preadv whose iovecs point at the
destination rows: zero copy. With O_DIRECT, buffer addresses, lengths and file offsets must all be
multiples of the block size; when every iovec of a read is (raw destinations with a stride that is
a multiple of 4 KiB) the read is zero copy too, otherwise it lands in a per-thread page-aligned
mmap bounce buffer and each component row is memcpy'd out (one copy, at memory bandwidth).

Reads: the planner (planner.py) turns requested bundles into aligned reads, merging neighbours
when the measured cost model says so; on Linux one thread keeps them in flight with native AIO
(aio.py; zero-copy reads are vectored straight into the rows) while finishing threads check and
scatter what landed, elsewhere a thread pool issues them (os.preadv releases the GIL); short
reads and EINTR are retried; EOF, EIO and crc32 mismatches raise FlashError with the
file and offset. Page-cache eviction and residency: cache.py.
"""

from .cache import evict, residency
from .files import FileLayer
from .loader import FlashLoader, ReadStats, host_bytes
from .planner import ReadCost, calibrate, load_cost, plan_reads

__all__ = ["FlashLoader", "ReadStats", "FileLayer", "ReadCost", "calibrate", "load_cost",
           "plan_reads", "evict", "residency", "host_bytes"]
