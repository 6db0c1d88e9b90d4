// `epx info`: what this build is and what it can see (devices, CUDA and NCCL versions, flags).
#include <cstdio>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "core/version.h"
#include "tools/commands.h"

namespace epx::tools {

int print_help(FILE* out) {
  std::fprintf(out,
               "epx - Mixture-of-Experts layers with expert parallelism\n\n"
               "usage: epx <command> [options]\n\n"
               "commands:\n"
               "  demo   MoE forward+backward on every local GPU, or on the CPU reference with\n"
               "         simulated ranks when there is none; last line is a JSON summary\n"
               "         (epx demo --help for options)\n"
               "  bench  epx bench layer: the MoE layer's forward and forward+backward time on every\n"
               "         local GPU beside its tensor-core floor, JSON lines\n"
               "  info   build flags, devices, CUDA and NCCL versions\n"
               "  help   this text\n");
  return 0;
}

int run_info(const std::vector<std::string>&) {
  const BuildInfo b = build_info();
  std::printf("epx %s\n", b.version.c_str());
  std::printf("  build: %s, CUDA backend %s\n", b.build_type.c_str(), b.cuda_backend ? "on" : "off");
  if (b.cuda_backend) {
    std::printf("  CUDA runtime %s, driver %s, NCCL %s\n", b.cuda_runtime.c_str(), b.cuda_driver.c_str(),
                b.nccl.c_str());
    std::printf("  compiled for: %s; GPU grouped GEMMs (CUTLASS): %s\n", b.cuda_archs.c_str(),
                b.gpu_grouped_gemm ? "yes" : "no");
  }
  std::printf("  devices: %zu\n", b.devices.size());
  for (const auto& d : b.devices) std::printf("    %s\n", d.c_str());
  std::printf("{\"version\":\"%s\",\"cuda_backend\":%s,\"devices\":%zu}\n", b.version.c_str(),
              b.cuda_backend ? "true" : "false", b.devices.size());
  return 0;
}

}  // namespace epx::tools
