// EP kernels of both NCCL transports (see ep_kernels.h): writers put rows into per-peer mailboxes,
// a Link delivers them, readers work on their own receive area.
//
// Zero-copy: the mailboxes are the peers' symmetric windows (LSA pointers resolved once at group
// creation) and the Link is a device barrier with timeout (signal.cuh), so every op is  barrier
// (peers finished reading what they got last time) -> writers -> barrier (the rows are visible) ->
// readers. Staged: the mailboxes are a local send buffer and the Link is ncclSend/ncclRecv.
// Each phase is its own kernel, so a kernel boundary orders the phases of all blocks. On zero-copy,
// dispatch and combine (and dispatch_backward) instead run their two phases in one launch after
// the first barrier, readers waiting on per-chunk arrival counters (dispatch_overlap.cu,
// combine_overlap.cu), with the same per-element code (ep_device.cuh). The window
// layout and the arithmetic are exactly the host reference's (src/ref/host_group.cpp): same
// regions, same slots, same fp32 orders, so the GPU results equal the reference bit for bit where
// it promises, on either transport.
//
// Work decomposition: one warp per item (a token on the sending side, a received (source, token)
// row on the receiving side), 16-byte vectors when rows and pointers allow, several loads in flight.
#include "comm/ep_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "comm/ep_device.cuh"
#include "comm/signal.cuh"
#include "core/env_choice.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/dtype_cuda.cuh"
#include "cuda/common/row_reduce_tuning.h"

