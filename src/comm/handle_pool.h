// A pool of equal-sized device blocks for handles. prepare() takes a block, the handle gives it
// back when destroyed: no cudaMalloc/cudaFree (which synchronises) on the hot path, and a steady
// training loop reuses the same addresses, which a captured CUDA graph needs.
//
// Reuse is safe under stream order: a block is handed out again only to work queued after the
// release on the group's stream. The pool lives as long as its longest-lived block.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace epx::comm {

class HandlePool : public std::enable_shared_from_this<HandlePool> {
 public:
  HandlePool(size_t block_bytes, int device) : bytes_(block_bytes), device_(device) {}
  ~HandlePool();
  HandlePool(const HandlePool&) = delete;
  HandlePool& operator=(const HandlePool&) = delete;

  /// A block (allocated on first need); releasing the last reference returns it to the pool.
  std::shared_ptr<void> acquire();
  /// Allocates blocks up front so that prepare() never calls cudaMalloc while peers wait.
  void reserve(size_t blocks);
  size_t block_bytes() const { return bytes_; }
  size_t blocks_allocated() const;

 private:
  void release(void* block);
  size_t bytes_;
  int device_;
  mutable std::mutex mu_;
  std::vector<void*> free_;
  std::vector<void*> all_;
};

}  // namespace epx::comm
