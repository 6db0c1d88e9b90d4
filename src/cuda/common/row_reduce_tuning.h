// Host-side choice for the row helpers of row_reduce.cuh: how many y rows the spread kernels load
// before they store where top-k <= 8, 4 or 8. EPX_SPREAD_Y_ROWS=4|8 (read once) overrides the
// caller's default; every choice gives the same bits.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace epx::cuda {

inline int spread_y_rows_k8(int default_rows) {
  static const int env = [] {
    const char* v = std::getenv("EPX_SPREAD_Y_ROWS");
    if (v == nullptr || *v == '\0') return 0;
    if (std::strcmp(v, "4") == 0 || std::strcmp(v, "8") == 0) return std::atoi(v);
    std::fprintf(stderr, "[epx] EPX_SPREAD_Y_ROWS=%s ignored: expected 4 or 8\n", v);
    return 0;
  }();
  return env != 0 ? env : default_rows;
}

}  // namespace epx::cuda
