// The kernels' persistent thread pool (see thread_pool.h).

#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_features.h"
#if FLASH_X86
#include <immintrin.h>
#endif

namespace flash {

// Persistent thread pool. A call is split into chunks that the caller and the workers claim from
// one atomic counter, so a worker that is not scheduled (cores shared with other processes) just
// leaves its chunks to the caller instead of stalling it. Idle workers spin briefly (decode issues
// hundreds of small matvecs per token; a futex wake per call would cost more than the work), then
// sleep on a condition variable.
namespace {

inline void cpu_relax() {
#if FLASH_X86
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { loop(); });
  }
  int size() const { return int(threads_.size()) + 1; }

  // Runs fn(ctx, c) for every c in [0, chunks), on the caller and any worker that is awake.
  void run(ChunkFn fn, const void* ctx, int chunks) {
    if (chunks <= 1 || threads_.empty() || !busy_.try_lock()) {  // nested/concurrent: serial
      for (int c = 0; c < chunks; ++c) fn(ctx, c);
      return;
    }
    for (int base = 0; base < chunks; base += kMaxChunks) run_locked(fn, ctx, base, std::min(kMaxChunks, chunks - base));
    busy_.unlock();
  }

 private:
  // The job's chunk count lives in the state word beside the generation and the next chunk: a
  // worker still looping on the previous job must never compare its counter against the next job's
  // count (a plain field written before the new generation is published let a straggler claim a
  // chunk past the old job's end and run it on the new job's context).
  static constexpr int kMaxChunks = 0xffff;
  static uint64_t pack(uint64_t gen, int total, int next) { return gen << 32 | uint64_t(total) << 16 | uint64_t(next); }

  void run_locked(ChunkFn fn, const void* ctx, int base, int chunks) {
    fn_ = fn;
    ctx_ = ctx;
    base_ = base;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    {
      std::lock_guard<std::mutex> lk(mutex_);
      state_.store(pack(gen, chunks, 0), std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    work(gen);
    for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
      if (spins < 4096) cpu_relax();
      else std::this_thread::yield();
    }
  }

  // Claim and run chunks of generation gen until none are left (or a newer job started).
  void work(uint64_t gen) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if ((s >> 32) != gen) return;
      const int c = int(s & 0xffff), total = int((s >> 16) & 0xffff);
      if (c >= total) return;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      // A claimed chunk keeps its job alive (the caller waits for done_), so fn_/ctx_ are stable.
      fn_(ctx_, base_ + c);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      uint64_t gen;
      while ((gen = state_.load(std::memory_order_acquire) >> 32) == seen) {
        cpu_relax();
        if ((++spins & 255) != 0) continue;
        // Let another runnable thread have this core between polls (mlx-lm builds the next token's
        // graph in Python while this one computes: a busy spin would take a core from it).
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(200)) {
          std::unique_lock<std::mutex> lk(mutex_);
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          cv_.wait(lk, [&] { return (state_.load(std::memory_order_acquire) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      seen = gen;
      work(gen);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex busy_, mutex_;
  std::condition_variable cv_;
  std::atomic<uint64_t> state_{0};  // generation << 32 | chunks << 16 | next chunk to claim
  std::atomic<int> done_{0}, sleepers_{0};
  ChunkFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int base_ = 0;  // chunk index of this round's chunk 0 (jobs over kMaxChunks run in rounds)
};

std::atomic<int> g_threads{0};  // 0: not decided yet

int default_threads() {
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 ? 1 : int(std::min(hc, 16u));
}

Pool& pool() {
  // Leaked on purpose: joining at interpreter exit could block on a sleeping worker.
  static Pool* p = new Pool(std::max(0, num_threads() - 1));
  return *p;
}

}  // namespace

void set_num_threads(int n) {
  g_threads.store(std::max(1, n));
}
int num_threads() {
  int n = g_threads.load();
  if (n == 0) {
    n = default_threads();
    g_threads.store(n);
  }
  return n;
}


int pool_size() { return pool().size(); }

void parallel_for(int chunks, ChunkFn fn, const void* ctx) {
  if (chunks > 0) pool().run(fn, ctx, chunks);
}

}  // namespace flash