namespace epx::comm {
namespace {

using namespace ep_device;

__global__ void barrier_kernel(SignalArgs s, int op, BarrierAfter after) { group_barrier(s, op, after); }

void barrier(const DeviceGroup& g, int op, cudaStream_t stream, BarrierAfter after) {
  barrier_kernel<<<1, 64, 0, stream>>>(signal_of(g), op, after);
  EPX_CHECK_LAUNCH("barrier_kernel");
}

__global__ void zero_copy_mailboxes_kernel(WindowLayout L, int rank, int R, char* const* peer_window, char** out) {
  for (int p = threadIdx.x; p < R; p += blockDim.x) {
    out[p] = peer_window[p] + L.row_offset(rank, 0);
    out[R + p] = peer_window[p] + L.meta_offset(rank, 0);
    out[2 * R + p] = peer_window[p] + L.header_offset(rank);
  }
}

class BarrierLink final : public Link {
 public:
  bool device_barriers() const override { return true; }
  int64_t row_stride(const DeviceGroup& g, int64_t) const override { return static_cast<int64_t>(g.layout.row_bytes); }
  // Large sums go through the rows regions (small ones stay in one launch on the reduce region).
  size_t reduce_chunk_bytes(const DeviceGroup& g) const override {
    return static_cast<size_t>(g.layout.max_tokens) * g.layout.row_bytes;
  }
  void before_write(const DeviceGroup& g, int op_code, cudaStream_t stream) override {
    barrier(g, op_code, stream, BarrierAfter::kBeforeWrite);
  }
  void deliver(const DeviceGroup& g, const Delivery& d, cudaStream_t stream) override {
    barrier(g, d.op_code, stream, BarrierAfter::kAfterWrites);
  }
};

// Received rows of source s occupy items [prefix[s], prefix[s+1]); maps an item to (s, slot).
__device__ __forceinline__ void item_source(const int32_t* prefix, int R, int64_t item, int& s, int& slot) {
  s = 0;
  while (s + 1 < R && item >= prefix[s + 1]) ++s;
  slot = static_cast<int>(item - prefix[s]);
}

__device__ __forceinline__ void load_prefix(const int32_t* recv_tokens, int R, int32_t* prefix) {
  if (threadIdx.x == 0) {
    int32_t acc = 0;
    for (int s = 0; s < R; ++s) {
      prefix[s] = acc;
      acc += recv_tokens[s];
    }
    prefix[R] = acc;
  }
  __syncthreads();
}

// ---- prepare: count exchange ------------------------------------------------------------------

struct ExchangeArgs {
  DeviceGroup g;
  int K;
  const int32_t* counts;       // [E]
  const int32_t* send_tokens;  // [R]
  int32_t* recv_pairs;         // [R, Le]
  int32_t* recv_tokens;        // [R]
  int32_t* expert_rows;        // [Le]
  int32_t* expert_offsets;     // [Le + 1]
  int32_t* segment_starts;     // [Le, R]
  int32_t* handle_status;      // [4]
};

constexpr int kWriteHeaders = 1, kReadHeaders = 2;

// phases: kWriteHeaders (every peer's header: counts per local expert of that peer, token rows, K),
// kReadHeaders (the receive side from the headers that arrived). With device barriers (zero-copy)
// both phases run in one launch around the barriers; the staged transport launches them apart,
// with the NCCL delivery in between.
__global__ void __launch_bounds__(1024) exchange_kernel(ExchangeArgs a, int phases, bool barriers, bool two_copies) {
  // One block: the next grid (the dispatch) may take the other SMs now and wait there for it.
  cuda::wait_for_previous_grid();
  cuda::allow_next_grid();
  const DeviceGroup& g = a.g;
  const int Le = g.Le, R = g.R, hw = Le + 2;
  // With device barriers (zero-copy) the headers alternate between two copies by the parity of the
  // group's prepares (WindowLayout::header_offset), so no peer can still be reading the copy this
  // prepare writes: the one delivery barrier orders everything.
  // (two_copies false, EPX_PREPARE_HEADERS=one: one copy, written after a before-write barrier.)
  __shared__ int parity_s;
  if (threadIdx.x == 0) parity_s = barriers && two_copies ? static_cast<int>(*prepare_count(g) & 1u) : 0;
  __syncthreads();
  const int parity = parity_s;
  if (phases & kWriteHeaders) {
    if (barriers && !two_copies) group_barrier(signal_of(g), kOpPrepare, BarrierAfter::kBeforeWrite);
    for (int i = threadIdx.x; i < R * hw; i += blockDim.x) {
      const int d = i / hw, j = i % hw;
      int32_t* hdr = barriers ? reinterpret_cast<int32_t*>(g.peer_window[d] + g.layout.header_offset(g.rank, parity))
                              : out_header(g, d);
      hdr[j] = j < Le ? a.counts[d * Le + j] : (j == Le ? a.send_tokens[d] : a.K);
    }
  }
  if (!(phases & kReadHeaders)) return;
  if (barriers) group_barrier(signal_of(g), kOpPrepare, BarrierAfter::kAfterBlockWrites);
  if (barriers && two_copies && threadIdx.x == 0) *prepare_count(g) += 1u;  // read above by thread 0 only
  for (int i = threadIdx.x; i < R * Le; i += blockDim.x) {
    const int s = i / Le, j = i % Le;
    a.recv_pairs[i] = reinterpret_cast<const int32_t*>(g.my_window + g.layout.header_offset(s, parity))[j];
  }
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    const int32_t* hdr = reinterpret_cast<const int32_t*>(g.my_window + g.layout.header_offset(s, parity));
    a.recv_tokens[s] = hdr[Le];
    if (hdr[Le + 1] != a.K && atomicCAS(reinterpret_cast<uint32_t*>(&g.status[3]), 0u, 3u) == 0u) {
      g.status[1] = s;           // the rank that disagrees
      g.status[2] = hdr[Le + 1]; // its top-k
      g.status[4] = a.K;         // ours
    }
  }
  __syncthreads();
  // Rows per local expert, padded offsets, and where each source's run starts in a segment.
  __shared__ int32_t scan[1024];
  int64_t carry = 0;
  for (int base = 0; base < Le; base += blockDim.x) {
    const int j = base + threadIdx.x;
    int32_t rows = 0;
    if (j < Le)
      for (int s = 0; s < R; ++s) rows += a.recv_pairs[s * Le + j];
    const int32_t padded = static_cast<int32_t>((static_cast<int64_t>(rows) + g.align - 1) / g.align * g.align);
    scan[threadIdx.x] = padded;
    __syncthreads();
    for (int st = 1; st < blockDim.x; st <<= 1) {
      const int32_t v = threadIdx.x >= st ? scan[threadIdx.x - st] : 0;
      __syncthreads();
      scan[threadIdx.x] += v;
      __syncthreads();
    }
    if (j < Le) {
      const int32_t off = static_cast<int32_t>(carry + scan[threadIdx.x] - padded);
      a.expert_rows[j] = rows;
      a.expert_offsets[j] = off;
      int32_t at = off;
      for (int s = 0; s < R; ++s) {
        a.segment_starts[j * R + s] = at;
        at += a.recv_pairs[s * Le + j];
      }
    }
    carry += scan[blockDim.x - 1];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    a.expert_offsets[Le] = static_cast<int32_t>(carry);
    const int32_t over = carry > g.recv_capacity ? static_cast<int32_t>(carry - g.recv_capacity) : 0;
    a.handle_status[0] = over;
    if (over > g.status[0]) g.status[0] = over;
  }
}

// ---- dispatch --------------------------------------------------------------------------------

template <class V, int W>
__global__ void __launch_bounds__(W * 32) send_rows_kernel(SendArgs a) {
  __shared__ int32_t slot_s[W][kMaxR];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const DeviceGroup& g = a.g;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * W;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * W + warp; t < a.T; t += nw) {
    for (int d = lane; d < g.R; d += 32) slot_s[warp][d] = a.token_slot[t * g.R + d];
    __syncwarp();
    send_token<V>(a, t, lane, slot_s[warp]);
  }
}

