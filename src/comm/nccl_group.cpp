// The EP group over NCCL: bootstrap (borrowed communicator, one process driving every local GPU,
// or one process per GPU from launcher variables), one symmetric window per rank registered with
// ncclCommWindowRegister and reached by LSA pointers, the device-side signals, and the backend
// methods that launch the zero-copy kernels (ep_kernels.cu). Counts never leave the device.
//
// Window per rank: the WindowLayout regions (header, meta, rows, reduce; rank-major, sized from
// max_tokens_per_rank x R rows, never an expert-major worst case) followed by R inbox words.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/ep_kernels.h"
#include "comm/group_status.h"
#include "comm/handle_pool.h"
#include "comm/nccl_window.h"
#include "core/device_memory.h"
#include "core/ep_state.h"
#include "cuda/common/cuda_check.h"
#include "cuda/layout/layout.h"
#include "epx/error.h"

namespace epx {
namespace comm {
namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress)
    throw Error(Status::kNcclError, detail::concat("epx: ", what, " failed: ", ncclGetErrorString(r), " (",
                                                   ncclGetLastError(nullptr) ? ncclGetLastError(nullptr) : "", ")"));
}

using cuda::DeviceGuard;

// What one rank holds; created in phases because window registration is collective.
struct RankResources {
  ncclComm_t comm = nullptr;
  bool owns_comm = false;
  int device = 0, rank = 0, size = 1;
  WindowLayout layout;
  size_t window_bytes = 0;
  void* window = nullptr;
  ncclWindow_t win = nullptr;
  bool zero_copy = false;
  Tensor peer_window, peer_inbox, control;  // device arrays [R] ptr, [R] ptr, epoch + status words

