#include "core/launcher_env.h"

#include <cstdlib>

#include "core/env_choice.h"
#include "epx/error.h"

namespace epx::detail {
namespace {

struct Family {
  const char *rank, *world, *local;
};

// torchrun first: run inside an srun or mpirun allocation it sets its own, per-process variables.
constexpr Family kFamilies[] = {
    {"RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
};

const char* set_value(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

int whole_number(const char* fn, const char* name, const char* text) {
  int x = 0;
  require(parse_int(text, x), fn, name, " is \"", text, "\", expected a whole number");
  return x;
}

}  // namespace

LauncherEnv launcher_env(const char* fn) {
  const Family& torch = kFamilies[0];
  const bool has_rank = set_value(torch.rank) != nullptr, has_world = set_value(torch.world) != nullptr;
  require(has_rank == has_world, fn, has_rank ? torch.rank : torch.world, " is set but ",
          has_rank ? torch.world : torch.rank, " is not; set both (or neither)");
  LauncherEnv e;
  for (const Family& f : kFamilies) {
    const char* rank = set_value(f.rank);
    const char* world = set_value(f.world);
    if (rank == nullptr || world == nullptr) continue;
    e.launched = true;
    e.rank_name = f.rank;
    e.world_name = f.world;
    e.rank = whole_number(fn, f.rank, rank);
    e.world = whole_number(fn, f.world, world);
    if (const char* local = set_value(f.local)) {
      e.local_name = f.local;
      e.local_rank = whole_number(fn, f.local, local);
    }
    require(e.world >= 1 && e.rank >= 0 && e.rank < e.world, fn, f.rank, " is ", e.rank, " and ", f.world, " is ",
            e.world, ", expected 0 <= ", f.rank, " < ", f.world);
    require(e.local_rank >= 0, fn, f.local, " is ", e.local_rank, ", expected >= 0");
    return e;
  }
  return e;
}

}  // namespace epx::detail
