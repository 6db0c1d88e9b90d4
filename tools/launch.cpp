#include "tools/launch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/launcher_env.h"
#include "epx/error.h"

namespace epx::tools {

bool started_by_launcher() { return detail::launcher_env("epx launcher").launched; }

int launcher_rank() {
  const detail::LauncherEnv e = detail::launcher_env("epx launcher");
  return e.launched ? e.rank : 0;
}

int launcher_world_size() {
  const detail::LauncherEnv e = detail::launcher_env("epx launcher");
  return e.launched ? e.world : 1;
}

int run_local_ranks(int ranks, const std::vector<std::string>& args, int grace_s) {
  const char* fn = "epx launcher";
  require(ranks >= 1, fn, "ranks is ", ranks, ", expected >= 1");
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  require_status(n > 0, Status::kInternal, fn, "cannot find this executable through /proc/self/exe");
  exe[n] = '\0';
  const std::string id_file = "/tmp/epx_nccl_id." + std::to_string(getpid());
  std::remove(id_file.c_str());
  std::fflush(stdout);
  std::fflush(stderr);

  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = fork();
    require_status(pid >= 0, Status::kInternal, fn, "fork failed for rank ", r);
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(ranks).c_str(), 1);
      setenv("EPX_NCCL_ID_FILE", id_file.c_str(), 1);
      setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off unless the user asks
      std::vector<char*> argv{exe};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(exe, argv.data());
      std::perror("epx launcher: execv");
      _exit(127);
    }
    pids.push_back(pid);
  }

  int worst = 0, alive = ranks;
  bool failed = false;
  auto deadline = std::chrono::steady_clock::time_point::max();
  std::vector<bool> done(ranks, false);
  while (alive > 0) {
    for (int r = 0; r < ranks; ++r) {
      if (done[r]) continue;
      int status = 0;
      const pid_t got = waitpid(pids[r], &status, WNOHANG);
      if (got != pids[r]) continue;
      done[r] = true;
      --alive;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0) {
        std::fprintf(stderr, "epx launcher: rank %d exited with %d\n", r, code);
        if (!failed) deadline = std::chrono::steady_clock::now() + std::chrono::seconds(grace_s);
        failed = true;
      }
      if (code > worst) worst = code;
    }
    if (alive > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < ranks; ++r)
        if (!done[r]) {
          std::fprintf(stderr, "epx launcher: stopping rank %d (a peer failed %d s ago)\n", r, grace_s);
          kill(pids[r], SIGTERM);
        }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::remove(id_file.c_str());
  for (int n = 1; n < 256; ++n) std::remove((id_file + "." + std::to_string(n)).c_str());  // later groups' ids
  return worst;
}

int run_on_local_gpus(const char* command, int ranks, int gpus, const std::vector<std::string>& args,
                      const std::function<int()>& rank_main) {
  if (started_by_launcher()) return rank_main();
  require(ranks >= 1 && ranks <= gpus, "epx ", command, ": --ranks is ", ranks, ", expected 1..", gpus,
          " (the visible GPUs)");
  if (ranks == 1) return rank_main();
  std::vector<std::string> child{command};
  child.insert(child.end(), args.begin(), args.end());
  return run_local_ranks(ranks, child);
}

}  // namespace epx::tools
