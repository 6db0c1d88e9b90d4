// The expert-parallel group and its collective operations.
//
// A Group is one EP group of R ranks holding E experts, E/R per rank (rank r owns experts
// [r*E/R, (r+1)*E/R)). It owns the communication resources sized ONCE from GroupConfig
// (rank-major windows of max_tokens_per_rank x R rows, never an expert-major worst case), so every
// op has fixed shapes and a whole layer can be captured in a CUDA graph.
//
// dispatch_forward moves each token once per destination RANK (dedup), then the receiver expands
// it into the expert-major layout: local expert j's rows are contiguous, ordered by (source rank,
// source token, topk slot), padded to a multiple of `align` with zero rows. combine_forward
// reduces on the expert side, per (token, source rank), in fp32 over the topk slots in ascending
// order, rounds that partial to the payload dtype (it travels in that dtype), and the source sums
// the partials of ranks 0..R-1 in fp32 and rounds once more: results are bit-identical run to run.
//
// Backward: combine_backward = dispatch of d_out (times the row weight) plus the gradient of the
// row weights (fp32 dot products of d_out and y); dispatch_backward = combine of the row gradients
// (unweighted) plus the row-weight gradients sent back to their [T, K] slots.
//
// Every op is collective over the group: all ranks call it, in the same order, on one stream each.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx {

class Handle;
struct GroupState;

/// How the ranks of an NCCL group exchange rows. Both GPU transports run the same kernels in the
/// same order, so their results are bit-identical (and equal the reference where it promises).
/// Chosen once at creation: GroupConfig::transport when it names one, else EPX_TRANSPORT (auto,
/// zerocopy, staged; any other value is an error), else auto. Every rank must end up with the same
/// transport; creation checks that and fails on every rank otherwise.
enum class Transport : uint8_t {
  kAuto,      // zero-copy when every rank is in one NCCL LSA team (one NVLink domain), staged otherwise
  kZeroCopy,  // NCCL device API: stores into peers' symmetric windows through LSA pointers, device
              // barriers with timeouts; intranode (LSA team) only
  kStaged,    // ncclSend/ncclRecv inside ncclGroupStart/End between two buffers per rank (send, receive;
              // rank-major, allocated at creation): works wherever NCCL does (other nodes, PCIe,
              // network). No host sync: counts stay on the device, so every exchange moves the fixed
              // worst case, max_tokens_per_rank rows (each only as wide as the op's rows) plus their
              // metadata to every peer. Size max_tokens_per_rank tightly for this transport, or let
              // prepare bring the counts to the host (GroupConfig::staged_exact_sizes). A peer
              // that never joins is reported by check() after the timeout (NCCL cannot name it).
  kHost,      // the CPU reference: ranks are threads, windows are shared host buffers
  kLocal,     // one GPU, no communication: dispatch and combine are local permutes
};
const char* transport_name(Transport t);

struct GroupConfig {
  int num_experts = 0;
  int64_t hidden = 0;
  int max_tokens_per_rank = 0;
  int max_topk = 16;
  DType max_dtype = DType::kBF16;  // widest payload the buffers are sized for
  int align = 1;                   // expert segment padding: 1, 16, 32 or 128 rows (any power of two)
  int64_t recv_capacity_rows = 0;  // 0 = worst case (R * max_tokens * min(K, E/R) + padding)
  // SMs for the EP kernels. > 0: no EP launch has more blocks, so EP occupies at most this many SMs
  // and the rest stay free for work running beside it (NCCL's own kernels on the staged transport
  // are NCCL's). 0 = auto: a fixed number of blocks drive the link (64 in the zero-copy dispatch,
  // 32 elsewhere) and the receive side (expansion, reduction, sums) takes every SM, the fastest
  // where nothing runs beside EP. A budget also slows the receive side, which is memory-bound: in
  // the MoE layer with overlap_communication on 2 H200s (DeepSeek-V3-like, T = 4096 a rank) a
  // budget of 16 SMs made forward+backward 1.22x slower and 8 SMs 1.53x, more than the GEMMs beside
  // the collectives gained.
  int num_sms = 0;
  double timeout_s = 0;            // device/host waits; 0 = EPX_TIMEOUT_S or 10 s
  Transport transport = Transport::kAuto;  // for NCCL groups; see Transport
  /// Staged transport only: prepare copies the per-peer token counts to the host (one stream
  /// synchronisation per prepare), and every exchange then moves only the slots each peer needs
  /// instead of the fixed worst case (what pays off with many ranks, where a peer needs a fraction
  /// of max_tokens_per_rank). Such a prepare cannot be captured in a CUDA graph (it is an error), and
  /// the handle's exchanges are sized at that prepare. Also on with EPX_STAGED_SIZES=exact
  /// (fixed = off; other values are errors).
  bool staged_exact_sizes = false;

