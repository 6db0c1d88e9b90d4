// The message of the epx::Error a call raises, for tests that assert on the exact text.
#pragma once

#include <functional>
#include <string>

#include "epx/error.h"

namespace epx::testing {

// "(no error)" when f returns normally; any other exception propagates.
inline std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return std::string(e.what());
  }
  return "(no error)";
}

}  // namespace epx::testing