template <class V, int W>
__global__ void __launch_bounds__(W * 32) expand_rows_kernel(ExpandArgs a) {
  __shared__ int32_t prefix[kMaxR + 1];
  __shared__ int32_t rows_s[W][kMaxK];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const DeviceGroup& g = a.g;
  if (static_cast<int64_t>(a.offsets[g.Le]) > g.recv_capacity) return;  // overflow: nothing written
  load_prefix(a.recv_tokens, g.R, prefix);
  const int64_t received = prefix[g.R], items = received + g.Le;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * W;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * W + warp; it < items; it += nw) {
    if (it >= received) {
      zero_padding_rows<V>(a, static_cast<int>(it - received), lane);
      continue;
    }
    int s, slot;
    item_source(prefix, g.R, it, s, slot);
    expand_received_slot<V>(a, s, slot, lane, rows_s[warp], false);
  }
}

// Expert side: one partial row per received (source, token), into the source's window.
template <class T, int N, int W>
__global__ void __launch_bounds__(W * 32) reduce_send_kernel(ReduceArgs a) {
  __shared__ int32_t prefix[kMaxR + 1];
  __shared__ int32_t rows_s[W][kMaxK];
  __shared__ float w_s[W][kMaxK];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const DeviceGroup& g = a.g;
  load_prefix(a.recv_tokens, g.R, prefix);
  const int64_t items = prefix[g.R];
  const int64_t nw = static_cast<int64_t>(gridDim.x) * W;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * W + warp; it < items; it += nw) {
    int s, slot;
    item_source(prefix, g.R, it, s, slot);
    reduce_partial<T, N>(a, s, slot, lane, rows_s[warp], w_s[warp], VecRange{0, a.H / N});
  }
}

// Source side: out[t] = sum over ranks ascending of the partials that came back.
template <class T, int N, int W>
__global__ void __launch_bounds__(W * 32) sum_partials_kernel(ReduceArgs a) {
  __shared__ int32_t slot_s[W][kMaxR];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * W;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * W + warp; t < a.T; t += nw) {
    for (int d = lane; d < a.g.R; d += 32) slot_s[warp][d] = a.token_slot[t * a.g.R + d];
    __syncwarp();
    sum_partials<T, N>(a, t, lane, slot_s[warp], false, VecRange{0, a.H / N});
  }
}

// ---- combine_backward: spread the received d_out rows -----------------------------------------

struct SpreadArgs {
  DeviceGroup g;
  int K;
  int64_t H;
  const int32_t* recv_tokens;
  const int32_t* recv_row;
  const int32_t* offsets;
  const int32_t* expert_rows;
  const void* y;               // read only with d_row_weights
  const float* row_weights;    // or null
  void* d_y;
  float* d_row_weights;        // or null
  int64_t stride;              // bytes per received slot
};

template <class T, int N, int KMAX, int G, int W>
__global__ void __launch_bounds__(W * 32) spread_kernel(SpreadArgs a) {
  __shared__ int32_t prefix[kMaxR + 1];
  __shared__ int32_t rows_s[W][kMaxK];
  __shared__ float w_s[W][kMaxK];
  using P = Pack<T, N>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const DeviceGroup& g = a.g;
  load_prefix(a.recv_tokens, g.R, prefix);
  const int64_t received = prefix[g.R], items = received + g.Le, nvec = a.H / N;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * W;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * W + warp; it < items; it += nw) {
    if (it >= received) {
      const int j = static_cast<int>(it - received);
      for (int64_t r = a.offsets[j] + a.expert_rows[j]; r < a.offsets[j + 1]; ++r) {
        P* d = static_cast<P*>(a.d_y) + r * nvec;
        for (int64_t v = lane; v < nvec; v += 32) d[v] = P{};
        if (lane == 0 && a.d_row_weights) a.d_row_weights[r] = 0.0f;
      }
      continue;
    }
    int s, slot;
    item_source(prefix, g.R, it, s, slot);
    int32_t row = -1;
    float w = 1.0f;
    if (lane < a.K) {
      row = a.recv_row[(static_cast<int64_t>(s) * g.max_tokens + slot) * a.K + lane];
      if (row >= 0 && a.row_weights) w = a.row_weights[row];
    }
    // The slot's rows that live here, compacted in slot order.
    const int n = cuda::compact_rows(row, w, a.K, lane, rows_s[warp], w_s[warp]);
    float dot[KMAX];
#pragma unroll
    for (int k = 0; k < KMAX; ++k) dot[k] = 0.0f;
    cuda::spread_row<KMAX, G>(reinterpret_cast<const P*>(in_row(g, s, slot, a.stride)), nvec, rows_s[warp], w_s[warp],
                              n, a.row_weights != nullptr, static_cast<P*>(a.d_y),
                              a.d_row_weights ? static_cast<const P*>(a.y) : nullptr, dot, lane);
    if (a.d_row_weights) cuda::store_row_dots<KMAX>(dot, n, rows_s[warp], a.d_row_weights, lane);
    __syncwarp();
  }
}

