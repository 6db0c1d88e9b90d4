// The shared world of R simulated ranks: one host window per rank (the WindowLayout every backend
// uses) and a barrier whose waits expire with the names of the ranks that never arrived, the way
// the device barriers report a missing peer instead of hanging.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "core/window_layout.h"
#include "epx/error.h"
#include "epx/tensor.h"

namespace epx::ref {

class SimBarrier {
 public:
  explicit SimBarrier(int num_ranks) : arrived_at_(num_ranks, 0) {}

  /// Blocks until every rank arrived or `timeout_s` passed. After a timeout the barrier stays
  /// broken (like an aborted communicator): later waits fail at once.
  void arrive_and_wait(int rank, const char* fn, double timeout_s) {
    std::unique_lock<std::mutex> lk(mu_);
    if (broken_) throw Error(Status::kTimeout, detail::concat(fn, ": the group is unusable after an earlier timeout"));
    const uint64_t gen = generation_;
    arrived_at_[rank] = gen + 1;
    if (++arrived_ == static_cast<int>(arrived_at_.size())) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    cv_.wait_until(lk, deadline, [&] { return generation_ != gen || broken_; });
    if (generation_ != gen) return;
    // Timed out here, or woken by a peer that timed out on the same barrier: either way name the
    // ranks that never arrived, so every waiting rank reports the culprit.
    broken_ = true;
    cv_.notify_all();
    std::string missing;
    for (size_t r = 0; r < arrived_at_.size(); ++r)
      if (arrived_at_[r] != gen + 1) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    throw Error(Status::kTimeout, detail::concat(fn, ": rank ", rank, " waited ", timeout_s, " s for its peers; rank(s) ",
                                                 missing, " never arrived (do all ranks make the same collective "
                                                 "calls in the same order?)"));
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> arrived_at_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool broken_ = false;
};

struct SimWorld {
  SimWorld(int num_ranks, const WindowLayout& layout) : layout(layout), barrier(num_ranks) {
    // The zero-copy window's bytes: the layout, the signal area (unused here) and the second header copy.
    const auto bytes = static_cast<int64_t>(layout.window_bytes());
    for (int r = 0; r < num_ranks; ++r) windows.push_back(Tensor::zeros({bytes}, DType::kU8));
  }
  char* window(int rank) const { return static_cast<char*>(windows[rank].data()); }

  WindowLayout layout;
  std::vector<Tensor> windows;
  SimBarrier barrier;
};

}  // namespace epx::ref
