// The emulator's scheduler: runs every GPU thread of a threadgroup as a fiber on one OS thread.
// Included (after msl_shim.h, in msl_emu.h) before the kernel text and its generated entry
// `emu_thread_entry` (emulator.py).
//
// A fiber runs until it calls a SIMD-group function or a barrier, or returns. A SIMD group is
// released when all its live lanes wait at the same SIMD-group call; a threadgroup when all its live
// threads wait at the same threadgroup_barrier. Fibers run in forward, reverse or shuffled order,
// and threadgroups likewise, so a missing barrier shows up as a result that depends on the order.
// The kernel runs in a forked child (emu_run): an out-of-bounds access hits the guard page after a
// buffer and is reported with the buffer and the thread; deadlocks and divergent barriers are
// reported; a hang is killed after the timeout.
#pragma once
// (system headers: msl_shim.h includes them before its address-space macros)

namespace emu {


enum State { RUNNABLE, WAIT_SIMD, WAIT_BARRIER, DONE };
constexpr size_t STACK_BYTES = 128 * 1024;
constexpr int MAX_THREADS = 1024;
constexpr int MAX_BUFFERS = 64;

struct Fiber {
  void* sp;  // saved stack pointer (x86-64 switch) ...
  ucontext_t uc;  // ... or context (elsewhere)
  char* stack;
  State state;
  Site site;
  int op;
  ThreadAttrs attrs;
};
struct SimdGroup {
  int phase;  // values of the exchange in progress go to slot[phase]
  unsigned char values[2][32][SLOT_BYTES];
  int args[2][32];
  uint32_t active[2];
};
// Shared with the parent (MAP_SHARED): the child's error message and where it was.
struct Report {
  char message[4096];
  uint3 group;
};

struct Run {
  void* const* bufs;
  const size_t* buf_bytes;
  const char* const* buf_names;
  int nbufs;
  Fiber fibers[MAX_THREADS];
  int order[MAX_THREADS];
  int nfibers;
  SimdGroup simd[MAX_THREADS / 32];
  Fiber* current;
  void* sched_sp;
  ucontext_t sched_uc;
  char* source_lines;  // unused when null
  Report* report;
  unsigned long long rng;
};
static Run* g_run;

constexpr int MAX_SHARED = 64;
static void* g_shared[MAX_SHARED];
static size_t g_shared_bytes[MAX_SHARED];
static int g_nshared;

void register_shared(void* data, size_t bytes) {
  if (g_nshared < MAX_SHARED) {
    g_shared[g_nshared] = data;
    g_shared_bytes[g_nshared++] = bytes;
  }
  memset(data, 0xff, bytes);  // first reached: no thread of this threadgroup has written it yet
}

static unsigned long long next_random() {
  unsigned long long x = g_run->rng;  // xorshift64*
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  g_run->rng = x;
  return x * 2685821657736338717ull;
}

[[noreturn]] static void fail(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_run->report->message, sizeof(g_run->report->message), fmt, ap);
  va_end(ap);
  _exit(code);
}

static const char* describe_thread(const Fiber* f, char* out, size_t n) {
  const ThreadAttrs& a = f->attrs;
  snprintf(out, n, "thread_position_in_grid (%u, %u, %u) [threadgroup (%u, %u, %u), simdgroup %u lane %u]",
           a.thread_position_in_grid.x, a.thread_position_in_grid.y, a.thread_position_in_grid.z,
           a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y, a.threadgroup_position_in_grid.z,
           a.simdgroup_index_in_threadgroup, a.thread_index_in_simdgroup);
  return out;
}

// ---- context switch ------------------------------------------------------------------------------
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
extern "C" void emu_switch(void** save_sp, void* new_sp);
extern "C" void emu_fiber_start();
asm(R"(
.text
.globl emu_switch
.hidden emu_switch
.type emu_switch,@function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size emu_switch, .-emu_switch
.globl emu_fiber_start
.hidden emu_fiber_start
.type emu_fiber_start,@function
emu_fiber_start:
  call emu_fiber_main
  ud2
.size emu_fiber_start, .-emu_fiber_start
)");
#endif

extern "C" void emu_thread_entry(void* const* bufs, const ThreadAttrs* attrs);

static void to_scheduler() {
  Fiber* f = g_run->current;
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
  emu_switch(&f->sp, g_run->sched_sp);
#else
  swapcontext(&f->uc, &g_run->sched_uc);
#endif
}