// ---- all-reduce ------------------------------------------------------------------------------

template <class F>
__global__ void all_reduce_kernel(DeviceGroup g, F* buf, int64_t begin, int64_t n) {
  const SignalArgs sig = signal_of(g);
  group_barrier(sig, kOpReduce, BarrierAfter::kBeforeWrite);
  for (int d = 0; d < g.R; ++d) {
    F* dst = reinterpret_cast<F*>(g.peer_window[d] + g.layout.reduce_offset(g.rank));
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = buf[begin + i];
  }
  group_barrier(sig, kOpReduce, BarrierAfter::kAfterBlockWrites);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    F acc = 0;
    for (int s = 0; s < g.R; ++s) acc += reinterpret_cast<const F*>(g.my_window + g.layout.reduce_offset(s))[i];
    buf[begin + i] = acc;
  }
}

// Zero-copy, a buffer larger than the reduce region: this rank's chunk into its rows region of
// every peer's window (where the staged exchange delivers it too), 16 bytes at a time where aligned.
template <bool kVec>
__global__ void send_chunk_kernel(DeviceGroup g, const char* chunk, int64_t bytes) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int d = 0; d < g.R; ++d) {
    if (d == g.rank) continue;
    char* dst = g.peer_window[d] + g.layout.row_offset(g.rank, 0);
    int64_t done = 0;
    if (kVec) {
      done = bytes / 16 * 16;
      for (int64_t i = first; i < bytes / 16; i += step)
        reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(chunk)[i];
    }
    for (int64_t i = done + first; i < bytes; i += step) dst[i] = chunk[i];
  }
}

// Staged, and zero-copy past the reduce region: the chunk of every peer sits at the start of its
// rows region of the receive area (the window); this rank's own chunk is still in the buffer. Same
// order as above: acc = 0, + rank 0, 1, ...
template <class F>
__global__ void sum_chunks_kernel(DeviceGroup g, F* buf, int64_t begin, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    F acc = 0;
    for (int s = 0; s < g.R; ++s)
      acc += s == g.rank ? buf[begin + i] : reinterpret_cast<const F*>(in_row(g, s, 0, 0))[i];
    buf[begin + i] = acc;
  }
}

// ---- launch helpers ----------------------------------------------------------------------------

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Staged exact sizes: the host copy of a per-peer count, or null (whole regions).
const int32_t* counts_or_null(const std::vector<int32_t>& v) { return v.empty() ? nullptr : v.data(); }

// The phased kernels' warps per block: kWarps without an SM budget (several blocks per SM); under one
// the grid is capped at the budget's block count, so each block takes kBudget warps instead, for
// more rows in flight on each budgeted SM.
template <int kBudget = kBudgetPhasedWarps, class F>
void with_phased_warps(const DeviceGroup& g, F&& f) {
  if (g.sm_budget > 0) f(std::integral_constant<int, kBudget>{});
  else f(std::integral_constant<int, kWarps>{});
}

int grid_for(int64_t items, int cap_blocks) {
  const int64_t want = (items + kWarps - 1) / kWarps;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, cap_blocks)));
}

// The phased receive side (expansion into the expert-major rows, spreading of d_out): a warp per
// (source, slot) of the receive area plus one per local expert's padding, over every SM (or the
// group's SM budget).
int receive_grid(const DeviceGroup& g) {
  return grid_for(static_cast<int64_t>(g.R) * g.max_tokens + g.Le, budget_blocks(g, cuda::sm_count() * 8));
}

