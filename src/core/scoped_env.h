// An environment variable set (or unset) for one scope, the caller's value restored after it: for the
// tests and benchmarks that switch the EPX_* settings the library reads at each call.
#pragma once

#include <cstdlib>
#include <string>

namespace epx::detail {

class ScopedEnv {
 public:
  /// value null: the variable is unset for the scope.
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* before = std::getenv(name);
    had_ = before != nullptr;
    if (had_) saved_ = before;
    if (value != nullptr) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, saved_.c_str(), 1);
    else unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string saved_;
  bool had_ = false;
};

}  // namespace epx::detail