extern "C" __attribute__((used, visibility("hidden"))) void emu_fiber_main() {
  Fiber* f = g_run->current;
  emu_thread_entry(g_run->bufs, &f->attrs);
  f->state = DONE;
  to_scheduler();
  __builtin_unreachable();
}

static void start_fiber(Fiber* f) {
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
  uintptr_t top = (uintptr_t(f->stack) + STACK_BYTES) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = uint64_t(uintptr_t(&emu_fiber_start));  // popped by emu_switch's ret
  for (int i = 0; i < 6; i++) *--sp = 0;  // rbp rbx r12-r15
  *--sp = 0x037f00001f80ull;  // mxcsr (low 4 bytes) and x87 control word: the defaults
  f->sp = sp;
#else
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack;
  f->uc.uc_stack.ss_size = STACK_BYTES;
  f->uc.uc_link = nullptr;
  makecontext(&f->uc, reinterpret_cast<void (*)()>(&emu_fiber_main), 0);
#endif
}

static void resume(Fiber* f) {
  g_run->current = f;
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
  emu_switch(&g_run->sched_sp, f->sp);
#else
  swapcontext(&g_run->sched_uc, &f->uc);
#endif
  g_run->current = nullptr;
}

static const char* state_name(const Fiber* f, char* out, size_t n) {
  static const char* ops[] = {"simdgroup_barrier", "simd_sum", "simd_product", "simd_max", "simd_min", "simd_and",
                              "simd_or", "simd_xor", "simd_all", "simd_any", "simd_broadcast",
                              "simd_broadcast_first/simd_is_first", "simd_shuffle", "simd_shuffle_down",
                              "simd_shuffle_up", "simd_shuffle_xor", "simd_shuffle_rotate_down",
                              "simd_shuffle_rotate_up", "simd_prefix_exclusive_sum", "simd_prefix_inclusive_sum",
                              "simd_ballot"};
  if (f->state == DONE) snprintf(out, n, "returned");
  else if (f->state == WAIT_BARRIER) snprintf(out, n, "threadgroup_barrier at line %d", f->site.line);
  else if (f->state == WAIT_SIMD) snprintf(out, n, "%s at line %d", ops[f->op], f->site.line);
  else snprintf(out, n, "running");
  return out;
}

static bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && (a.file == b.file || strcmp(a.file, b.file) == 0);
}

Exchange simd_exchange(int op, const void* value, int size, int arg, Site site) {
  Fiber* f = g_run->current;
  SimdGroup& sg = g_run->simd[f->attrs.simdgroup_index_in_threadgroup];
  int lane = int(f->attrs.thread_index_in_simdgroup);
  int phase = sg.phase;
  std::memcpy(sg.values[phase][lane], value, size);
  sg.args[phase][lane] = arg;
  f->state = WAIT_SIMD;
  f->op = op;
  f->site = site;
  to_scheduler();
  // released: the scheduler flipped sg.phase; our exchange is in the other slot
  return Exchange{sg.values[phase], sg.args[phase], sg.active[phase], lane};
}

void threadgroup_wait(Site site) {
  Fiber* f = g_run->current;
  f->state = WAIT_BARRIER;
  f->site = site;
  to_scheduler();
}

static void set_order(int mode) {
  int n = g_run->nfibers;
  for (int i = 0; i < n; i++) g_run->order[i] = mode == 1 ? n - 1 - i : i;
  if (mode == 2)
    for (int i = n - 1; i > 0; i--) {
      int j = int(next_random() % uint64_t(i + 1));
      int t = g_run->order[i];
      g_run->order[i] = g_run->order[j];
      g_run->order[j] = t;
    }
}

// Releases SIMD groups whose live lanes all wait at one SIMD-group call; true if any was released.
static bool release_simd_groups() {
  bool released = false;
  int n = g_run->nfibers;
  char a[256], b[256], c[256], d[256];
  for (int first = 0; first < n; first += 32) {
    int last = first + 32 < n ? first + 32 : n;
    Fiber* lead = nullptr;
    bool ready = true;
    for (int i = first; i < last && ready; i++) {
      Fiber* f = &g_run->fibers[i];
      if (f->state == DONE) continue;
      if (f->state != WAIT_SIMD) ready = false;
      else if (!lead) lead = f;
      else if (f->op != lead->op || !same_site(f->site, lead->site))
        fail(1, "divergent SIMD-group call: %s waits at %s while %s waits at %s", describe_thread(lead, a, 256),
             state_name(lead, b, 256), describe_thread(f, c, 256), state_name(f, d, 256));
    }
    if (!ready || !lead) continue;
    SimdGroup& sg = g_run->simd[first / 32];
    uint32_t active = 0;
    for (int i = first; i < last; i++)
      if (g_run->fibers[i].state == WAIT_SIMD) {
        active |= 1u << (i - first);
        g_run->fibers[i].state = RUNNABLE;
      }
    sg.active[sg.phase] = active;
    sg.phase ^= 1;
    released = true;
  }
  return released;
}

