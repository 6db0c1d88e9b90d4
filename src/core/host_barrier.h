// A reusable barrier for the threads of one process (C++17 has no std::barrier). Used where one
// process drives several GPUs: its threads must finish allocating device memory before any of them
// starts a collective (see Group::create_all_local).
#pragma once

#include <condition_variable>
#include <mutex>

namespace epx::detail {

class HostBarrier {
 public:
  explicit HostBarrier(int threads) : threads_(threads) {}
  void wait() {
    std::unique_lock<std::mutex> lk(mu_);
    const long gen = generation_;
    if (++arrived_ == threads_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lk, [&] { return generation_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int threads_;
  int arrived_ = 0;
  long generation_ = 0;
};

}  // namespace epx::detail
