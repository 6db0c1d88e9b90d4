// Sub-commands of the epx CLI, one file each.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace epx::tools {

int print_help(FILE* out);
int run_info(const std::vector<std::string>& args);
int run_demo(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args);

struct DemoOptions {
  std::string preset;  // empty: the backend's default
  long long tokens = 0;  // per rank; 0: the preset's
  int steps = 0;
  uint64_t seed = 1;
  double lr = 0;
};
/// The GPU demo of one rank (this process's GPU); see demo_gpu.cpp.
int run_demo_gpu(const DemoOptions& options);

}  // namespace epx::tools
