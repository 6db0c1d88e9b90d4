// `epx info`: what this build is and what it can see (devices, CUDA and NCCL versions, flags), and
// the bytes an EP group of a preset's shape registers per rank on either transport.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "core/env_names.h"
#include "core/launcher_env.h"
#include "core/version.h"
#include "epx/comm.h"
#include "epx/presets.h"
#include "tools/args.h"
#include "tools/commands.h"
#include "tools/layer_run.h"

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
               "  info   build flags, devices, CUDA and NCCL versions, and the EP buffers a group\n"
               "         registers per rank (--preset deepseek-v3|mixtral|..., --ranks R, --tokens T,\n"
               "         --dtype bf16|fp8; default: deepseek-v3 on 2 ranks)\n"
               "  help   this text\n");
  return 0;
}

namespace {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

// Where a launcher put this process, as Group::create_from_env and `epx demo` / `epx bench` read it
// (a job that hangs at group creation often has two processes claiming one rank); printed, and
// returned as a JSON object.
std::string print_launcher() {
  try {
    const detail::LauncherEnv e = detail::launcher_env("epx info");
    if (!e.launched) {
      std::printf("  launcher: none (no RANK / WORLD_SIZE, nor mpirun's, srun's or PMI's): epx demo and epx bench "
                  "start one process per local GPU themselves\n");
      return "{\"launched\":false}";
    }
    const std::string local = e.local_name.empty() ? "unset, 0" : e.local_name;
    std::printf("  launcher: rank %d of %d (%s / %s), local rank %d (%s)\n", e.rank, e.world, e.rank_name.c_str(),
                e.world_name.c_str(), e.local_rank, local.c_str());
    return "{\"launched\":true,\"rank\":" + std::to_string(e.rank) + ",\"world\":" + std::to_string(e.world) +
           ",\"local_rank\":" + std::to_string(e.local_rank) + ",\"from\":" + json_string(e.rank_name) + "}";
  } catch (const Error& e) {
    std::printf("  launcher: %s\n", e.what());
    return "{\"launched\":false,\"error\":" + json_string(e.what()) + "}";
  }
}

}  // namespace

int run_info(const std::vector<std::string>& args) {
  const Args a("epx info", args, {"preset", "ranks", "tokens", "dtype"});
  const ShapePreset& p = find_preset(a.str("preset", "deepseek-v3"));
  const long long ranks = a.integer("ranks", 2), tokens = a.integer("tokens", p.tokens);
  require(ranks >= 1 && ranks <= 1024, "epx info", "--ranks is ", ranks, ", expected 1..1024");
  require(tokens >= 1 && tokens <= (1 << 30), "epx info", "--tokens is ", tokens, ", expected 1..2^30");
  const std::string dt = a.str("dtype", "bf16");
  require(dt == "bf16" || dt == "fp8", "epx info", "--dtype is ", dt, ", expected bf16 or fp8 (the rows' dtype)");
  const DType rows = dt == "fp8" ? DType::kF8E4M3 : DType::kBF16;
  // The layer's group for this shape (what `epx bench layer` and `epx demo` create).
  GroupConfig gc = layer_group_config(moe_config(p, DType::kBF16), tokens);
  gc.max_dtype = rows;
  const int R = static_cast<int>(ranks);
  const size_t zero_copy = registered_bytes_per_rank(gc, R, Transport::kZeroCopy);
  const size_t staged = registered_bytes_per_rank(gc, R, Transport::kStaged);

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
  std::printf("  EP buffers one rank registers, %s shape (%lld tokens a rank, hidden %lld, %d experts, top-%d, %s rows)"
              " on %d ranks: zero-copy window %zu bytes (%.3f GB), staged send + receive buffers %zu bytes (%.3f GB)\n",
              p.name.c_str(), tokens, static_cast<long long>(p.hidden), p.experts, p.topk, dt.c_str(), R, zero_copy,
              zero_copy * 1e-9, staged, staged * 1e-9);
  // The EPX_* variables set here: those epx reads with their values, the others flagged (a name
  // epx does not read changes nothing, most likely a misspelling).
  std::string set_json, unknown_json;
  for (const std::string& name : detail::known_env_names()) {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) continue;
    std::printf("  %s=%s\n", name.c_str(), v);
    set_json += (set_json.empty() ? "\"" : ",\"") + name + "\"";
  }
  for (const std::string& name : detail::unknown_env_names()) {
    std::printf("  %s is set, but epx reads no variable of that name (a misspelling?)\n", name.c_str());
    unknown_json += (unknown_json.empty() ? "\"" : ",\"") + name + "\"";
  }
  const std::string launcher_json = print_launcher();
  std::printf("{\"version\":\"%s\",\"cuda_backend\":%s,\"devices\":%zu,\"ep_preset\":\"%s\",\"ep_ranks\":%d,"
              "\"ep_tokens\":%lld,\"ep_rows\":\"%s\",\"registered_bytes_zero_copy\":%zu,\"registered_bytes_staged\":%zu,"
              "\"env_set\":[%s],\"env_unknown\":[%s],"
              "\"launcher\":%s}\n",
              b.version.c_str(), b.cuda_backend ? "true" : "false", b.devices.size(), p.name.c_str(), R, tokens,
              dt.c_str(), zero_copy, staged, set_json.c_str(), unknown_json.c_str(), launcher_json.c_str());
  return 0;
}

}  // namespace epx::tools
