#include "comm/handle_pool.h"

#include "core/device_memory.h"

namespace epx::comm {

HandlePool::~HandlePool() {
  for (void* p : all_) detail::device_free(p, device_);
}

std::shared_ptr<void> HandlePool::acquire() {
  void* block = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!free_.empty()) {
      block = free_.back();
      free_.pop_back();
    }
  }
  if (!block) {
    block = detail::device_alloc(bytes_, device_);
    std::lock_guard<std::mutex> lk(mu_);
    all_.push_back(block);
  }
  std::shared_ptr<HandlePool> self = shared_from_this();
  return std::shared_ptr<void>(block, [self](void* p) { self->release(p); });
}

void HandlePool::reserve(size_t blocks) {
  std::lock_guard<std::mutex> lk(mu_);
  while (all_.size() < blocks) {
    void* b = detail::device_alloc(bytes_, device_);
    all_.push_back(b);
    free_.push_back(b);
  }
}

void HandlePool::release(void* block) {
  std::lock_guard<std::mutex> lk(mu_);
  free_.push_back(block);
}

size_t HandlePool::blocks_allocated() const {
  std::lock_guard<std::mutex> lk(mu_);
  return all_.size();
}

}  // namespace epx::comm
