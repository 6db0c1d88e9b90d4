// The epx command-line tool: `epx demo`, `epx bench`, `epx info`, `epx help`.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "epx/error.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  const std::string cmd = args.empty() ? "help" : args[0];
  if (!args.empty()) args.erase(args.begin());
  try {
    if (cmd == "demo") return epx::tools::run_demo(args);
    if (cmd == "info") return epx::tools::run_info(args);
    if (cmd == "bench") return epx::tools::run_bench(args);
    if (cmd == "help" || cmd == "--help" || cmd == "-h") return epx::tools::print_help(stdout);
    std::fprintf(stderr, "epx: unknown command '%s'\n\n", cmd.c_str());
    epx::tools::print_help(stderr);
    return 2;
  } catch (const epx::Error& e) {
    std::fprintf(stderr, "epx %s: error (%s): %s\n", cmd.c_str(), epx::status_name(e.status()), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
