#include "core/env_names.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>

extern char** environ;  // POSIX: the process's environment

namespace epx::detail {

const std::vector<std::string>& known_env_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v = {
        // diagnostics
        "EPX_DEBUG", "EPX_PROFILE",
        // groups: transports, timeouts, bootstrap
        "EPX_TRANSPORT", "EPX_STAGED_SIZES", "EPX_TIMEOUT_S", "EPX_NCCL_ID", "EPX_NCCL_ID_FILE",
        // kernel choices (same bits)
        "EPX_ROUTER_KERNEL", "EPX_ROUTER_TRIGGER", "EPX_LAYOUT_KERNEL", "EPX_PERMUTE_KERNEL",
        "EPX_QUANT_PERMUTE_SCHEDULE", "EPX_DISPATCH_KERNEL", "EPX_COMBINE_KERNEL", "EPX_EP_BARRIER", "EPX_EP_SIGNAL",
        "EPX_PDL",
        "EPX_COMBINE_ITEMS", "EPX_SPREAD_Y_ROWS", "EPX_GEMM_FORWARD_KERNEL", "EPX_FP8_GEMM_KERNEL",
        "EPX_WGRAD_KERNEL", "EPX_WGRAD_K_TAIL", "EPX_GEMM_RASTER", "EPX_GEMM_SWIZZLE",
        "EPX_CONTIGUOUS_EPILOGUE",
        // how the zero-copy kernels split their work
        "EPX_DISPATCH_SEND_BLOCKS", "EPX_DISPATCH_SEND_SHARE", "EPX_DISPATCH_EXPAND_PER_SM",
        "EPX_DISPATCH_EXPAND_PIECES", "EPX_COMBINE_MIN_PIECES", "EPX_PREPARE_HEADERS",
        "EPX_COMBINE_REDUCE_PER_SM", "EPX_COMBINE_DECODE_REDUCE_PER_SM",
        "EPX_COMBINE_SUM_BLOCKS", "EPX_COMBINE_BUDGET_SUM_PER_MILLE", "EPX_COMBINE_PIECES",
        "EPX_COMBINE_TAIL_CHUNKS", "EPX_COMBINE_TAIL_PIECES", "EPX_COMBINE_SUM_MIN_PIECES",
        "EPX_COMBINE_LOADS",
    };
    std::sort(v.begin(), v.end());
    return v;
  }();
  return names;
}

std::vector<std::string> unknown_env_names() {
  const std::vector<std::string>& known = known_env_names();
  std::vector<std::string> unknown;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (std::strncmp(*e, "EPX_", 4) != 0) continue;
    const char* eq = std::strchr(*e, '=');
    const std::string name = eq ? std::string(*e, static_cast<size_t>(eq - *e)) : std::string(*e);
    if (!std::binary_search(known.begin(), known.end(), name)) unknown.push_back(name);
  }
  std::sort(unknown.begin(), unknown.end());
  return unknown;
}

void warn_unknown_env_names_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (const std::string& name : unknown_env_names())
      std::fprintf(stderr,
                   "epx: warning: %s is set, but epx reads no variable of that name (a misspelling? "
                   "README.md lists the variables epx reads; `epx info` shows those set)\n",
                   name.c_str());
  });
}

}  // namespace epx::detail