// Releases the threadgroup when all live threads wait at one barrier; true if released.
static bool release_barrier() {
  int n = g_run->nfibers;
  Fiber *lead = nullptr, *done = nullptr;
  char a[256], b[256], c[256], d[256];
  for (int i = 0; i < n; i++) {
    Fiber* f = &g_run->fibers[i];
    if (f->state == DONE) { done = done ? done : f; continue; }
    if (f->state != WAIT_BARRIER) return false;
    if (!lead) lead = f;
    else if (!same_site(f->site, lead->site))
      fail(1, "divergent threadgroup_barrier: %s waits at %s while %s waits at %s", describe_thread(lead, a, 256),
           state_name(lead, b, 256), describe_thread(f, c, 256), state_name(f, d, 256));
  }
  if (!lead) return false;
  if (done)
    fail(1, "divergent threadgroup_barrier: %s returned while %s waits at %s (every thread of a threadgroup "
         "must reach each barrier)", describe_thread(done, a, 256), describe_thread(lead, c, 256),
         state_name(lead, d, 256));
  for (int i = 0; i < n; i++) g_run->fibers[i].state = RUNNABLE;
  return true;
}

[[noreturn]] static void deadlock() {
  char msg[3500];
  size_t used = 0;
  int shown = 0;
  char a[256], b[256];
  for (int i = 0; i < g_run->nfibers && shown < 6; i++) {
    Fiber* f = &g_run->fibers[i];
    if (f->state == DONE) continue;
    used += snprintf(msg + used, sizeof(msg) - used, "; %s: %s", describe_thread(f, a, 256), state_name(f, b, 256));
    shown++;
  }
  fail(1, "deadlock: no thread can go on (a SIMD group whose lanes wait at different calls, or a barrier not "
       "every thread reaches)%s", msg);
}

