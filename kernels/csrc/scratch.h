// Scratch memory that a kernel keeps between its calls, one per calling thread.
//
// A buffer of a megabyte or more that a call allocates and frees is returned to the system by
// glibc on free (its mmap and trim thresholds), so the next call page-faults every page of it in
// again, zeroed by the kernel. The prefill kernels' per-call copies of the keys and values (1 MiB
// each for a 2,080-token context of 4 kv heads x 64) took 0.9-1.0 ms a call that way against
// 0.37-0.40 ms with the memory kept (Intel Xeon with AMX, 2 threads).
#pragma once

#include <cstddef>
#include <memory>

namespace tgq_cpu {

// Buffers up to this size are kept for the thread's next call; a larger one lives for one call.
constexpr size_t kMaxKeptScratchBytes = size_t{64} << 20;

// One use's buffer (declare it `thread_local`): `get(count)` returns room for `count` values,
// uninitialised, valid until the next `get` on the same object.
template <typename T>
class Scratch {
 public:
  T* get(size_t count) {
    if (count * sizeof(T) > kMaxKeptScratchBytes) {
      once_ = std::make_unique_for_overwrite<T[]>(count);
      return once_.get();
    }
    once_.reset();
    if (count > capacity_) {
      kept_ = std::make_unique_for_overwrite<T[]>(count);
      capacity_ = count;
    }
    return kept_.get();
  }

 private:
  std::unique_ptr<T[]> kept_, once_;
  size_t capacity_ = 0;
};

}  // namespace tgq_cpu
