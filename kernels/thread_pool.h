// The kernels' persistent thread pool: a job is split into chunks that the calling thread and the
// workers claim from one atomic counter.
#pragma once

namespace flash {

// Runs fn(ctx, c) for c in [0, chunks) on the calling thread and the persistent pool.
using ChunkFn = void (*)(const void* ctx, int chunk);
void parallel_for(int chunks, ChunkFn fn, const void* ctx);

// Threads the kernels use (>= 1): set_num_threads()'s, else the hardware's (at most 16). The C++
// reads no environment variable: mlx_flash.cpu.ops validates MLX_FLASH_THREADS and applies it.
int num_threads();
// Only before the pool exists; later calls just cap how many chunks are used.
void set_num_threads(int n);
// Threads a parallel_for runs on: the caller plus the pool's workers (creates the pool).
int pool_size();

}  // namespace flash
