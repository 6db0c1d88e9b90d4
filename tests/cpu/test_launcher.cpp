// The launcher's variables (core/launcher_env.h): whether a launcher started this process, its rank
// (which process prints in `epx demo` and `epx bench`) and the job's size, from torchrun, mpirun, srun
// or a PMI launcher. A value that is not a whole number must be an error naming it: read as 0, every
// process would be rank 0.
#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/launcher_env.h"
#include "core/scoped_env.h"
#include "epx/error.h"
#include "tools/launch.h"

namespace epx {
namespace {

using detail::launcher_env;
using detail::ScopedEnv;

// Every launcher variable unset for the scope (a test run under srun or mpirun has some set), then
// the given ones set.
class LauncherVars {
 public:
  explicit LauncherVars(std::initializer_list<std::pair<const char*, const char*>> set = {})
      : LauncherVars(std::vector<std::pair<const char*, const char*>>(set)) {}
  explicit LauncherVars(const std::vector<std::pair<const char*, const char*>>& set) {
    for (const char* n : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "PMI_RANK",
                          "PMI_SIZE", "MPI_LOCALRANKID"})
      vars_.push_back(std::make_unique<ScopedEnv>(n, nullptr));
    for (const auto& [name, value] : set) vars_.push_back(std::make_unique<ScopedEnv>(name, value));
  }

 private:
  std::vector<std::unique_ptr<ScopedEnv>> vars_;
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument) << e.what();
    return e.what();
  }
  return "";
}

TEST(Launcher, RankIsReadAsAWholeNumber) {
  {
    const LauncherVars v;
    EXPECT_FALSE(tools::started_by_launcher());
    EXPECT_EQ(tools::launcher_rank(), 0);
    EXPECT_EQ(tools::launcher_world_size(), 1);
  }
  {
    const LauncherVars v({{"RANK", ""}, {"WORLD_SIZE", ""}});  // empty is unset
    EXPECT_FALSE(tools::started_by_launcher());
    EXPECT_EQ(tools::launcher_rank(), 0);
  }
  {
    const LauncherVars v({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}});
    EXPECT_TRUE(tools::started_by_launcher());
    EXPECT_EQ(tools::launcher_rank(), 3);
    EXPECT_EQ(tools::launcher_world_size(), 4);
    EXPECT_EQ(launcher_env("t").local_rank, 1);
  }
  {
    const LauncherVars v({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
    EXPECT_EQ(tools::launcher_rank(), 0);
    EXPECT_EQ(launcher_env("t").local_rank, 0);  // LOCAL_RANK unset
    EXPECT_EQ(launcher_env("t").local_name, "");
  }
}

TEST(Launcher, RankThatIsNotAWholeNumberIsAnErrorNamingIt) {
  for (const char* bad : {"abc", "1x", " 2 ", "99999999999", "1.5"}) {
    const LauncherVars v({{"RANK", bad}, {"WORLD_SIZE", "4"}});
    const std::string e = error_of([] { tools::launcher_rank(); });
    EXPECT_NE(e.find(std::string("RANK is \"") + bad + "\", expected a whole number"), std::string::npos) << e;
  }
  for (const char* bad : {"x", "4.0", ""}) {
    const LauncherVars v(
        {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", bad}});
    const std::string e = error_of([] { launcher_env("t"); });
    if (*bad == '\0') {
      EXPECT_EQ(e, "");  // empty is unset: local rank 0
    } else {
      EXPECT_NE(e.find(std::string("OMPI_COMM_WORLD_LOCAL_RANK is \"") + bad + "\""), std::string::npos) << e;
    }
  }
}

TEST(Launcher, RankOutsideTheJobIsAnErrorNamingBoth) {
  for (const auto& [rank, world] : {std::pair<const char*, const char*>{"4", "4"}, {"-1", "4"}, {"0", "0"}}) {
    const LauncherVars v({{"RANK", rank}, {"WORLD_SIZE", world}});
    const std::string e = error_of([] { tools::started_by_launcher(); });
    EXPECT_NE(e.find(std::string("RANK is ") + rank + " and WORLD_SIZE is " + world), std::string::npos) << e;
  }
  const LauncherVars v({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "-3"}});
  EXPECT_NE(error_of([] { launcher_env("t"); }).find("SLURM_LOCALID is -3, expected >= 0"), std::string::npos);
}

TEST(Launcher, HalfOfRankAndWorldSizeIsAnError) {
  {
    const LauncherVars v({{"RANK", "1"}});
    const std::string e = error_of([] { tools::launcher_rank(); });
    EXPECT_NE(e.find("RANK is set but WORLD_SIZE is not"), std::string::npos) << e;
  }
  {
    const LauncherVars v({{"WORLD_SIZE", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}});
    const std::string e = error_of([] { tools::started_by_launcher(); });
    EXPECT_NE(e.find("WORLD_SIZE is set but RANK is not"), std::string::npos) << e;
  }
}

// mpirun, srun and PMI launchers start processes as torchrun does: epx demo / epx bench must join
// their job instead of starting ranks of their own in every process.
TEST(Launcher, MpirunSrunAndPmiAreLaunchers) {
  struct Launch {
    const char *rank, *world, *local;  // the launcher's variables (local null: not set)
    int want_rank, want_world, want_local;
  };
  for (const Launch& l : {Launch{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", 1, 2,
                                 1},
                          Launch{"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", 5, 8, 1},
                          Launch{"PMI_RANK", "PMI_SIZE", nullptr, 2, 3, 0}}) {
    const std::string r = std::to_string(l.want_rank), w = std::to_string(l.want_world);
    const std::string lr = std::to_string(l.want_local);
    std::vector<std::pair<const char*, const char*>> set = {{l.rank, r.c_str()}, {l.world, w.c_str()}};
    if (l.local != nullptr) set.emplace_back(l.local, lr.c_str());
    const LauncherVars v(set);
    const detail::LauncherEnv e = launcher_env("t");
    EXPECT_TRUE(e.launched) << l.rank;
    EXPECT_EQ(e.rank, l.want_rank) << l.rank;
    EXPECT_EQ(e.world, l.want_world) << l.rank;
    EXPECT_EQ(e.local_rank, l.want_local) << l.rank;
    EXPECT_EQ(e.rank_name, l.rank);
    EXPECT_EQ(e.world_name, l.world);
    EXPECT_EQ(e.local_name, l.local ? l.local : "");
    EXPECT_EQ(tools::launcher_rank(), l.want_rank) << l.rank;
  }
  {  // an salloc shell: the allocation's size, but no srun step
    const LauncherVars v({{"SLURM_NTASKS", "4"}});
    EXPECT_FALSE(launcher_env("t").launched);
    EXPECT_FALSE(tools::started_by_launcher());
  }
  {  // torchrun inside an srun step: torchrun's per-process variables win
    const LauncherVars v({{"RANK", "3"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "3"}, {"SLURM_PROCID", "0"},
                          {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}});
    const detail::LauncherEnv e = launcher_env("t");
    EXPECT_EQ(e.rank, 3);
    EXPECT_EQ(e.world, 16);
    EXPECT_EQ(e.local_rank, 3);
    EXPECT_EQ(e.world_name, "WORLD_SIZE");
  }
}

}  // namespace
}  // namespace epx
