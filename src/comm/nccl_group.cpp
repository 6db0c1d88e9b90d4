// The EP group over NCCL: bootstrap (borrowed communicator, one process driving every local GPU,
// or one process per GPU from launcher variables), the two transports, and the backend methods
// that launch the EP kernels (ep_kernels.cu). Counts never leave the device.
//
// zero-copy  one symmetric window per rank registered with ncclCommWindowRegister and reached by
//            LSA pointers: the WindowLayout regions (header, meta, rows, reduce; rank-major, sized
//            from max_tokens_per_rank x R rows, never an expert-major worst case) followed by R
//            inbox words for the device barriers. Needs every rank in one LSA team.
// staged     two plain buffers per rank with the WindowLayout (a send buffer whose region [p] is
//            the mailbox for peer p, and a receive buffer whose region [s] holds what s sent),
//            moved by ncclSend/ncclRecv inside ncclGroupStart/End: works wherever NCCL does (other
//            nodes, PCIe, network). NCCL needs the same byte count on both sides of a send and the
//            counts stay on the device, so every delivery moves the fixed worst case of a region:
//            max_tokens_per_rank slots per peer, each only as wide as the op's rows (packed stride).
//
// The transport is chosen once, collectively, at creation: GroupConfig::transport, else
// EPX_TRANSPORT, else zero-copy when the LSA team spans the group and staged otherwise; the ranks
// check that they agree before anything else is set up.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
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
#include <utility>
#include <vector>

#include "comm/ep_kernels.h"
#include "comm/group_status.h"
#include "comm/group_votes.h"
#include "comm/handle_pool.h"
#include "comm/nccl_window.h"
#include "core/device_memory.h"
#include "core/env_choice.h"
#include "core/ep_state.h"
#include "core/launcher_env.h"
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

// The staged transport's delivery: for every peer, the regions of my send buffer addressed to it
// go to my region of its receive buffer, and its regions for me come into region [peer] of mine.
// Sends and receives to one peer are issued in the same order on both sides (NCCL matches them in
// order per peer); the peers are visited in a rotating order so that the first transfers of all
// ranks do not converge on one peer.
class StagedLink final : public Link {
 public:
  StagedLink(ncclComm_t comm, int rank, int size, const WindowLayout& layout, char* send, char* recv)
      : comm_(comm), rank_(rank), size_(size), L_(layout), send_(send), recv_(recv) {}

  bool device_barriers() const override { return false; }
  int64_t row_stride(const DeviceGroup&, int64_t bytes) const override { return (bytes + 15) / 16 * 16; }
  size_t reduce_chunk_bytes(const DeviceGroup&) const override { return region_bytes(); }
  void before_write(const DeviceGroup&, int, cudaStream_t) override {}  // stream order suffices
  void deliver(const DeviceGroup&, const Delivery& d, cudaStream_t stream) override {
    if (size_ == 1 || (d.row_stride == 0 && !d.meta && !d.header && d.chunk_bytes == 0)) return;
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    post(d, stream);
    nccl_check(ncclGroupEnd(), "ncclGroupEnd (staged exchange)");
  }

  /// The sends and receives of one delivery, without the group brackets (the creation warm-up
  /// puts those of several ranks in one group).
  void post(const Delivery& d, cudaStream_t stream) const {
    const size_t meta_per_slot = static_cast<size_t>(L_.max_topk) * sizeof(RowMeta);
    const size_t header_bytes = L_.header_ints * sizeof(int32_t);
    // Slots that travel to / from a peer: what it needs (exact sizes) or the whole region. Both
    // ends compute the same count: my send_tokens[to] is the peer's recv_tokens[me].
    auto slots = [&](const int32_t* counts, int peer) {
      return static_cast<size_t>(counts ? counts[peer] : L_.max_tokens);
    };
    for (int i = 1; i < size_; ++i) {
      const int to = (rank_ + i) % size_, from = (rank_ - i + size_) % size_;
      const size_t out_slots = slots(d.send_slots, to), in_slots = slots(d.recv_slots, from);
      if (d.header) {
        send(send_ + L_.header_offset(to), header_bytes, to, stream);
        recv(recv_ + L_.header_offset(from), header_bytes, from, stream);
      }
      if (d.row_stride > 0) {
        send(send_ + L_.row_offset(to, 0), out_slots * static_cast<size_t>(d.row_stride), to, stream);
        recv(recv_ + L_.row_offset(from, 0), in_slots * static_cast<size_t>(d.row_stride), from, stream);
      }
      if (d.meta) {
        send(send_ + L_.meta_offset(to, 0), out_slots * meta_per_slot, to, stream);
        recv(recv_ + L_.meta_offset(from, 0), in_slots * meta_per_slot, from, stream);
      }
      if (d.chunk_bytes > 0) {
        send(d.chunk, d.chunk_bytes, to, stream);
        recv(recv_ + L_.row_offset(from, 0), d.chunk_bytes, from, stream);
      }
    }
  }

