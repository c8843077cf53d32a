// Work units shared by the calling thread and XLA's intra-op thread pool: the one way the
// native CPU kernels (attention/cpu_kernel.cc, model/cpu_matmul.cc, model/cpu_lora.cc)
// run in parallel. Each kernel keeps its units and an atomic "next unit" counter in a
// state object owned by a shared_ptr; the caller and up to `helpers` pool tasks claim
// units until none are left, and the caller returns once every task that started has
// finished. A task that starts after the caller returned (the pool was busy) finds no
// unit left and touches only the state its shared_ptr keeps alive, so the caller never
// waits for a queued task, only for running ones.
#ifndef PAGEDJAX_NATIVE_POOL_H_
#define PAGEDJAX_NATIVE_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace pagedjax_native {

// The tasks that may still claim units (guarded by mu), and their wake-up.
struct PoolJoin {
  std::mutex mu;
  std::condition_variable cv;
  int64_t active = 0;
};

// Runs drain(*state) on the calling thread and on `helpers` pool tasks, then waits for
// the tasks that started. State has a `PoolJoin join` member; drain claims units until
// none are left (it must not block on other units).
template <typename State, typename Drain>
void RunWithHelpers(xla::ffi::ThreadPool& pool, const std::shared_ptr<State>& state,
                    int64_t helpers, Drain drain) {
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([state, drain] {
      {
        std::lock_guard<std::mutex> lock(state->join.mu);
        ++state->join.active;
      }
      drain(*state);
      std::lock_guard<std::mutex> lock(state->join.mu);
      if (--state->join.active == 0) state->join.cv.notify_all();
    });
  }
  drain(*state);
  std::unique_lock<std::mutex> lock(state->join.mu);
  state->join.cv.wait(lock, [&] { return state->join.active == 0; });
}

}  // namespace pagedjax_native

#endif  // PAGEDJAX_NATIVE_POOL_H_
