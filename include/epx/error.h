// Errors. Every public entry point validates its arguments once, before any work is queued, and
// throws epx::Error whose message names the function, the argument, what was expected and what was
// given: "epx::dispatch_forward: topk_idx has 4095 rows, x has 4096".
// Device-side conditions (a recv buffer that would overflow, a peer that never arrived) are
// recorded on the device and raised at the next host-visible point with the same kind of message.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace epx {

enum class Status : int {
  kOk = 0,
  kInvalidArgument = 1,  // caller's mistake: shapes, dtypes, ids, options
  kCapacityExceeded = 2, // a batch does not fit the buffers the group was sized for
  kNotSupported = 3,     // valid request this build or device cannot serve
  kTimeout = 4,          // a collective wait expired (names the missing ranks)
  kCudaError = 5,
  kNcclError = 6,
  kInternal = 7,
};

const char* status_name(Status s);

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

/// Throws Error(kInvalidArgument, "<fn>: <message parts...>") unless `cond` holds.
template <class... Args>
inline void require(bool cond, const char* fn, Args&&... parts) {
  if (!cond) throw Error(Status::kInvalidArgument, detail::concat(fn, ": ", std::forward<Args>(parts)...));
}

/// Same, with an explicit status.
template <class... Args>
inline void require_status(bool cond, Status status, const char* fn, Args&&... parts) {
  if (!cond) throw Error(status, detail::concat(fn, ": ", std::forward<Args>(parts)...));
}

}  // namespace epx
