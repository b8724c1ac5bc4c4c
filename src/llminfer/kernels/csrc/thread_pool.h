// llminfer's own worker threads for the kernels' parallel loops (llminfer::parallel_for), in place of
// torch's OpenMP team (at::parallel_for).
//
// Why: libgomp keeps one team per thread that starts a parallel region, and once it manages more threads than
// the process has CPUs it lets idle team threads spin only ~100 iterations before they sleep on a futex
// (GOMP_SPINCOUNT throttling). Any torch op of more than 32768 elements on a second thread (a user's script,
// a benchmark's own measurement) creates a second team and so throttles the engine's. Between two kernels of
// a decode step (tens of microseconds of Python) the model thread's team then falls asleep, and every kernel
// waits for a futex wake. Measured on a 2-core AMD EPYC (Zen 4) VM: a 128 x 512 fp32 product went from
// 5.3 to 46 us per call, the bench model's batch-1 decode from 17-18 to 21.4 ms per token. These workers
// spin for kSpinMicros after each loop whatever other teams exist, then sleep; libgomp's throttling does not
// apply to them. Torch's own team is then kept throttled on purpose (park_openmp_team below), so that its
// idle threads sleep at once instead of spinning on the cores these workers need. That costs torch's own
// parallel regions a wake each, which is why the pool is opt-in ($LLMINFER_KERNEL_THREAD_POOL=1; see
// llminfer/kernels/build.py for the figures both ways).
//
// One loop runs at a time (the engine's steps are serial); a second thread calling in meanwhile runs its loop
// on its own thread. The work split matches at::parallel_for's (contiguous chunks of at least `grain`
// iterations, one per thread), and the kernels' results never depend on the split anyway. The thread count is
// torch's (at::get_num_threads() of the calling thread, which llminfer's thread governor sets per step).
// Workers are created on first use, live until the process exits, and are forgotten in a forked child.
#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace llminfer {

// How long an idle worker polls for the next loop before it sleeps: longer than the gaps between the
// kernels of one decode step, shorter than a human notices as CPU use.
constexpr int64_t kSpinMicros = 2000;

inline void park_openmp_team();

class KernelThreadPool {
 public:
  // The process's pool (re-created in a forked child, whose parent's workers do not exist).
  static KernelThreadPool& get();
  // Whether loops go to the pool or to at::parallel_for (the default); set by llminfer_cpu::use_kernel_thread_pool.
  static std::atomic<bool>& enabled() {
    static std::atomic<bool> on{false};
    return on;
  }

  template <typename F>
  void run(int64_t begin, int64_t end, int64_t chunk, int threads, const F& f) {
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (!owner.owns_lock()) {  // another thread's loop is running: run this one here
      f(begin, end);
      return;
    }
    ensure_workers(threads - 1);
    task_fn_ = [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
    task_ctx_ = &f;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    pending_.store(threads - 1, std::memory_order_relaxed);
    // The generation and the thread count move together in one word: a worker left out of this loop reads
    // none of its other fields, which the next loop may already be rewriting.
    const uint64_t next = ((ticket_.load(std::memory_order_relaxed) >> 16) + 1) << 16;
    ticket_.store(next | static_cast<uint64_t>(threads), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    in_loop() = true;
    f(begin, std::min(end, begin + chunk));
    in_loop() = false;
    // Wait for the workers: spin briefly, then yield the core (a worker may be waiting for it).
    for (int64_t i = 0; pending_.load(std::memory_order_acquire) > 0; ++i) {
      if (i < 4096)
        _mm_pause();
      else
        std::this_thread::yield();
    }
  }

  // True inside a loop's body (a nested parallel_for then runs inline).
  static bool& in_loop() {
    thread_local bool inside = false;
    return inside;
  }

 private:
  KernelThreadPool() = default;

  void ensure_workers(int wanted) {
    while (static_cast<int>(workers_) < wanted) {
      const int index = static_cast<int>(++workers_);  // the caller is thread 0
      std::thread(&KernelThreadPool::work, this, index, ticket_.load(std::memory_order_acquire) >> 16).detach();
    }
  }

  void work(int index, uint64_t seen) {
    in_loop() = true;
    for (;;) {
      uint64_t ticket = ticket_.load(std::memory_order_acquire);
      if ((ticket >> 16) == seen) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
        for (int64_t i = 0; ((ticket = ticket_.load(std::memory_order_acquire)) >> 16) == seen; ++i) {
          _mm_pause();
          if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) {
            std::unique_lock<std::mutex> lock(sleep_mutex_);
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            wake_.wait(lock, [&] { return (ticket_.load(std::memory_order_acquire) >> 16) != seen; });
            sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          }
        }
      }
      seen = ticket >> 16;
      if (index < static_cast<int>(ticket & 0xffff)) {
        const int64_t b = begin_ + index * chunk_;
        if (b < end_) task_fn_(task_ctx_, b, std::min(end_, b + chunk_));
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::mutex owner_;
  std::atomic<unsigned> workers_{0};
  std::atomic<uint64_t> ticket_{0};  // (generation << 16) | threads of the current loop
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  // The current loop (written by its caller before ticket_ moves on, read by the workers after).
  void (*task_fn_)(const void*, int64_t, int64_t) = nullptr;
  const void* task_ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
};

inline KernelThreadPool& KernelThreadPool::get() {
  static std::atomic<KernelThreadPool*> pool{nullptr};
  static std::atomic<pid_t> owner_pid{0};
  static std::mutex create;
  KernelThreadPool* p = pool.load(std::memory_order_acquire);
  const pid_t pid = getpid();
  if (p == nullptr || owner_pid.load(std::memory_order_acquire) != pid) {
    std::lock_guard<std::mutex> lock(create);
    p = pool.load(std::memory_order_acquire);
    if (p == nullptr || owner_pid.load(std::memory_order_acquire) != pid) {
      p = new KernelThreadPool();  // never freed: detached workers use it until the process exits
      park_openmp_team();
      pool.store(p, std::memory_order_release);
      owner_pid.store(pid, std::memory_order_release);
    }
  }
  return *p;
}

// A thread that starts one 2-thread OpenMP team and then waits forever, so that libgomp manages more threads
// than there are CPUs whenever the model thread has a team of its own, and keeps its throttled short spin.
// Without it, torch's team threads spin for milliseconds after each of torch's own parallel regions while
// the pool's workers wait for the same cores (measured on a 2-core Zen 4 VM, batch-32 decode of the bench
// model: 214-434 tok/s on the pool against 522-599 on OpenMP alone; 552-575 with the team throttled).
inline void park_openmp_team() {
  std::thread([] {
    at::set_num_threads(2);
    at::parallel_for(0, 2, 1, [](int64_t, int64_t) {});
    for (;;) std::this_thread::sleep_for(std::chrono::hours(24));
  }).detach();
}

// f(b, e) over [begin, end) in contiguous chunks of at least `grain` iterations, one per thread, like
// at::parallel_for (which it calls instead where the pool is switched off).
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (!KernelThreadPool::enabled().load(std::memory_order_relaxed)) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t n = end - begin;
  int64_t threads = at::get_num_threads();
  if (grain > 0) threads = std::min<int64_t>(threads, (n + grain - 1) / grain);
  if (threads <= 1 || KernelThreadPool::in_loop() || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (n + threads - 1) / threads;
  threads = (n + chunk - 1) / chunk;
  KernelThreadPool::get().run(begin, end, chunk, static_cast<int>(threads), f);
}

}  // namespace llminfer
