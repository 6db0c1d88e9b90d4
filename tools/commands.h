// Sub-commands of the epx CLI, one file each.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace epx::tools {

int print_help(FILE* out);
int run_info(const std::vector<std::string>& args);
int run_demo(const std::vector<std::string>& args);

}  // namespace epx::tools
