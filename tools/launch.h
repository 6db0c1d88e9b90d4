// One process per local GPU, the way a job launcher (torchrun, mpirun, srun) would start them, so
// `epx demo` and `epx bench` use every GPU of the machine with nothing but the epx binary.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace epx::tools {

/// True when this process was started by a launcher: torchrun (RANK and WORLD_SIZE), mpirun
/// (OMPI_COMM_WORLD_*), srun (SLURM_PROCID and SLURM_NTASKS) or a PMI launcher (core/launcher_env.h).
bool started_by_launcher();
/// Rank 0 prints; the others stay quiet (0 when no launcher started us).
int launcher_rank();
/// The ranks the launcher started (1 when none did).
int launcher_world_size();

/// Starts `ranks` copies of this executable with `args` (RANK, WORLD_SIZE, LOCAL_RANK and a fresh
/// EPX_NCCL_ID_FILE set), waits for all of them and returns the worst exit code. If one rank
/// fails, the others are given `grace_s` seconds (their device waits time out and name the missing
/// peer) before they are stopped.
int run_local_ranks(int ranks, const std::vector<std::string>& args, int grace_s = 60);

/// What a sub-command that uses every local GPU does: rank_main() here when a launcher started
/// this process or when ranks == 1, else `ranks` copies of `epx <command> <args...>` through
/// run_local_ranks. ranks must be 1..gpus (a clear error names the command otherwise).
int run_on_local_gpus(const char* command, int ranks, int gpus, const std::vector<std::string>& args,
                      const std::function<int()>& rank_main);

}  // namespace epx::tools
