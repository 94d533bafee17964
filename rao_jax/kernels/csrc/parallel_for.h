// Runs task(i) for i in [0, n) on the calling thread and XLA's intra-op pool (the FFI
// ThreadPool of the running executable). Tasks are taken from a shared counter, so the call
// uses whatever pool threads are free and never waits on one busy with another op. Shared by
// the handlers in this folder; each handler runs single-threaded MKL inside its tasks (MKL's own
// thread team would fight XLA's pool for the same cores).
#ifndef RAO_JAX_PARALLEL_FOR_H_
#define RAO_JAX_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace rao_jax {

// Shared (through a shared_ptr) by the caller and the pool tasks it scheduled: a task may
// start after the caller has returned, and then finds nothing left to take.
struct ParallelWork {
  std::function<void(int64_t)> task;
  int64_t n = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void Take() {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      task(i);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n,
                        std::function<void(int64_t)> task) {
  if (n <= 0) return;
  auto w = std::make_shared<ParallelWork>();
  w->task = std::move(task);
  w->n = n;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t t = 1; t < std::min(threads, n); ++t) pool.Schedule([w] { w->Take(); });
  w->Take();
  std::unique_lock<std::mutex> lock(w->mu);
  w->all_done.wait(lock, [&] { return w->done.load() == w->n; });
}

}  // namespace rao_jax

#endif  // RAO_JAX_PARALLEL_FOR_H_