  void validate(const char* fn, int num_ranks) const;
};

/// One rank's view of an EP group.
class Group {
 public:
  Group();
  ~Group();
  Group(Group&&) noexcept;
  Group& operator=(Group&&) noexcept;
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  /// CPU reference backend: R simulated ranks in this process. Element r is rank r's view and
  /// must be used by one thread (see run_ranks); all views share the windows and the barrier.
  static std::vector<Group> create_simulated(int num_ranks, const GroupConfig& config);
  /// A group of one rank on CUDA device `device` (needs the CUDA backend): every expert is local.
  static Group create_local(const GroupConfig& config, int device = 0);
  /// One process driving several GPUs (default: every visible one): one view per device, created
  /// together (ncclCommInitAll); use each view from its own thread (run_ranks). The devices of one
  /// process see each other's memory, and CUDA may make a cudaMalloc/cudaFree on one device wait
  /// for kernels on a peer: do not allocate or free device memory on one rank's thread while a
  /// collective of another rank is in flight (allocate first, meet at a host barrier, then run).
  static std::vector<Group> create_all_local(const GroupConfig& config, std::vector<int> devices = {});
  /// Borrows an existing NCCL communicator (an ncclComm_t, e.g. PyTorch's): collective over its
  /// ranks. The communicator must outlive the group.
  static Group from_nccl(void* nccl_comm, const GroupConfig& config);
  /// One process per GPU: RANK / WORLD_SIZE / LOCAL_RANK, or the first complete set of Open MPI's
  /// OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK, Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID
  /// and PMI_RANK / PMI_SIZE / MPI_LOCALRANKID (RANK without WORLD_SIZE is an error), and the
  /// NCCL id from EPX_NCCL_ID (hex) or EPX_NCCL_ID_FILE (rank 0 writes it, the others read it).
  /// Several groups per process: every rank creates them in the same order, and the k-th (k >= 1)
  /// takes its id from "<EPX_NCCL_ID_FILE>.<k>" (EPX_NCCL_ID serves one group only).
  static Group create_from_env(const GroupConfig& config);
  /// One process per GPU with the NCCL id shared by the caller's own means (a framework's key-value
  /// store): nccl_id is nccl_unique_id() of rank 0, in hex, given to every rank; device is this
  /// rank's CUDA device. Any number of groups per process.
  static Group create_from_id(const std::string& nccl_id, int rank, int world_size, int device,
                              const GroupConfig& config);

  int rank() const;
  int size() const;
  int local_experts() const;
  int first_local_expert() const { return rank() * local_experts(); }
  const GroupConfig& config() const;
  Device device() const;
  Transport transport() const;
  /// Rows of every expert-major buffer (recv_x, y, ...): the configured or worst-case capacity.
  int64_t recv_capacity_rows() const;
  /// Bytes of communication buffers this rank holds for the group (zero-copy: its window; staged:
  /// its send and receive buffers), allocated once at creation.
  size_t registered_bytes() const;
  /// Synchronises with the device and raises the first error recorded since the last check by
  /// any live handle of this group (a bad expert id, a recv-capacity overflow, a peer timeout; on
  /// the staged transport also an exchange still incomplete after the timeout, or an NCCL error).
  /// Ops never synchronise by themselves, so call it at a host-visible point (e.g. once a step).
  void check();

  GroupState& state() const;

 private:
  explicit Group(std::unique_ptr<GroupState> s);
  std::unique_ptr<GroupState> state_;
};

/// A fresh NCCL unique id in hex (what EPX_NCCL_ID and Group::create_from_id take).
std::string nccl_unique_id();