// The phased send phase of dispatch and combine_backward: one warp per token on the link blocks.
void launch_send_rows(const SendArgs& sa, int64_t tokens, bool vec, cudaStream_t s) {
  const int grid = grid_for(tokens, sa.g.send_blocks);
  with_phased_warps(sa.g, [&](auto w) {
    constexpr int W = decltype(w)::value;
    if (vec) send_rows_kernel<uint4, W><<<grid, W * 32, 0, s>>>(sa);
    else send_rows_kernel<uint8_t, W><<<grid, W * 32, 0, s>>>(sa);
  });
  EPX_CHECK_LAUNCH("send_rows_kernel");
}

template <class F>
void with_element(DType dt, F&& f) {
  switch (dt) {
    case DType::kF32: f(float{}); break;
    case DType::kBF16: f(__nv_bfloat16{}); break;
    case DType::kF16: f(__half{}); break;
    default:
      throw Error(Status::kNotSupported,
                  detail::concat("epx: the CUDA combine supports fp32, bf16 and fp16 rows, not ", dtype_name(dt)));
  }
}

void check_limits(const DeviceGroup& g, int K, const char* fn) {
  require_status(K <= kMaxK, Status::kNotSupported, fn, "top-k is ", K, "; the CUDA EP kernels support up to ", kMaxK);
  require_status(g.R <= kMaxR, Status::kNotSupported, fn, "the group has ", g.R, " ranks; the CUDA EP kernels support up to ",
                 kMaxR);
}

}  // namespace

Link& barrier_link() {
  static BarrierLink link;
  return link;
}

void build_zero_copy_mailboxes(const WindowLayout& layout, int rank, int num_ranks, char* const* peer_window,
                               char** out, cudaStream_t stream) {
  zero_copy_mailboxes_kernel<<<1, 64, 0, stream>>>(layout, rank, num_ranks, peer_window, out);
  EPX_CHECK_LAUNCH("zero_copy_mailboxes_kernel");
}

void exchange_counts(const DeviceGroup& g, Link& link, HandleState& h, int32_t* segment_starts, Stream stream) {
  check_limits(g, h.topk, "epx::prepare");
  require_status(g.Le <= 1024 * 64, Status::kNotSupported, "epx::prepare", "too many local experts: ", g.Le);
  ExchangeArgs a{g,
                 h.topk,
                 h.routed_counts.ptr<int32_t>(),
                 h.send_tokens.ptr<int32_t>(),
                 h.recv_pairs.ptr<int32_t>(),
                 h.recv_tokens.ptr<int32_t>(),
                 h.expert_rows.ptr<int32_t>(),
                 h.expert_offsets.ptr<int32_t>(),
                 segment_starts,
                 h.status.ptr<int32_t>()};
  cudaStream_t s = cuda::to_cuda(stream);
  if (link.device_barriers()) {  // one launch, the barriers inside
    static const bool two = zero_copy_protocol().two_header_copies;
    cuda::launch_after_previous("launch of exchange_kernel", exchange_kernel, 1, 1024, 0, s, a,
                                kWriteHeaders | kReadHeaders, true, two);
    return;
  }
  link.before_write(g, kOpPrepare, s);
  exchange_kernel<<<1, 1024, 0, s>>>(a, kWriteHeaders, false, false);
  EPX_CHECK_LAUNCH("exchange_kernel (write)");
  Delivery d;
  d.op_code = kOpPrepare;
  d.header = true;
  link.deliver(g, d, s);
  exchange_kernel<<<1, 1024, 0, s>>>(a, kReadHeaders, false, false);
  EPX_CHECK_LAUNCH("exchange_kernel (read)");
}

ZeroCopyProtocol zero_copy_protocol() {
  ZeroCopyProtocol p;
  p.inline_barrier = ep_device::inline_barrier_enabled();
  // EPX_PREPARE_HEADERS=two|one (read once): the header copies prepares alternate between.
  static const bool two = ::epx::detail::env_choice("EPX_PREPARE_HEADERS", {"two", "one"}) != 1;
  p.two_header_copies = two;
  return p;
}