  void allocate(const GroupConfig& c) {
    DeviceGuard g(device);
    layout = WindowLayout::make(c, size);
    window_bytes = layout.total + signal_bytes(size);
    nccl_check(ncclMemAlloc(&window, window_bytes), "ncclMemAlloc of the EP window");
    EPX_CUDA_CHECK(cudaMemset(window, 0, window_bytes));
  }
  void register_window() {
    DeviceGuard g(device);
    nccl_check(ncclCommWindowRegister(comm, window, window_bytes, &win, NCCL_WIN_COLL_SYMMETRIC),
               "ncclCommWindowRegister");
  }
  void finish() {
    DeviceGuard g(device);
    zero_copy = lsa_team_size(comm) == size;
    peer_window = Tensor::zeros({size}, DType::kI64, Device::cuda(device));
    peer_inbox = Tensor::zeros({size}, DType::kI64, Device::cuda(device));
    control = Tensor::zeros({1 + kStatusWords}, DType::kI32, Device::cuda(device));
    const int32_t init[1 + kStatusWords] = {0, 0, kNoBadPair, 0, 0, 0, 0, 0, 0, 0};
    EPX_CUDA_CHECK(cudaMemcpy(control.data(), init, sizeof init, cudaMemcpyHostToDevice));
    if (zero_copy) {
      resolve_peer_windows(win, size, layout.total, static_cast<char**>(peer_window.data()),
                           static_cast<unsigned**>(peer_inbox.data()), nullptr);
      EPX_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
};

// Collective teardown of the ranks one process holds (all of them at once when one process drives
// several GPUs, so the collective deregistration cannot deadlock).
void teardown(std::vector<RankResources>& ranks) {
  int caller_device = 0;
  cudaGetDevice(&caller_device);  // restored at the end: the caller's current device is not ours to change
  ncclGroupStart();
  for (auto& r : ranks)
    if (r.win) {
      cudaSetDevice(r.device);
      ncclCommWindowDeregister(r.comm, r.win);
    }
  ncclGroupEnd();
  for (auto& r : ranks) {
    cudaSetDevice(r.device);
    r.peer_window = Tensor();
    r.peer_inbox = Tensor();
    r.control = Tensor();
    if (r.window) ncclMemFree(r.window);
    if (r.owns_comm && r.comm) ncclCommDestroy(r.comm);
  }
  cudaSetDevice(caller_device);
}

struct World {
  std::vector<RankResources> ranks;
  ~World() {
    try {
      teardown(ranks);
    } catch (...) {
    }
  }
};

class NcclGroup final : public GroupState {
 public:
  NcclGroup(std::shared_ptr<World> world, int index, const GroupConfig& c) : world_(std::move(world)), index_(index) {
    RankResources& r = res();
    config = c;
    rank = r.rank;
    size = r.size;
    local_experts = c.num_experts / size;
    device = Device::cuda(r.device);
    transport = Transport::kZeroCopy;
    recv_capacity_rows = c.recv_capacity_rows > 0 ? c.recv_capacity_rows : worst_case_recv_rows(c, size);
    registered_bytes = r.window_bytes;
    id = next_group_id();
    require_status(r.zero_copy, Status::kNotSupported, "epx::Group",
                   "rank ", rank, " cannot reach every peer's memory by load/store (NCCL's LSA team has fewer than ",
                   size, " ranks): the staged transport for such groups is not available in this build");
    pool_ = std::make_shared<HandlePool>(cuda::handle_block_bytes(c, size), r.device);
    pool_->reserve(4);  // a few layers x microbatches in flight without allocating in prepare()
    dg_.rank = rank;
    dg_.R = size;
    dg_.Le = local_experts;
    dg_.E = c.num_experts;
    dg_.max_tokens = c.max_tokens_per_rank;
    dg_.max_topk = c.max_topk;
    dg_.align = c.align;
    dg_.recv_capacity = recv_capacity_rows;
    dg_.layout = r.layout;
    dg_.peer_window = static_cast<char* const*>(r.peer_window.data());
    dg_.my_window = static_cast<char*>(r.window);
    dg_.peer_inbox = static_cast<uint32_t* const*>(r.peer_inbox.data());
    dg_.my_inbox = reinterpret_cast<uint32_t*>(static_cast<char*>(r.window) + r.layout.total);
    dg_.epoch = static_cast<uint32_t*>(r.control.data());
    dg_.status = r.control.ptr<int32_t>() + 1;
    dg_.timeout_ns = static_cast<uint64_t>(resolved_timeout_s(c) * 1e9);
    dg_.send_blocks = c.num_sms > 0 ? c.num_sms : 32;
  }

  void prepare(HandleState& h, const TensorRef& topk_idx, const TensorRef& topk_weights, const PrepareOptions& options,
               Stream stream) override {
    DeviceGuard g(device.index);
    h.storage = pool_->acquire();
    cuda::bind_handle(h, h.storage.get(), config, size, rank, device);
    cuda::prepare_send_side(h, topk_idx, topk_weights, options, /*local=*/false, config.align, recv_capacity_rows,
                            dg_.status, stream);
    exchange_counts(dg_, h, cuda::handle_segment_starts(h), stream);
  }

  void dispatch_forward(HandleState& h, const TensorRef& x, const TensorRef& x_scales, const TensorRef& topk_weights,
                        const TensorRef& recv_x, const TensorRef& recv_scales, const TensorRef& recv_weights,
                        Stream stream) override {
    DeviceGuard g(device.index);
    dispatch_rows(dg_, h, cuda::handle_segment_starts(h), x, x_scales, topk_weights, recv_x, recv_scales, recv_weights,
                  stream);
  }

  void combine_forward(HandleState& h, const TensorRef& y, const TensorRef& row_weights, const TensorRef& out,
                       Stream stream) override {
    DeviceGuard g(device.index);
    reduce_rows(dg_, h, kOpCombine, y, row_weights, TensorRef(), out, TensorRef(), stream);
  }

  void combine_backward(HandleState& h, const TensorRef& d_out, const TensorRef& y, const TensorRef& row_weights,
                        const TensorRef& d_y, const TensorRef& d_row_weights, Stream stream) override {
    DeviceGuard g(device.index);
    spread_rows(dg_, h, d_out, y, row_weights, d_y, d_row_weights, stream);
  }

  void dispatch_backward(HandleState& h, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                         const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream) override {
    DeviceGuard g(device.index);
    reduce_rows(dg_, h, kOpDispatchBwd, d_recv_x, TensorRef(), d_recv_weights, d_x, d_topk_weights, stream);
  }

  void all_reduce_sum(const TensorRef& buffer, Stream stream) override {
    DeviceGuard g(device.index);
    all_reduce(dg_, buffer, stream);
  }

  void check() override {
    DeviceGuard g(device.index);
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    int32_t s[kStatusWords];
    EPX_CUDA_CHECK(cudaMemcpy(s, dg_.status, sizeof s, cudaMemcpyDeviceToHost));
    // Reset everything but the broken flag: a group that timed out stays unusable.
    int32_t reset[kStatusWords] = {0, kNoBadPair, 0, 0, 0, s[5], s[6], s[7], s[8]};
    EPX_CUDA_CHECK(cudaMemcpy(dg_.status, reset, sizeof reset, cudaMemcpyHostToDevice));
    if (s[7] != 0) {
      std::string missing;
      for (int p = 0; p < size; ++p)
        if ((p < 32 ? s[5] : s[6]) >> (p & 31) & 1) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
      static const char* ops[] = {"?", "prepare", "dispatch_forward", "combine_forward", "combine_backward",
                                  "dispatch_backward", "all_reduce_sum"};
      const char* op = s[7] >= 1 && s[7] <= 6 ? ops[s[7]] : "?";
      throw Error(Status::kTimeout,
                  detail::concat("epx::", op, ": rank ", rank, " waited ", resolved_timeout_s(config),
                                 " s at barrier ", static_cast<uint32_t>(s[8]), "; rank(s) ", missing,
                                 " never arrived (do all ranks make the same collective calls in the same order?). "
                                 "The group is unusable; destroy it on every rank."));
    }
    raise_layout_status(s, rank, config.num_experts, recv_capacity_rows);
  }

 private:
  RankResources& res() const { return world_->ranks[index_]; }

  std::shared_ptr<World> world_;
  int index_;
  DeviceGroup dg_;
  std::shared_ptr<HandlePool> pool_;
};

// The state of a group for the one rank this process drives on a communicator (collective: every
// rank of the communicator builds its own at the same time).
std::unique_ptr<GroupState> single_rank_state(ncclComm_t c, bool owns_comm, int device, int rank, int size,
                                              const GroupConfig& config) {
  auto world = std::make_shared<World>();
  world->ranks.resize(1);
  RankResources& rr = world->ranks[0];
  rr.comm = c;
  rr.owns_comm = owns_comm;
  rr.device = device;
  rr.rank = rank;
  rr.size = size;
  rr.allocate(config);
  rr.register_window();
  rr.finish();
  return std::make_unique<NcclGroup>(world, 0, config);
}


// Reads an environment variable as an int, trying each name in order.
int env_int(std::initializer_list<const char*> names, int fallback) {
  for (const char* n : names)
    if (const char* v = std::getenv(n)) return std::atoi(v);
  return fallback;
}

std::string hex(const ncclUniqueId& id) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < sizeof id.internal; ++i) {
    const unsigned char c = static_cast<unsigned char>(id.internal[i]);
    s += digits[c >> 4];
    s += digits[c & 15];
  }
  return s;
}

