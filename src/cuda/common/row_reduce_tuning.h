// Host-side choice for the row helpers of row_reduce.cuh: how many y rows the spread kernels load
// before they store where top-k <= 8, 4 or 8. EPX_SPREAD_Y_ROWS=4|8 (read once) overrides the
// caller's default (any other value is an error that names the variable); every choice gives the
// same bits.
#pragma once

#include "core/env_choice.h"

namespace epx::cuda {

inline int spread_y_rows_k8(int default_rows) {
  static const int env = ::epx::detail::env_choice("EPX_SPREAD_Y_ROWS", {"4", "8"});
  return env < 0 ? default_rows : env == 0 ? 4 : 8;
}

}  // namespace epx::cuda