void dispatch_rows(const DeviceGroup& g, Link& link, HandleState& h, const int32_t* segment_starts, const TensorRef& x,
                   const TensorRef& x_scales, const TensorRef& topk_weights, const TensorRef& recv_x,
                   const TensorRef& recv_scales, const TensorRef& recv_weights, Stream stream, int op_code) {
  check_limits(g, h.topk, op_code == kOpCombineBwd ? "epx::combine_backward" : "epx::dispatch_forward");
  cudaStream_t s = cuda::to_cuda(stream);
  SendArgs sa;
  sa.g = g;
  sa.T = h.num_tokens;
  sa.K = h.topk;
  sa.routed = h.routed_experts.ptr<int32_t>();
  sa.pair_pos = h.pair_pos.ptr<int32_t>();
  sa.token_slot = h.token_slot.ptr<int32_t>();
  sa.rows = static_cast<const char*>(x.data());
  sa.row_bytes = x.size(1) * static_cast<int64_t>(dtype_size(x.dtype()));
  sa.scales = x_scales.defined() ? static_cast<const char*>(x_scales.data()) : nullptr;
  sa.scale_bytes = x_scales.defined() ? x_scales.size(1) * static_cast<int64_t>(dtype_size(x_scales.dtype())) : 0;
  sa.weights = topk_weights.defined() ? topk_weights.ptr<float>() : nullptr;
  sa.with_meta = true;
  sa.op_code = op_code;
  sa.stride = link.row_stride(g, sa.row_bytes + sa.scale_bytes);
  const bool vec = sa.row_bytes % 16 == 0 && aligned16(sa.rows) && sa.stride % 16 == 0;
  ExpandArgs ea;
  ea.g = g;
  ea.K = h.topk;
  ea.recv_tokens = h.recv_tokens.ptr<int32_t>();
  ea.segment_starts = segment_starts;
  ea.offsets = h.expert_offsets.ptr<int32_t>();
  ea.expert_rows = h.expert_rows.ptr<int32_t>();
  ea.recv_row = h.recv_row.ptr<int32_t>();
  ea.out = static_cast<char*>(recv_x.data());
  ea.row_bytes = sa.row_bytes;
  ea.out_scales = recv_scales.defined() ? static_cast<char*>(recv_scales.data()) : nullptr;
  ea.scale_bytes = sa.scale_bytes;
  ea.out_weights = recv_weights.defined() ? recv_weights.ptr<float>() : nullptr;
  ea.stride = sa.stride;
  // Zero-copy: send and expand in one launch, the expansion overlapping the transfer, and (unless
  // EPX_EP_BARRIER=launch) the opening barrier in that launch too.
  const bool overlapped = link.device_barriers() && overlapped_dispatch_enabled();
  const bool vec_out = vec && aligned16(ea.out);
  if (overlapped && inline_barrier_enabled() && launch_overlapped_dispatch(sa, ea, vec_out, true, s)) return;
  link.before_write(g, op_code, s);
  if (overlapped && launch_overlapped_dispatch(sa, ea, vec_out, false, s)) return;
  launch_send_rows(sa, h.num_tokens, vec, s);
  Delivery d;
  d.op_code = op_code;
  d.row_stride = sa.stride;
  d.meta = true;
  d.send_slots = counts_or_null(h.host_send_tokens);
  d.recv_slots = counts_or_null(h.host_recv_tokens);
  link.deliver(g, d, s);
  const int expand_grid = receive_grid(g);
  with_phased_warps(g, [&](auto w) {
    constexpr int W = decltype(w)::value;
    if (vec_out) expand_rows_kernel<uint4, W><<<expand_grid, W * 32, 0, s>>>(ea);
    else expand_rows_kernel<uint8_t, W><<<expand_grid, W * 32, 0, s>>>(ea);
  });
  EPX_CHECK_LAUNCH("expand_rows_kernel");
}