static void fill_attrs(ThreadAttrs& t, const uint3& grid, const uint3& tg, const uint3& tgpos, const uint3& local,
                       const uint3& actual) {
  uint3 groups{(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y, (grid.z + tg.z - 1) / tg.z};
  uint nthreads = actual.x * actual.y * actual.z;
  uint dispatched = tg.x * tg.y * tg.z;
  uint index = local.x + actual.x * (local.y + actual.y * local.z);
  t.dispatch_quadgroups_per_threadgroup = (dispatched + 3) / 4;
  t.dispatch_simdgroups_per_threadgroup = (dispatched + 31) / 32;
  t.dispatch_threads_per_threadgroup = tg;
  t.grid_origin = uint3{0, 0, 0};
  t.grid_size = grid;
  t.quadgroup_index_in_threadgroup = index / 4;
  t.quadgroups_per_threadgroup = (nthreads + 3) / 4;
  t.simdgroup_index_in_threadgroup = index / 32;
  t.simdgroups_per_threadgroup = (nthreads + 31) / 32;
  t.thread_execution_width = 32;
  t.thread_index_in_quadgroup = index % 4;
  t.thread_index_in_simdgroup = index % 32;
  t.thread_index_in_threadgroup = index;
  t.thread_position_in_grid = uint3{tgpos.x * tg.x + local.x, tgpos.y * tg.y + local.y, tgpos.z * tg.z + local.z};
  t.thread_position_in_threadgroup = local;
  t.threadgroup_position_in_grid = tgpos;
  t.threadgroups_per_grid = groups;
  t.threads_per_grid = grid;
  t.threads_per_simdgroup = 32;
  t.threads_per_threadgroup = actual;
}

static void run_threadgroup(const uint3& grid, const uint3& tg, const uint3& tgpos, int mode) {
  // dispatch_threads: the last threadgroup along each axis holds only the threads inside the grid
  uint3 actual{std::min(tg.x, grid.x - tgpos.x * tg.x), std::min(tg.y, grid.y - tgpos.y * tg.y),
               std::min(tg.z, grid.z - tgpos.z * tg.z)};
  int n = int(actual.x * actual.y * actual.z);
  g_run->nfibers = n;
  for (int i = 0; i < g_nshared; i++) memset(g_shared[i], 0xff, g_shared_bytes[i]);
  g_run->report->group = tgpos;
  for (uint z = 0; z < actual.z; z++)
    for (uint y = 0; y < actual.y; y++)
      for (uint x = 0; x < actual.x; x++) {
        int i = int(x + actual.x * (y + actual.y * z));
        Fiber* f = &g_run->fibers[i];
        fill_attrs(f->attrs, grid, tg, tgpos, uint3{x, y, z}, actual);
        f->state = RUNNABLE;
        start_fiber(f);
      }
  for (int s = 0; s < (n + 31) / 32; s++) g_run->simd[s].phase = 0;
  for (;;) {
    set_order(mode);
    bool ran = false;
    for (int k = 0; k < n; k++) {
      Fiber* f = &g_run->fibers[g_run->order[k]];
      if (f->state == RUNNABLE) {
        resume(f);
        ran = true;
      }
    }
    if (ran) continue;
    bool all_done = true;
    for (int i = 0; i < n; i++) all_done = all_done && g_run->fibers[i].state == DONE;
    if (all_done) return;
    if (release_simd_groups() || release_barrier()) continue;
    deadlock();
  }
}

static void on_fault(int sig, siginfo_t* info, void* ctx) {
  uintptr_t addr = uintptr_t(info->si_addr);
  long page = sysconf(_SC_PAGESIZE);
  const char* access = "access";
#if defined(__x86_64__)
  access = (static_cast<ucontext_t*>(ctx)->uc_mcontext.gregs[REG_ERR] & 2) ? "write" : "read";
#else
  (void)ctx;
#endif
  char who[256] = "the scheduler";
  if (g_run->current) describe_thread(g_run->current, who, sizeof(who));
  for (int i = 0; i < g_run->nbufs; i++) {
    uintptr_t start = uintptr_t(g_run->bufs[i]), end = start + g_run->buf_bytes[i];
    uintptr_t first_page = start & ~uintptr_t(page - 1);
    if (addr >= end && addr < end + uintptr_t(page))
      fail(1, "out-of-bounds %s: %s touched byte %zu of buffer `%s` (%zu bytes): %zu bytes past its end", access,
           who, size_t(addr - start), g_run->buf_names[i], g_run->buf_bytes[i], size_t(addr - end));
    if (addr < first_page && addr + uintptr_t(page) >= first_page)
      fail(1, "out-of-bounds %s: %s touched %zu bytes before the start of buffer `%s` (%zu bytes)", access, who,
           size_t(start - addr), g_run->buf_names[i], g_run->buf_bytes[i]);
  }
  for (int i = 0; i < g_run->nfibers; i++) {
    uintptr_t s = uintptr_t(g_run->fibers[i].stack);
    if (addr + uintptr_t(page) >= s && addr < s)
      fail(1, "stack overflow in %s (emulated threads have %zu KiB of stack)", who, STACK_BYTES / 1024);
  }
  fail(1, "%s (signal %d) at address %p in %s: not next to any buffer (a wild pointer)",
       sig == SIGBUS ? "bus error" : "segmentation fault", sig, info->si_addr, who);
}

static void child(void* const* bufs, const size_t* bytes, const char* const* names, int nbufs, const uint3& grid,
                  const uint3& tg, int mode, unsigned long long seed, Report* report) {
  static Run run;
  g_run = &run;
  run.bufs = bufs;
  run.buf_bytes = bytes;
  run.buf_names = names;
  run.nbufs = nbufs;
  run.report = report;
  run.rng = seed * 0x9e3779b97f4a7c15ull + 1;
  static char alt[64 * 1024];
  stack_t ss{};
  ss.ss_sp = alt;
  ss.ss_size = sizeof(alt);
  sigaltstack(&ss, nullptr);
  struct sigaction sa{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
  int nthreads = int(tg.x * tg.y * tg.z);
  long page = sysconf(_SC_PAGESIZE);
  size_t slot = STACK_BYTES + size_t(page);
  char* stacks = static_cast<char*>(mmap(nullptr, slot * nthreads, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (stacks == MAP_FAILED) fail(1, "emulator: cannot map %d fiber stacks", nthreads);
  for (int i = 0; i < nthreads; i++) {
    mprotect(stacks + i * slot, size_t(page), PROT_NONE);  // guard below each stack
    run.fibers[i].stack = stacks + i * slot + page;
  }
  uint3 groups{(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y, (grid.z + tg.z - 1) / tg.z};
  size_t total = size_t(groups.x) * groups.y * groups.z;
  uint32_t* order = static_cast<uint32_t*>(mmap(nullptr, total * 4 + 4, PROT_READ | PROT_WRITE,
                                                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  for (size_t i = 0; i < total; i++) order[i] = uint32_t(mode == 1 ? total - 1 - i : i);
  if (mode == 2)
    for (size_t i = total; i > 1; i--) {
      size_t j = size_t(next_random() % (i));
      uint32_t t = order[i - 1];
      order[i - 1] = order[j];
      order[j] = t;
    }
  for (size_t k = 0; k < total; k++) {
    uint32_t g = order[k];
    uint3 pos{uint(g % groups.x), uint(g / groups.x % groups.y), uint(g / groups.x / groups.y)};
    run_threadgroup(grid, tg, pos, mode);
  }
}

}  // namespace emu

extern "C" {

// A buffer of `nbytes` whose last byte is followed by an inaccessible page (and whose first page
// is preceded by one), in memory shared with the forked child.
void* emu_alloc(size_t nbytes) {
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  size_t data_pages = (nbytes + page - 1) / page;
  if (data_pages == 0) data_pages = 1;
  size_t total = (data_pages + 2) * page;
  char* base = static_cast<char*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) return nullptr;
  mprotect(base, page, PROT_NONE);
  mprotect(base + (data_pages + 1) * page, page, PROT_NONE);
  return base + (data_pages + 1) * page - nbytes;
}

void emu_free(void* data, size_t nbytes) {
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  size_t data_pages = (nbytes + page - 1) / page;
  if (data_pages == 0) data_pages = 1;
  char* end = static_cast<char*>(data) + nbytes;
  munmap(end - (data_pages + 1) * page, (data_pages + 2) * page);
}

// Runs the kernel over grid/threadgroup in a forked child. mode: 0 forward, 1 reverse, 2 shuffled
// (seed). Returns 0, or 1 (kernel error), 2 (timeout), 3 (the child died otherwise) with `err` set.
int emu_run(void* const* bufs, const size_t* bytes, const char* const* names, int nbufs, const unsigned* grid,
            const unsigned* tg, int mode, unsigned long long seed, double timeout_s, char* err, int errlen) {
  if (tg[0] * tg[1] * tg[2] > unsigned(emu::MAX_THREADS)) {
    snprintf(err, errlen, "threadgroup of %u threads: more than %d", tg[0] * tg[1] * tg[2], emu::MAX_THREADS);
    return 1;
  }
  auto* report = static_cast<emu::Report*>(mmap(nullptr, sizeof(emu::Report), PROT_READ | PROT_WRITE,
                                                MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  report->message[0] = 0;
  fflush(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    emu::child(bufs, bytes, names, nbufs, uint3{grid[0], grid[1], grid[2]}, uint3{tg[0], tg[1], tg[2]}, mode, seed,
               report);
    _exit(0);
  }
  int status = 0, rc = 0;
  timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (long sleep_ns = 20000;; sleep_ns = sleep_ns < 5000000 ? sleep_ns * 2 : sleep_ns) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (double(now.tv_sec - start.tv_sec) + 1e-9 * double(now.tv_nsec - start.tv_nsec) > timeout_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      uint3& g = report->group;
      snprintf(err, errlen, "timeout: the kernel ran over %.1f s (stopped in threadgroup (%u, %u, %u)): a thread "
               "loops forever or waits for something that never happens", timeout_s, g.x, g.y, g.z);
      munmap(report, sizeof(emu::Report));
      return 2;
    }
    timespec ts{0, sleep_ns};
    nanosleep(&ts, nullptr);
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) rc = 0;
  else if (report->message[0]) {
    snprintf(err, errlen, "%s", report->message);
    rc = 1;
  } else {
    snprintf(err, errlen, "the emulated kernel died (%s %d)", WIFSIGNALED(status) ? "signal" : "exit code",
             WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    rc = 3;
  }
  munmap(report, sizeof(emu::Report));
  return rc;
}
}
