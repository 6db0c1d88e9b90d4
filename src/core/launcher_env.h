// Where a job launcher put this process: its rank, the job's size and its GPU on the node, as
// torchrun, Open MPI's mpirun, Slurm's srun and MPICH-style PMI launchers describe them. One reading
// for the library's Group::create_from_env and for the tools that decide whether to start ranks of
// their own and which process prints, so `mpirun -np 2 epx demo` and `srun -n 2 epx demo` behave as
// `torchrun --nproc-per-node 2` does.
#pragma once

#include <string>

namespace epx::detail {

struct LauncherEnv {
  bool launched = false;  // a launcher's rank and size variables are both set
  int rank = 0, world = 1, local_rank = 0;
  std::string rank_name, world_name, local_name;  // the variables read ("" where none was)
};

/// The first of these families whose rank and size are both set (not empty): RANK / WORLD_SIZE /
/// LOCAL_RANK, OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK, SLURM_PROCID / SLURM_NTASKS /
/// SLURM_LOCALID, PMI_RANK / PMI_SIZE / MPI_LOCALRANKID; the local rank from the same family (0 where
/// it is unset). None: launched is false. Errors (kInvalidArgument, for `fn`), each naming the
/// variables: a value that is not a whole number (read as 0 it would make a second rank 0); RANK
/// without WORLD_SIZE or the reverse (set by hand, half of them); a rank outside [0, size), a size
/// below 1 or a negative local rank. Slurm's SLURM_NTASKS alone (an salloc shell, no srun) is no
/// launch.
LauncherEnv launcher_env(const char* fn);

}  // namespace epx::detail