void reduce_rows(const DeviceGroup& g, Link& link, const HandleState& h, int op_code, const TensorRef& rows_in,
                 const TensorRef& row_weights, const TensorRef& d_row_scalars, const TensorRef& out,
                 const TensorRef& d_topk_weights, Stream stream) {
  check_limits(g, h.topk, op_code == kOpCombine ? "epx::combine_forward" : "epx::dispatch_backward");
  cudaStream_t s = cuda::to_cuda(stream);
  ReduceArgs a;
  a.g = g;
  a.T = h.num_tokens;
  a.K = h.topk;
  a.H = rows_in.size(1);
  a.recv_tokens = h.recv_tokens.ptr<int32_t>();
  a.recv_row = h.recv_row.ptr<int32_t>();
  a.rows_in = rows_in.data();
  a.row_weights = row_weights.defined() ? row_weights.ptr<float>() : nullptr;
  a.row_scalars = d_row_scalars.defined() ? d_row_scalars.ptr<float>() : nullptr;
  a.token_slot = h.token_slot.ptr<int32_t>();
  a.routed = h.routed_experts.ptr<int32_t>();
  a.out = out.data();
  a.d_topk_weights = d_topk_weights.defined() ? d_topk_weights.ptr<float>() : nullptr;
  a.stride = link.row_stride(g, a.H * static_cast<int64_t>(dtype_size(rows_in.dtype())));
  a.send_tokens = h.send_tokens.ptr<int32_t>();
  a.op_code = op_code;
  with_element(rows_in.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = 16 / sizeof(T);
    const bool vec = a.H % N == 0 && aligned16(a.rows_in) && aligned16(a.out) && a.stride % 16 == 0;
    // Zero-copy: partials and sums in one launch, the sums overlapping the transfer, and (unless
    // EPX_EP_BARRIER=launch) the opening barrier in that launch too.
    const bool overlapped = link.device_barriers() && overlapped_combine_enabled();
    if (overlapped && inline_barrier_enabled() && launch_overlapped_combine(a, rows_in.dtype(), vec, true, s)) return;
    link.before_write(g, op_code, s);
    if (overlapped && launch_overlapped_combine(a, rows_in.dtype(), vec, false, s)) return;
    // The expert-side reduction reads K rows per partial from HBM: it gets every SM (the link
    // traffic it issues is one row per partial).
    const int reduce_grid = grid_for(static_cast<int64_t>(g.R) * g.max_tokens, budget_blocks(g, cuda::sm_count() * 4));
    with_phased_warps(g, [&](auto w) {
      constexpr int W = decltype(w)::value;
      if (vec) reduce_send_kernel<T, N, W><<<reduce_grid, W * 32, 0, s>>>(a);
      else reduce_send_kernel<T, 1, W><<<reduce_grid, W * 32, 0, s>>>(a);
    });
    EPX_CHECK_LAUNCH("reduce_send_kernel");
    Delivery d;
    d.op_code = op_code;
    d.row_stride = a.stride;
    d.meta = a.row_scalars != nullptr || a.d_topk_weights != nullptr;  // row-weight gradients travel back
    // The partials go back: as many to each peer as rows came from it.
    d.send_slots = counts_or_null(h.host_recv_tokens);
    d.recv_slots = counts_or_null(h.host_send_tokens);
    link.deliver(g, d, s);
    const int sum_grid = grid_for(a.T, budget_blocks(g, cuda::sm_count() * 8));
    with_phased_warps(g, [&](auto w) {
      constexpr int W = decltype(w)::value;
      if (vec) sum_partials_kernel<T, N, W><<<sum_grid, W * 32, 0, s>>>(a);
      else sum_partials_kernel<T, 1, W><<<sum_grid, W * 32, 0, s>>>(a);
    });
    EPX_CHECK_LAUNCH("sum_partials_kernel");
  });
}

void spread_rows(const DeviceGroup& g, Link& link, const HandleState& h, const TensorRef& d_out, const TensorRef& y,
                 const TensorRef& row_weights, const TensorRef& d_y, const TensorRef& d_row_weights, Stream stream) {
  check_limits(g, h.topk, "epx::combine_backward");
  cudaStream_t s = cuda::to_cuda(stream);
  SendArgs sa;
  sa.g = g;
  sa.T = h.num_tokens;
  sa.K = h.topk;
  sa.routed = h.routed_experts.ptr<int32_t>();
  sa.pair_pos = h.pair_pos.ptr<int32_t>();
  sa.token_slot = h.token_slot.ptr<int32_t>();
  sa.rows = static_cast<const char*>(d_out.data());
  sa.row_bytes = d_out.size(1) * static_cast<int64_t>(dtype_size(d_out.dtype()));
  sa.scales = nullptr;
  sa.scale_bytes = 0;
  sa.weights = nullptr;
  sa.with_meta = false;
  sa.op_code = kOpCombineBwd;
  sa.stride = link.row_stride(g, sa.row_bytes);
  SpreadArgs pa;
  pa.g = g;
  pa.K = h.topk;
  pa.H = d_out.size(1);
  pa.recv_tokens = h.recv_tokens.ptr<int32_t>();
  pa.recv_row = h.recv_row.ptr<int32_t>();
  pa.offsets = h.expert_offsets.ptr<int32_t>();
  pa.expert_rows = h.expert_rows.ptr<int32_t>();
  pa.y = d_row_weights.defined() ? y.data() : nullptr;
  pa.row_weights = row_weights.defined() ? row_weights.ptr<float>() : nullptr;
  pa.d_y = d_y.data();
  pa.d_row_weights = d_row_weights.defined() ? d_row_weights.ptr<float>() : nullptr;
  pa.stride = sa.stride;
  with_element(d_out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = 16 / sizeof(T);
    const bool vec = pa.H % N == 0 && aligned16(sa.rows) && aligned16(pa.d_y) && (!pa.y || aligned16(pa.y)) &&
                     sa.stride % 16 == 0;
    link.before_write(g, kOpCombineBwd, s);
    launch_send_rows(sa, h.num_tokens, vec, s);
    Delivery d;
    d.op_code = kOpCombineBwd;
    d.row_stride = sa.stride;
    d.send_slots = counts_or_null(h.host_send_tokens);
    d.recv_slots = counts_or_null(h.host_recv_tokens);
    link.deliver(g, d, s);
    const int grid = receive_grid(g);
    auto launch_g = [&](auto kmax, auto group) {
      constexpr int KM = decltype(kmax)::value, G = decltype(group)::value;
      with_phased_warps<kBudgetSpreadWarps>(g, [&](auto w) {
        constexpr int W = decltype(w)::value;
        if (vec) spread_kernel<T, N, KM, G, W><<<grid, W * 32, 0, s>>>(pa);
        else spread_kernel<T, 1, KM, G, W><<<grid, W * 32, 0, s>>>(pa);
      });
    };
    // Where K <= 8 and the spread has every SM, all 8 y rows load before the stores (2 x H200, T=4096,
    // H=7168: combine_backward 491-493 us against 499-503 with 4, T=128 56-57 against 65); under an
    // SM budget 4 (32 SMs: 762-763 us with 8 against 742).
    auto launch = [&](auto kmax) {
      constexpr int KM = decltype(kmax)::value;
      if (KM == 8 && cuda::spread_y_rows_k8(g.sm_budget > 0 ? 4 : 8) == 8)
        launch_g(kmax, std::integral_constant<int, 8>{});
      else
        launch_g(kmax, std::integral_constant<int, cuda::spread_group<KM>()>{});
    };
    if (h.topk <= 8) launch(std::integral_constant<int, 8>{});
    else if (h.topk <= 16) launch(std::integral_constant<int, 16>{});
    else launch(std::integral_constant<int, 32>{});
    EPX_CHECK_LAUNCH("spread_kernel");
  });
}