ncclUniqueId from_hex(const std::string& s, const char* where) {
  ncclUniqueId id{};
  require(s.size() == 2 * sizeof id.internal, "epx::Group::create_from_env", where, " holds ", s.size(),
          " characters, expected ", 2 * sizeof id.internal, " hex digits (an ncclUniqueId)");
  for (size_t i = 0; i < sizeof id.internal; ++i)
    id.internal[i] = static_cast<char>(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  return id;
}

}  // namespace
}  // namespace comm

std::vector<Group> Group::create_all_local(const GroupConfig& config, std::vector<int> devices) {
  const char* fn = "epx::Group::create_all_local";
  const int n = detail::cuda_device_count();
  if (devices.empty())
    for (int d = 0; d < n; ++d) devices.push_back(d);
  require(!devices.empty(), fn, "no CUDA device is visible");
  for (int d : devices) require(d >= 0 && d < n, fn, "device ", d, " is not visible (", n, " CUDA devices)");
  const int R = static_cast<int>(devices.size());
  config.validate(fn, R);
  cuda::DeviceGuard keep_current(devices[0]);  // ncclCommInitAll and the setup switch devices; restore the caller's
  auto world = std::make_shared<comm::World>();
  world->ranks.resize(R);
  std::vector<ncclComm_t> comms(R);
  comm::nccl_check(ncclCommInitAll(comms.data(), R, devices.data()), "ncclCommInitAll");
  for (int r = 0; r < R; ++r) {
    auto& rr = world->ranks[r];
    rr.comm = comms[r];
    rr.owns_comm = true;
    rr.device = devices[r];
    rr.rank = r;
    rr.size = R;
    rr.allocate(config);
  }
  comm::nccl_check(ncclGroupStart(), "ncclGroupStart");
  for (auto& rr : world->ranks) rr.register_window();
  comm::nccl_check(ncclGroupEnd(), "ncclGroupEnd (window registration)");
  for (auto& rr : world->ranks) rr.finish();
  std::vector<Group> groups;
  for (int r = 0; r < R; ++r) groups.push_back(Group(std::make_unique<comm::NcclGroup>(world, r, config)));
  return groups;
}