  /// Bytes of one peer's rows region: the largest chunk an all-reduce round moves.
  size_t region_bytes() const { return static_cast<size_t>(L_.max_tokens) * L_.row_bytes; }

 private:
  void send(const void* p, size_t bytes, int peer, cudaStream_t s) const {
    nccl_check(ncclSend(p, bytes, ncclUint8, peer, comm_, s), "ncclSend (staged exchange)");
  }
  void recv(void* p, size_t bytes, int peer, cudaStream_t s) const {
    nccl_check(ncclRecv(p, bytes, ncclUint8, peer, comm_, s), "ncclRecv (staged exchange)");
  }

  ncclComm_t comm_;
  int rank_, size_;
  WindowLayout L_;
  char* send_;
  char* recv_;
};

// What one rank holds; created in phases because the transport agreement, the window
// registration and the staged warm-up are collective.
struct RankResources {
  ncclComm_t comm = nullptr;
  bool owns_comm = false;
  int device = 0, rank = 0, size = 1;
  Transport transport = Transport::kZeroCopy;
  WindowLayout layout;
  // zero-copy
  size_t window_bytes = 0;
  void* window = nullptr;
  ncclWindow_t win = nullptr;
  // staged
  size_t staging_bytes = 0;  // each of the two buffers: the header, meta and rows regions
  void* send_buf = nullptr;
  void* recv_buf = nullptr;
  std::unique_ptr<StagedLink> staged;
  bool stuck = false;  // staged: check() timed out on an exchange that has not completed since
  bool staged_exact = false;  // staged: exchanges sized by the counts prepare copies to the host
  Tensor peer_window, peer_inbox, mailboxes, control;  // device arrays [R] ptr, [R] ptr, [3R] ptr, epoch + status

  size_t registered_bytes() const { return transport == Transport::kZeroCopy ? window_bytes : 2 * staging_bytes; }