void all_reduce(const DeviceGroup& g, Link& link, const TensorRef& buffer, Stream stream) {
  cudaStream_t s = cuda::to_cuda(stream);
  const size_t es = dtype_size(buffer.dtype());
  const bool f64 = buffer.dtype() == DType::kF64;
  // Zero-copy, up to the reduce region (the router statistics): one launch, the barriers inside.
  if (link.device_barriers() && static_cast<size_t>(buffer.numel()) * es <= WindowLayout::kReduceBytes) {
    if (f64) all_reduce_kernel<double><<<1, 512, 0, s>>>(g, buffer.ptr<double>(), 0, buffer.numel());
    else all_reduce_kernel<float><<<1, 512, 0, s>>>(g, buffer.ptr<float>(), 0, buffer.numel());
    EPX_CHECK_LAUNCH("all_reduce_kernel");
    return;
  }
  // Larger (gradients): rows-region-sized chunks, written by every SM the budget allows.
  const int64_t chunk = static_cast<int64_t>(link.reduce_chunk_bytes(g) / es);
  const int64_t rounds = std::max<int64_t>(1, (buffer.numel() + chunk - 1) / chunk);
  for (int64_t r = 0; r < rounds; ++r) {
    const int64_t begin = r * chunk, n = std::max<int64_t>(0, std::min<int64_t>(chunk, buffer.numel() - begin));
    const char* bytes = static_cast<const char*>(buffer.data()) + begin * static_cast<int64_t>(es);
    link.before_write(g, kOpReduce, s);
    if (link.device_barriers() && n > 0) {
      const int64_t nb = n * static_cast<int64_t>(es);
      const int grid =
          static_cast<int>(std::min<int64_t>((nb / 16 + 255) / 256 + 1, budget_blocks(g, cuda::sm_count() * 4)));
      if (aligned16(bytes)) send_chunk_kernel<true><<<grid, 256, 0, s>>>(g, bytes, nb);
      else send_chunk_kernel<false><<<grid, 256, 0, s>>>(g, bytes, nb);
      EPX_CHECK_LAUNCH("send_chunk_kernel");
    }
    Delivery d;
    d.op_code = kOpReduce;
    d.chunk = bytes;
    d.chunk_bytes = static_cast<size_t>(n) * es;
    link.deliver(g, d, s);
    if (n == 0) continue;
    const int grid = static_cast<int>(std::min<int64_t>((n + 255) / 256, budget_blocks(g, cuda::sm_count() * 4)));
    if (f64) sum_chunks_kernel<double><<<grid, 256, 0, s>>>(g, buffer.ptr<double>(), begin, n);
    else sum_chunks_kernel<float><<<grid, 256, 0, s>>>(g, buffer.ptr<float>(), begin, n);
    EPX_CHECK_LAUNCH("sum_chunks_kernel");
  }
}

}  // namespace epx::comm