Group Group::from_nccl(void* nccl_comm, const GroupConfig& config) {
  const char* fn = "epx::Group::from_nccl";
  require(nccl_comm != nullptr, fn, "nccl_comm is null");
  ncclComm_t c = static_cast<ncclComm_t>(nccl_comm);
  int R = 0, rank = 0, dev = 0;
  comm::nccl_check(ncclCommCount(c, &R), "ncclCommCount");
  comm::nccl_check(ncclCommUserRank(c, &rank), "ncclCommUserRank");
  comm::nccl_check(ncclCommCuDevice(c, &dev), "ncclCommCuDevice");
  config.validate(fn, R);
  return Group(comm::single_rank_state(c, /*owns_comm=*/false, dev, rank, R, config));
}

Group Group::create_from_env(const GroupConfig& config) {
  const char* fn = "epx::Group::create_from_env";
  const int rank = comm::env_int({"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"}, -1);
  const int world = comm::env_int({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE"}, -1);
  const int local = comm::env_int({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"}, 0);
  require(rank >= 0 && world >= 1 && rank < world, fn, "RANK is ", rank, " and WORLD_SIZE is ", world,
          ", expected 0 <= RANK < WORLD_SIZE (set them, or OMPI_COMM_WORLD_* / SLURM_* equivalents)");
  config.validate(fn, world);
  const int n = detail::cuda_device_count();
  require(local >= 0 && local < n, fn, "LOCAL_RANK is ", local, " but ", n, " CUDA device(s) are visible");
  EPX_CUDA_CHECK(cudaSetDevice(local));
  ncclUniqueId id{};
  const char* env_id = std::getenv("EPX_NCCL_ID");
  const char* file_env = std::getenv("EPX_NCCL_ID_FILE");
  // Every rank creates its groups in the same order, so the n-th group of a process meets its peers
  // in the n-th id file: a later group never reads the id of an earlier one.
  static std::atomic<int> groups_created{0};
  const int nth = groups_created++;
  const std::string file_name = file_env ? std::string(file_env) + (nth ? "." + std::to_string(nth) : "") : "";
  const char* file = file_env ? file_name.c_str() : nullptr;
  if (env_id) {
    id = comm::from_hex(env_id, "EPX_NCCL_ID");
  } else {
    require(file != nullptr, fn, "neither EPX_NCCL_ID (hex) nor EPX_NCCL_ID_FILE (a path every rank can read) is set");
    if (rank == 0) {
      comm::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      const std::string tmp = std::string(file) + ".tmp";
      std::ofstream(tmp) << comm::hex(id);
      require(std::rename(tmp.c_str(), file) == 0, fn, "cannot write the NCCL id to ", file);
    } else {
      const double timeout = config.timeout_s > 0 ? config.timeout_s : 60.0;
      const auto start = std::chrono::steady_clock::now();
      std::string text;
      while (true) {
        std::ifstream in(file);
        if (in && std::getline(in, text) && text.size() == 2 * sizeof id.internal) break;
        require_status(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < timeout,
                       Status::kTimeout, fn, "rank ", rank, " waited ", timeout, " s for rank 0 to write the NCCL id to ",
                       file);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      id = comm::from_hex(text, file);
    }
  }
  ncclComm_t c = nullptr;
  comm::nccl_check(ncclCommInitRank(&c, world, id, rank), "ncclCommInitRank");
  return Group(comm::single_rank_state(c, /*owns_comm=*/true, local, rank, world, config));
}

}  // namespace epx