/// The bytes of communication buffers one rank of a group with `config` on `num_ranks` ranks
/// registers with NCCL over `transport` (zero-copy: its window; staged: its send and receive
/// buffers): what Group::registered_bytes() returns once the group exists, known without a GPU.
size_t registered_bytes_per_rank(const GroupConfig& config, int num_ranks, Transport transport);

/// Runs fn(group_of_rank_r) on one thread per rank and joins them; the first exception thrown by
/// any rank is rethrown (after all threads ended) with the rank named.
void run_ranks(std::vector<Group>& groups, const std::function<void(Group&)>& fn);

/// Sum of a float tensor over the group, in place, in rank order (deterministic).
void all_reduce_sum(Group& group, const TensorRef& buffer, Stream stream = {});

/// x [T, H] payload; topk_weights [T, K] fp32 (optional: only weighted combine / early weights
/// need them). recv_x [>= recv_capacity_rows, H] same dtype as x; recv_weights [>= rows] fp32
/// (optional) receives each row's topk weight (0 on padding rows).
void dispatch_forward(Group& group, Handle& handle, const TensorRef& x, const TensorRef& topk_weights,
                      const TensorRef& recv_x, const TensorRef& recv_weights, Stream stream = {});

/// Quantized dispatch: x [T, H] fp8 (e4m3) and its per-row block scales x_scales [T, S] travel
/// together, about half the bytes of bf16: S = H/128 fp32 scales (the 1x128 recipe) or H/32 e8m0
/// scales (MXFP8 rowwise), see epx/quant.h. recv_scales [>= rows, S] lands beside recv_x in the same
/// expert-major order; padding rows get zero payload and zero scale bytes. With align a multiple of
/// 32 (MX) or 128, every expert segment is a whole number of scale blocks down the rows too, as a
/// column-wise consumer (the wgrad GEMM) needs.
///
/// Quantize on the way: x may instead be fp32, bf16 or fp16 with x_scales undefined; then recv_x
/// (fp8_e4m3) and recv_scales pick the recipe: fp32 recv_scales [>= rows, H/128] = FP8 1x128 blocks,
/// e8m0 recv_scales [>= rows, H/32] = MXFP8 rowwise with quant_options.mx_rounding (H must be a
/// multiple of the block). The result is bit-identical to quantize(recipe, x, q, s, quant_options)
/// followed by the quantized dispatch of (q, s), NaN / inf / zero-block rules included (epx/quant.h).
/// The one-GPU group does it in one kernel that reads each token row once and writes the fp8 row and
/// its scales to every destination; the other backends quantize into a temporary at the source (host
/// memory, or the device's stream-ordered pool: no host synchronisation) and send that.
/// quant_options is ignored when x is already fp8.
void dispatch_forward(Group& group, Handle& handle, const TensorRef& x, const TensorRef& x_scales,
                      const TensorRef& topk_weights, const TensorRef& recv_x, const TensorRef& recv_scales,
                      const TensorRef& recv_weights, Stream stream = {}, const QuantOptions& quant_options = {});

/// y [>= rows, H] expert outputs in recv_x's layout (padding rows are never read).
/// row_weights: recv_weights from dispatch for a weighted sum, or undefined for a plain sum
/// (weights already applied between FC1 and FC2). out [T, H] in y's dtype.
void combine_forward(Group& group, Handle& handle, const TensorRef& y, const TensorRef& row_weights,
                     const TensorRef& out, Stream stream = {});

/// d_out [T, H] -> d_y [>= rows, H] (w_row * d_out[t], zero padding) and, when row_weights is
/// given, d_row_weights [>= rows] fp32 = <d_out[t], y[row]>; y is the forward's expert output.
void combine_backward(Group& group, Handle& handle, const TensorRef& d_out, const TensorRef& y,
                      const TensorRef& row_weights, const TensorRef& d_y, const TensorRef& d_row_weights,
                      Stream stream = {});

/// d_recv_x [>= rows, H] -> d_x [T, H] (sum over the token's rows); d_recv_weights [>= rows]
/// (optional) -> d_topk_weights [T, K] fp32 (0 for masked or dropped slots).
void dispatch_backward(Group& group, Handle& handle, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                       const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream = {});

}  // namespace epx