  void allocate(const GroupConfig& c) {
    DeviceGuard g(device);
    layout = WindowLayout::make(c, size);
    if (transport == Transport::kZeroCopy) {
      window_bytes = layout.window_bytes();
      nccl_check(ncclMemAlloc(&window, window_bytes), "ncclMemAlloc of the EP window");
      EPX_CUDA_CHECK(cudaMemset(window, 0, window_bytes));
    } else {
      staging_bytes = layout.staging_bytes();
      nccl_check(ncclMemAlloc(&send_buf, staging_bytes), "ncclMemAlloc of the staged send buffer");
      nccl_check(ncclMemAlloc(&recv_buf, staging_bytes), "ncclMemAlloc of the staged receive buffer");
      EPX_CUDA_CHECK(cudaMemset(send_buf, 0, staging_bytes));
      EPX_CUDA_CHECK(cudaMemset(recv_buf, 0, staging_bytes));
      staged = std::make_unique<StagedLink>(comm, rank, size, layout, static_cast<char*>(send_buf),
                                            static_cast<char*>(recv_buf));
    }
  }
  void register_window() {
    if (transport != Transport::kZeroCopy) return;
    DeviceGuard g(device);
    nccl_check(ncclCommWindowRegister(comm, window, window_bytes, &win, NCCL_WIN_COLL_SYMMETRIC),
               "ncclCommWindowRegister");
  }
  void finish() {
    DeviceGuard g(device);
    peer_window = Tensor::zeros({size}, DType::kI64, Device::cuda(device));
    peer_inbox = Tensor::zeros({size}, DType::kI64, Device::cuda(device));
    mailboxes = Tensor::zeros({3 * size}, DType::kI64, Device::cuda(device));
    control = Tensor::zeros({1 + kStatusWords}, DType::kI32, Device::cuda(device));
    const int32_t init[1 + kStatusWords] = {0, 0, kNoBadPair, 0, 0, 0, 0, 0, 0, 0};
    EPX_CUDA_CHECK(cudaMemcpy(control.data(), init, sizeof init, cudaMemcpyHostToDevice));
    if (transport == Transport::kZeroCopy) {
      resolve_peer_windows(win, size, layout.total, static_cast<char**>(peer_window.data()),
                           static_cast<unsigned**>(peer_inbox.data()), nullptr);
      build_zero_copy_mailboxes(layout, rank, size, static_cast<char* const*>(peer_window.data()),
                                static_cast<char**>(mailboxes.data()), nullptr);
      EPX_CUDA_CHECK(cudaDeviceSynchronize());
    } else {
      // Region [p] of the send buffer for peer p; what this rank sends itself goes straight into
      // region [rank] of its receive buffer (nothing travels).
      std::vector<char*> out(3 * size);
      char* sb = static_cast<char*>(send_buf);
      char* rb = static_cast<char*>(recv_buf);
      for (int p = 0; p < size; ++p) {
        char* base = p == rank ? rb : sb;
        out[p] = base + layout.row_offset(p, 0);
        out[size + p] = base + layout.meta_offset(p, 0);
        out[2 * size + p] = base + layout.header_offset(p);
      }
      EPX_CUDA_CHECK(cudaMemcpy(mailboxes.data(), out.data(), out.size() * sizeof(char*), cudaMemcpyHostToDevice));
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
    if (r.stuck) {
      // A staged exchange a peer never joined is still pending: waiting for it would never end.
      // Aborting our own communicator ends NCCL's pending kernels; a borrowed one is not ours to
      // abort, so its buffers are left allocated rather than freed under a running kernel.
      if (r.owns_comm && r.comm) {
        ncclCommAbort(r.comm);
        r.comm = nullptr;
      } else {
        r.send_buf = r.recv_buf = nullptr;
      }
    }
    r.staged.reset();
    r.peer_window = Tensor();
    r.peer_inbox = Tensor();
    r.mailboxes = Tensor();
    r.control = Tensor();
    if (r.window) ncclMemFree(r.window);
    if (r.send_buf) {
      cudaDeviceSynchronize();  // no staged exchange may still read or write the buffers
      ncclMemFree(r.send_buf);
    }
    if (r.recv_buf) ncclMemFree(r.recv_buf);
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

// Per rank of this process: the transport it can use for the request, or why it cannot.
struct Choice {
  Transport transport = Transport::kZeroCopy;
  std::string error;
  bool exact_sizes = false;  // staged: exchanges sized by the counts (GroupConfig::staged_exact_sizes)
};

Choice choose(Transport requested, const RankResources& r) {
  Choice c;
  if (requested == Transport::kStaged) {
    c.transport = Transport::kStaged;
    return c;
  }
  // A one-rank communicator has no symmetric-memory runtime behind its windows (their peer
  // pointers are not valid on the device), and nothing to send: the staged path only copies locally.
  if (r.size == 1) {
    if (requested == Transport::kZeroCopy)
      c.error = "a one-rank group has no peers to reach by load/store; use Transport::kStaged or kAuto (or "
                "Group::create_local, which needs no NCCL at all)";
    else
      c.transport = Transport::kStaged;
    return c;
  }
  const int lsa = lsa_team_size(r.comm);
  if (lsa == r.size) {
    c.transport = Transport::kZeroCopy;
  } else if (requested == Transport::kZeroCopy) {
    c.error = detail::concat("rank ", r.rank, " was asked for the zero-copy transport but cannot reach every peer's ",
                             "memory by load/store (NCCL's LSA team has ", lsa, " of the group's ", r.size,
                             " ranks); use Transport::kStaged or kAuto (or EPX_TRANSPORT=staged / auto)");
  } else {
    c.transport = Transport::kStaged;
  }
  return c;
}

// This rank's votes (GroupVotes): its transport choice and, on zero-copy, the protocol settings the
// ranks must share.
GroupVotes votes_of(const Choice& c) {
  GroupVotes v;
  if (!c.error.empty()) {
    v.n[GroupVotes::kFailed] = 1;
    return v;
  }
  v.n[c.transport == Transport::kZeroCopy ? GroupVotes::kZeroCopy : GroupVotes::kStaged] = 1;
  v.n[GroupVotes::kExactSizes] = c.exact_sizes ? 1 : 0;
  const ZeroCopyProtocol p = zero_copy_protocol();
  v.n[GroupVotes::kBarrierLaunch] = p.inline_barrier ? 0 : 1;
  v.n[GroupVotes::kOneHeaderCopy] = p.two_header_copies ? 0 : 1;
  return v;
}

// The votes of this process's ranks (`mine`, one per rank) summed over every rank of the group with
// one small ncclAllReduce.
GroupVotes allreduce_votes(std::vector<RankResources*>& ranks, const std::vector<GroupVotes>& mine) {
  const size_t n = ranks.size();
  constexpr int kWords = GroupVotes::kCount;
  std::vector<Tensor> votes(n);
  std::vector<cudaStream_t> streams(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    DeviceGuard g(ranks[i]->device);
    votes[i] = Tensor::empty({kWords}, DType::kI32, Device::cuda(ranks[i]->device));
    EPX_CUDA_CHECK(cudaMemcpy(votes[i].data(), mine[i].n.data(), sizeof(int32_t) * kWords, cudaMemcpyHostToDevice));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
  }
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  for (size_t i = 0; i < n; ++i)
    nccl_check(ncclAllReduce(votes[i].data(), votes[i].data(), kWords, ncclInt32, ncclSum, ranks[i]->comm, streams[i]),
               "ncclAllReduce (transport agreement)");
  nccl_check(ncclGroupEnd(), "ncclGroupEnd (transport agreement)");
  GroupVotes total;
  for (size_t i = 0; i < n; ++i) {
    DeviceGuard g(ranks[i]->device);
    EPX_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
    EPX_CUDA_CHECK(cudaMemcpy(total.n.data(), votes[i].data(), sizeof(int32_t) * kWords, cudaMemcpyDeviceToHost));
    EPX_CUDA_CHECK(cudaStreamDestroy(streams[i]));
  }
  return total;
}

// Every rank's choice, agreed before anything transport-specific is set up: a rank that cannot
// serve the request, or ranks that chose differently (EPX_TRANSPORT set differently), make every
// rank throw instead of some of them hanging in a collective the others never join. When this
// process drives the whole group the choices are compared here; otherwise the votes are summed
// over the group (one small collective, at creation only).
void agree_on_transport(std::vector<RankResources*>& ranks, const std::vector<Choice>& choices, const char* fn) {
  const int R = ranks[0]->size;
  std::vector<GroupVotes> mine;
  GroupVotes total;
  for (const Choice& c : choices) {
    mine.push_back(votes_of(c));
    for (int i = 0; i < GroupVotes::kCount; ++i) total.n[i] += mine.back().n[i];
  }
  if (static_cast<int>(ranks.size()) < R) total = allreduce_votes(ranks, mine);
  for (const Choice& c : choices)
    if (!c.error.empty()) throw Error(Status::kNotSupported, detail::concat(fn, ": ", c.error));
  check_group_votes(total, R, fn);
  for (RankResources* r : ranks) {
    r->transport = choices[0].transport;
    r->staged_exact = r->transport == Transport::kStaged && total.n[GroupVotes::kExactSizes] == R;
  }
}

// The staged transport's first exchange, at creation and synchronous: NCCL connects peers lazily
// on their first send/receive (allocating memory, waiting for the peer), which must not happen
// inside a captured graph or while a peer's kernels are in flight. One full-size delivery of every
// kind connects every peer on every channel the ops will use.
void warm_up_staged(std::vector<RankResources*>& ranks) {
  if (ranks.empty() || ranks[0]->transport != Transport::kStaged || ranks[0]->size == 1) return;
  std::vector<cudaStream_t> streams(ranks.size(), nullptr);
  for (size_t i = 0; i < ranks.size(); ++i) {
    DeviceGuard g(ranks[i]->device);
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
  }
  Delivery all;
  all.header = true;
  all.meta = true;
  all.row_stride = static_cast<int64_t>(ranks[0]->layout.row_bytes);
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i]->staged->post(all, streams[i]);
  nccl_check(ncclGroupEnd(), "ncclGroupEnd (staged warm-up)");
  for (size_t i = 0; i < ranks.size(); ++i) {
    DeviceGuard g(ranks[i]->device);
    EPX_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
    EPX_CUDA_CHECK(cudaStreamDestroy(streams[i]));
  }
}

// Sets up the ranks this process drives, all at once (collective calls grouped across them).
void set_up(std::vector<RankResources*>& ranks, Transport requested, const GroupConfig& config, const char* fn) {
  std::vector<Choice> choices;
  const bool exact = resolved_staged_exact_sizes(config, fn);
  for (RankResources* r : ranks) {
    choices.push_back(choose(requested, *r));
    choices.back().exact_sizes = exact;
  }
  agree_on_transport(ranks, choices, fn);
  for (RankResources* r : ranks) r->allocate(config);
  if (ranks[0]->transport == Transport::kZeroCopy) {
    nccl_check(ncclGroupStart(), "ncclGroupStart");
    for (RankResources* r : ranks) r->register_window();
    nccl_check(ncclGroupEnd(), "ncclGroupEnd (window registration)");
  }
  for (RankResources* r : ranks) r->finish();
  warm_up_staged(ranks);
}

class NcclGroup final : public GroupState {
 public:
  NcclGroup(std::shared_ptr<World> world, int index, const GroupConfig& c) : world_(std::move(world)), index_(index) {
    RankResources& r = res();
    config = c;
    rank = r.rank;
    size = r.size;
    local_experts = c.num_experts / size;
    device = Device::cuda(r.device);
    transport = r.transport;
    staged_exact_ = r.staged_exact;
    config.staged_exact_sizes = staged_exact_;
    recv_capacity_rows = c.recv_capacity_rows > 0 ? c.recv_capacity_rows : worst_case_recv_rows(c, size);
    registered_bytes = r.registered_bytes();
    id = next_group_id();
    link_ = transport == Transport::kZeroCopy ? &barrier_link() : static_cast<Link*>(r.staged.get());
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
    dg_.out = static_cast<char* const*>(r.mailboxes.data());
    dg_.epoch = static_cast<uint32_t*>(r.control.data());
    dg_.status = r.control.ptr<int32_t>() + 1;
    dg_.timeout_ns = static_cast<uint64_t>(resolved_timeout_s(c) * 1e9);
    dg_.send_blocks = c.num_sms > 0 ? c.num_sms : 32;
    dg_.sm_budget = c.num_sms;
    dg_.signal_mode = std::max(0, ::epx::detail::env_choice("EPX_EP_SIGNAL", {"relaxed", "release", "fence"}));
    if (transport == Transport::kZeroCopy) {
      dg_.peer_window = static_cast<char* const*>(r.peer_window.data());
      dg_.my_window = static_cast<char*>(r.window);
      dg_.peer_inbox = static_cast<uint32_t* const*>(r.peer_inbox.data());
      dg_.my_inbox = reinterpret_cast<uint32_t*>(static_cast<char*>(r.window) + r.layout.total);
    } else {
      dg_.my_window = static_cast<char*>(r.recv_buf);
      DeviceGuard g(r.device);
      EPX_CUDA_CHECK(cudaEventCreateWithFlags(&last_exchange_, cudaEventDisableTiming));
      // Pinned, so that prepare's copy of the counts is asynchronous and its wait can time out
      // (a copy into pageable memory would block until a missing peer arrived, forever).
      if (staged_exact_) EPX_CUDA_CHECK(cudaMallocHost(&host_counts_, 2 * static_cast<size_t>(size) * sizeof(int32_t)));
    }
  }
  ~NcclGroup() override {
    if (last_exchange_) cudaEventDestroy(last_exchange_);
    if (host_counts_) cudaFreeHost(host_counts_);
  }

  void prepare(HandleState& h, const TensorRef& topk_idx, const TensorRef& topk_weights, const PrepareOptions& options,
               Stream stream) override {
    DeviceGuard g(device.index);
    if (staged_exact_) require_not_capturing(stream);  // before anything is queued, NCCL's sends above all
    h.storage = pool_->acquire();
    cuda::bind_handle(h, h.storage.get(), config, size, rank, device);
    cuda::prepare_send_side(h, topk_idx, topk_weights, options, /*local=*/false, config.align, h.recv_capacity,
                            dg_.status, stream);
    exchange_counts(for_handle(h), *link_, h, cuda::handle_segment_starts(h), stream);
    note_exchange(stream, kOpPrepare);
    h.host_send_tokens.clear();
    h.host_recv_tokens.clear();
    if (staged_exact_) copy_counts_to_host(h, stream);
  }

  // The group's device view with this handle's recv capacity (a pipeline chunk's may be smaller):
  // the layout flags an overflow against it, and the expansion then writes nothing.
  DeviceGroup for_handle(const HandleState& h) const {
    DeviceGroup g = dg_;
    g.recv_capacity = h.recv_capacity;
    return g;
  }

  static void require_not_capturing(Stream stream) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    EPX_CUDA_CHECK(cudaStreamIsCapturing(cuda::to_cuda(stream), &capturing));
    require(capturing == cudaStreamCaptureStatusNone, "epx::prepare",
            "the group exchanges exact sizes (GroupConfig::staged_exact_sizes or EPX_STAGED_SIZES=exact), "
            "which needs the counts on the host: its prepare cannot be captured in a CUDA graph");
  }

  // Staged exact sizes: the per-peer counts on the host. The wait for them is the staged exchange's
  // wait with the group's timeout, so a peer that never calls prepare is an error, not a hang.
  void copy_counts_to_host(HandleState& h, Stream stream) {
    cudaStream_t s = cuda::to_cuda(stream);
    const size_t n = static_cast<size_t>(size);
    EPX_CUDA_CHECK(cudaMemcpyAsync(host_counts_, h.send_tokens.data(), n * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    EPX_CUDA_CHECK(
        cudaMemcpyAsync(host_counts_ + n, h.recv_tokens.data(), n * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    note_exchange(stream, kOpPrepare);
    wait_for_last_exchange();
    h.host_send_tokens.assign(host_counts_, host_counts_ + n);
    h.host_recv_tokens.assign(host_counts_ + n, host_counts_ + 2 * n);
  }

  void dispatch_forward(HandleState& h, const TensorRef& x, const TensorRef& x_scales, const TensorRef& topk_weights,
                        const TensorRef& recv_x, const TensorRef& recv_scales, const TensorRef& recv_weights,
                        Stream stream) override {
    DeviceGuard g(device.index);
    dispatch_rows(for_handle(h), *link_, h, cuda::handle_segment_starts(h), x, x_scales, topk_weights, recv_x,
                  recv_scales, recv_weights, stream);
    note_exchange(stream, kOpDispatch);
  }

  void combine_forward(HandleState& h, const TensorRef& y, const TensorRef& row_weights, const TensorRef& out,
                       Stream stream) override {
    DeviceGuard g(device.index);
    reduce_rows(dg_, *link_, h, kOpCombine, y, row_weights, TensorRef(), out, TensorRef(), stream);
    note_exchange(stream, kOpCombine);
  }

  void combine_backward(HandleState& h, const TensorRef& d_out, const TensorRef& y, const TensorRef& row_weights,
                        const TensorRef& d_y, const TensorRef& d_row_weights, Stream stream) override {
    DeviceGuard g(device.index);
    // Without row weights this op copies each d_out row to the token's expert rows, exactly what
    // dispatch does with x: on zero-copy it takes the dispatch's launch, whose expansion overlaps the
    // transfer (the spread waits for every row before it starts; 2 x H200, T=4096: see bench/NOTES.md).
    if (!row_weights.defined() && !d_row_weights.defined() && transport == Transport::kZeroCopy)
      dispatch_rows(for_handle(h), *link_, h, cuda::handle_segment_starts(h), d_out, TensorRef(), TensorRef(), d_y,
                    TensorRef(), TensorRef(), stream, kOpCombineBwd);
    else
      spread_rows(dg_, *link_, h, d_out, y, row_weights, d_y, d_row_weights, stream);
    note_exchange(stream, kOpCombineBwd);
  }

  void dispatch_backward(HandleState& h, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                         const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream) override {
    DeviceGuard g(device.index);
    reduce_rows(dg_, *link_, h, kOpDispatchBwd, d_recv_x, TensorRef(), d_recv_weights, d_x, d_topk_weights, stream);
    note_exchange(stream, kOpDispatchBwd);
  }

  void all_reduce_sum(const TensorRef& buffer, Stream stream) override {
    DeviceGuard g(device.index);
    all_reduce(dg_, *link_, buffer, stream);
    note_exchange(stream, kOpReduce);
  }

  void reserve_handles(size_t handles) override { pool_->reserve(handles); }
  void check() override {
    DeviceGuard g(device.index);
    if (transport == Transport::kStaged) wait_for_last_exchange();
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    if (transport == Transport::kStaged) {
      ncclResult_t async = ncclSuccess;
      nccl_check(ncclCommGetAsyncError(res().comm, &async), "ncclCommGetAsyncError");
      nccl_check(async, "the staged exchange (asynchronous NCCL error)");
    }
    int32_t s[kStatusWords];
    EPX_CUDA_CHECK(cudaMemcpy(s, dg_.status, sizeof s, cudaMemcpyDeviceToHost));
    // Reset everything but the broken flag: a group that timed out stays unusable.
    int32_t reset[kStatusWords] = {0, kNoBadPair, 0, 0, 0, s[5], s[6], s[7], s[8]};
    EPX_CUDA_CHECK(cudaMemcpy(dg_.status, reset, sizeof reset, cudaMemcpyHostToDevice));
    if (s[7] != 0) {
      std::string missing;
      for (int p = 0; p < size; ++p)
        if ((p < 32 ? s[5] : s[6]) >> (p & 31) & 1) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
      throw Error(Status::kTimeout,
                  detail::concat("epx::", op_name(s[7]), ": rank ", rank, " waited ", resolved_timeout_s(config),
                                 " s at barrier ", static_cast<uint32_t>(s[8]), "; rank(s) ", missing,
                                 " never arrived (do all ranks make the same collective calls in the same order?). "
                                 "The group is unusable; destroy it on every rank."));
    }
    raise_layout_status(s, rank, config.num_experts, recv_capacity_rows,
                        std::exchange(smaller_handle_capacity, false));
  }

 private:
  RankResources& res() const { return world_->ranks[index_]; }

  static const char* op_name(int code) {
    static const char* ops[] = {"?", "prepare", "dispatch_forward", "combine_forward", "combine_backward",
                                "dispatch_backward", "all_reduce_sum"};
    return code >= 1 && code <= 6 ? ops[code] : "?";
  }

  // Staged: marks the end of the latest exchange on its stream (outside graph capture), so that
  // check() can wait for it with a timeout instead of blocking forever on a peer that never joins.
  void note_exchange(Stream stream, int op_code) {
    if (!last_exchange_) return;
    cudaStream_t s = cuda::to_cuda(stream);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &capturing) != cudaSuccess || capturing != cudaStreamCaptureStatusNone) {
      cudaGetLastError();  // e.g. the legacy stream while another thread captures: no marker this time
      return;
    }
    EPX_CUDA_CHECK(cudaEventRecord(last_exchange_, s));
    last_op_ = op_code;
  }

  void wait_for_last_exchange() {
    if (!last_exchange_ || last_op_ == 0) return;
    const double timeout = resolved_timeout_s(config);
    const auto start = std::chrono::steady_clock::now();
    while (true) {
      const cudaError_t e = cudaEventQuery(last_exchange_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) EPX_CUDA_CHECK(e);
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout) {
        res().stuck = true;
        throw Error(Status::kTimeout,
                    detail::concat("epx::", op_name(last_op_), ": rank ", rank, " waited ", timeout,
                                   " s for the staged exchange (ncclSend/ncclRecv) to complete; a peer has not made "
                                   "the same call (do all ranks make the same collective calls in the same order?). "
                                   "NCCL does not say which peer is missing; the exchange stays queued and completes "
                                   "if the peer arrives; destroying the group before that aborts the communicator "
                                   "it created (a borrowed one is left alone)."));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    last_op_ = 0;
    res().stuck = false;
  }

  std::shared_ptr<World> world_;
  int index_;
  DeviceGroup dg_;
  Link* link_ = nullptr;
  bool staged_exact_ = false;
  int32_t* host_counts_ = nullptr;  // staged exact sizes: [send counts | recv counts], pinned
  std::shared_ptr<HandlePool> pool_;
  cudaEvent_t last_exchange_ = nullptr;
  int last_op_ = 0;
};

// The state of a group for the one rank this process drives on a communicator (collective: every
// rank of the communicator builds its own at the same time).
std::unique_ptr<GroupState> single_rank_state(ncclComm_t c, bool owns_comm, int device, int rank, int size,
                                              const GroupConfig& config, Transport requested, const char* fn) {
  auto world = std::make_shared<World>();
  world->ranks.resize(1);
  RankResources& rr = world->ranks[0];
  rr.comm = c;
  rr.owns_comm = owns_comm;
  rr.device = device;
  rr.rank = rank;
  rr.size = size;
  std::vector<RankResources*> mine{&rr};
  set_up(mine, requested, config, fn);
  return std::make_unique<NcclGroup>(world, 0, config);
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

// ncclCommInitRank on the current device, then this rank's group over the new communicator (which
// the group owns).
std::unique_ptr<GroupState> init_rank(const ncclUniqueId& id, int rank, int world, int device, const GroupConfig& config,
                                      Transport requested, const char* fn) {
  ncclComm_t c = nullptr;
  nccl_check(ncclCommInitRank(&c, world, id, rank), "ncclCommInitRank");
  return single_rank_state(c, /*owns_comm=*/true, device, rank, world, config, requested, fn);
}

ncclUniqueId from_hex(const std::string& s, const char* where) {
  ncclUniqueId id{};
  require(s.size() == 2 * sizeof id.internal && s.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos,
          "epx::Group", where, " holds '", s.substr(0, 80), "' (", s.size(),
          " characters), expected ", 2 * sizeof id.internal, " hex digits (an ncclUniqueId)");
  for (size_t i = 0; i < sizeof id.internal; ++i)
    id.internal[i] = static_cast<char>(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  return id;
}

}  // namespace
}  // namespace comm

std::vector<Group> Group::create_all_local(const GroupConfig& config, std::vector<int> devices) {
  const char* fn = "epx::Group::create_all_local";
  const Transport requested = requested_transport(config, fn);
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
  }
  std::vector<comm::RankResources*> all;
  for (auto& rr : world->ranks) all.push_back(&rr);
  comm::set_up(all, requested, config, fn);
  std::vector<Group> groups;
  for (int r = 0; r < R; ++r) groups.push_back(Group(std::make_unique<comm::NcclGroup>(world, r, config)));
  return groups;
}

Group Group::from_nccl(void* nccl_comm, const GroupConfig& config) {
  const char* fn = "epx::Group::from_nccl";
  const Transport requested = requested_transport(config, fn);
  require(nccl_comm != nullptr, fn, "nccl_comm is null");
  ncclComm_t c = static_cast<ncclComm_t>(nccl_comm);
  int R = 0, rank = 0, dev = 0;
  comm::nccl_check(ncclCommCount(c, &R), "ncclCommCount");
  comm::nccl_check(ncclCommUserRank(c, &rank), "ncclCommUserRank");
  comm::nccl_check(ncclCommCuDevice(c, &dev), "ncclCommCuDevice");
  config.validate(fn, R);
  return Group(comm::single_rank_state(c, /*owns_comm=*/false, dev, rank, R, config, requested, fn));
}

Group Group::create_from_env(const GroupConfig& config) {
  const char* fn = "epx::Group::create_from_env";
  // The k-th group this process creates from the environment (every rank creates its groups in the
  // same order) takes its NCCL id from EPX_NCCL_ID_FILE for k = 0 and from "<file>.<k>" after that.
  static std::atomic<int> groups_from_env{0};
  const int serial = groups_from_env.fetch_add(1);
  const Transport requested = requested_transport(config, fn);
  const detail::LauncherEnv le = detail::launcher_env(fn);
  require(le.launched, fn, "no launcher variables are set: RANK and WORLD_SIZE (and LOCAL_RANK), or Open MPI's ",
          "OMPI_COMM_WORLD_*, Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, PMI_RANK / PMI_SIZE");
  const int rank = le.rank, world = le.world, local = le.local_rank;
  config.validate(fn, world);
  const int n = detail::cuda_device_count();
  require(local < n, fn, le.local_name.empty() ? std::string("the local rank (no LOCAL_RANK set)") : le.local_name,
          " is ", local, " but ", n, " CUDA device(s) are visible");
  EPX_CUDA_CHECK(cudaSetDevice(local));
  ncclUniqueId id{};
  const char* env_id = std::getenv("EPX_NCCL_ID");
  const char* file = std::getenv("EPX_NCCL_ID_FILE");
  if (env_id) {
    require(serial == 0, fn, "EPX_NCCL_ID holds one NCCL id, good for one group per process, and this is group ",
            serial + 1, " created from the environment; use EPX_NCCL_ID_FILE (one id file per group)");
    id = comm::from_hex(env_id, "EPX_NCCL_ID");
  } else {
    require(file != nullptr, fn, "neither EPX_NCCL_ID (hex) nor EPX_NCCL_ID_FILE (a path every rank can read) is set");
    const std::string path = serial == 0 ? std::string(file) : std::string(file) + "." + std::to_string(serial);
    file = path.c_str();
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
  return Group(comm::init_rank(id, rank, world, local, config, requested, fn));
}

Group Group::create_from_id(const std::string& nccl_id, int rank, int world_size, int device, const GroupConfig& config) {
  const char* fn = "epx::Group::create_from_id";
  const Transport requested = requested_transport(config, fn);
  require(world_size >= 1 && rank >= 0 && rank < world_size, fn, "rank is ", rank, " and world_size is ", world_size,
          ", expected 0 <= rank < world_size");
  config.validate(fn, world_size);
  const int n = detail::cuda_device_count();
  require(device >= 0 && device < n, fn, "device is ", device, " but ", n, " CUDA device(s) are visible");
  EPX_CUDA_CHECK(cudaSetDevice(device));
  return Group(comm::init_rank(comm::from_hex(nccl_id, "nccl_id"), rank, world_size, device, config, requested, fn));
}

std::string nccl_unique_id() {
  ncclUniqueId id{};
  comm::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return comm::hex(id);
}

}  // namespace epx
