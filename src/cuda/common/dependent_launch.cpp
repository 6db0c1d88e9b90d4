// The host half of dependent_launch.cuh, in a C++ source: the .cuh is for CUDA sources only.
#include "core/env_choice.h"

namespace epx::cuda {

bool dependent_launch_enabled() {
  static const bool on = ::epx::detail::env_choice("EPX_PDL", {"0", "1"}) != 0;
  return on;
}

}  // namespace epx::cuda
