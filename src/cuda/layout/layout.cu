// Launchers of the device-side prepare (kernels and their invariants: layout_kernels.cuh).
//
// Default: one launch of layout_kernel (two for drop by probability, around the ranking kernels).
// EPX_LAYOUT_KERNEL=legacy (read once) selects the earlier three-launch path, kept so that a GPU
// run can compare the two; both give the same bits.
#include "cuda/layout/layout.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/env_choice.h"
#include "cuda/common/cuda_check.h"
#include "cuda/layout/layout_kernels.cuh"

namespace epx::cuda {
namespace {

// Where each array of a handle sits inside its block; sizes come from the group's maxima only, so
// every handle of a group has the same layout and blocks can be pooled.
struct Carve {
  size_t offset = 0;
  template <class T>
  size_t take(size_t n) {
    const size_t at = (offset + 255) / 256 * 256;
    offset = at + n * sizeof(T);
    return at;
  }
};

struct HandleLayout {
  size_t routed, pair_pos, token_slot, send_tokens, counts, recv_pairs, recv_tokens, expert_rows, expert_offsets,
      recv_row, status;
  size_t local_rank, block_hist, block_tok, masked_ids, pair_list, segment_starts, block_bad, sync;
  size_t total;
};

HandleLayout handle_layout(int max_tokens, int max_topk, int E, int R) {
  const size_t TK = static_cast<size_t>(max_tokens) * max_topk;
  const int Le = E / R;
  Carve c;
  HandleLayout L;
  L.routed = c.take<int32_t>(TK);
  L.pair_pos = c.take<int32_t>(TK);
  L.token_slot = c.take<int32_t>(static_cast<size_t>(max_tokens) * R);
  L.send_tokens = c.take<int32_t>(R);
  L.counts = c.take<int32_t>(E);
  L.recv_pairs = c.take<int32_t>(static_cast<size_t>(R) * Le);
  L.recv_tokens = c.take<int32_t>(R);
  L.expert_rows = c.take<int32_t>(Le);
  L.expert_offsets = c.take<int32_t>(Le + 1);
  L.recv_row = c.take<int32_t>(static_cast<size_t>(R) * TK);
  L.status = c.take<int32_t>(4);
  L.local_rank = c.take<int32_t>(TK);
  L.block_hist = c.take<int32_t>(static_cast<size_t>(layout::kMaxLayoutBlocks) * E);
  L.block_tok = c.take<int32_t>(static_cast<size_t>(layout::kMaxLayoutBlocks) * R);
  L.masked_ids = c.take<int32_t>(TK);
  L.pair_list = c.take<int32_t>(TK);
  L.segment_starts = c.take<int32_t>(static_cast<size_t>(Le) * R);
  L.block_bad = c.take<int32_t>(layout::kMaxLayoutBlocks);
  L.sync = c.take<unsigned long long>(1 + 2 * static_cast<size_t>(layout::kMaxLayoutBlocks));
  L.total = (c.offset + 255) / 256 * 256;
  return L;
}

HandleLayout layout_of(const HandleState& h) { return handle_layout(h.max_tokens, h.max_topk, h.num_experts, h.num_ranks); }

template <class T>
T* at(void* base, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}

// Tokens per block: at most kMaxLayoutBlocks chunks, each a whole number of warps.
int chunk_for(int T) {
  const int per = (T + layout::kMaxLayoutBlocks - 1) / layout::kMaxLayoutBlocks;
  return std::max(32, (per + 31) / 32 * 32);
}

std::atomic<int> g_kernel{-1};  // -1: not resolved yet, else a LayoutKernel

LayoutKernel resolve_kernel() {
  int k = g_kernel.load(std::memory_order_relaxed);
  if (k < 0) {
    const int i = ::epx::detail::env_choice("EPX_LAYOUT_KERNEL", {"fused", "legacy"});
    int want = static_cast<int>(i == 1 ? LayoutKernel::kLegacy : LayoutKernel::kFused);
    int expected = -1;
    g_kernel.compare_exchange_strong(expected, want);
    k = g_kernel.load(std::memory_order_relaxed);
    if (const char* dbg = std::getenv("EPX_DEBUG"); dbg != nullptr && std::strcmp(dbg, "0") != 0)
      std::fprintf(stderr, "epx: prepare layout kernel: %s\n", k == static_cast<int>(LayoutKernel::kLegacy) ? "legacy" : "fused");
  }
  return static_cast<LayoutKernel>(k);
}

void run_fused(layout::Params p, int pass, cudaStream_t stream) {
  p.pass = pass;
  const int blocks = std::max(1, (p.T + p.chunk - 1) / p.chunk);
  const size_t smem = layout::layout_smem_bytes(p.E, p.R, p.chunk);
  if (smem > 48 * 1024)
    EPX_CUDA_CHECK(cudaFuncSetAttribute(layout::layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  cuda::launch_after_previous("launch of layout_kernel", layout::layout_kernel, blocks, layout::kLayoutThreads, smem,
                              stream, p);
}

void run_passes(layout::Params p, bool finalize_tokens, cudaStream_t stream) {
  const int blocks = std::max(1, (p.T + p.chunk - 1) / p.chunk);
  const size_t smem1 = static_cast<size_t>(p.E) * (layout::kWarps + 1) * sizeof(int32_t);
  layout::pair_count_kernel<<<blocks, layout::kThreads, smem1, stream>>>(p);
  EPX_CHECK_LAUNCH("pair_count_kernel");
  const size_t smem2 = static_cast<size_t>(p.E + layout::kWarps * p.R + p.R) * sizeof(int32_t);
  layout::pair_finalize_kernel<<<blocks, layout::kThreads, smem2, stream>>>(p);
  EPX_CHECK_LAUNCH("pair_finalize_kernel");
  if (!finalize_tokens) return;
  layout::token_finalize_kernel<<<blocks, layout::kThreads, 0, stream>>>(p);
  EPX_CHECK_LAUNCH("token_finalize_kernel");
}

}  // namespace

void set_layout_kernel(LayoutKernel k) { g_kernel.store(static_cast<int>(k), std::memory_order_relaxed); }

LayoutKernel layout_kernel_in_use() { return resolve_kernel(); }

int32_t* handle_segment_starts(const HandleState& h) { return at<int32_t>(h.scratch, layout_of(h).segment_starts); }

size_t handle_block_bytes(const GroupConfig& c, int num_ranks) {
  return handle_layout(c.max_tokens_per_rank, c.max_topk, c.num_experts, num_ranks).total;
}

void bind_handle(HandleState& h, void* block, const GroupConfig& c, int R, int rank, Device dev) {
  (void)rank;
  const HandleLayout L = layout_of(h);
  const int64_t T = h.num_tokens, K = h.topk, E = h.num_experts, Le = h.local_experts;
  auto view = [&](size_t off, Shape s) { return Tensor::wrap(TensorRef(at<int32_t>(block, off), DType::kI32, s, dev), h.storage); };
  h.routed_experts = view(L.routed, {T, K});
  h.pair_pos = view(L.pair_pos, {T, K});
  h.token_slot = view(L.token_slot, {T, R});
  h.send_tokens = view(L.send_tokens, {R});
  h.routed_counts = view(L.counts, {E});
  h.recv_pairs = view(L.recv_pairs, {R, Le});
  h.recv_tokens = view(L.recv_tokens, {R});
  h.expert_rows = view(L.expert_rows, {Le});
  h.expert_offsets = view(L.expert_offsets, {Le + 1});
  h.recv_row = view(L.recv_row, {R, h.max_tokens, K});
  h.status = view(L.status, {4});
  h.scratch = block;
  (void)c;
}

void prepare_send_side(HandleState& h, const TensorRef& topk_idx, const TensorRef& topk_weights,
                       const PrepareOptions& options, bool local, int align, int64_t recv_capacity_rows,
                       int32_t* group_status, Stream stream) {
  const char* fn = "epx::prepare";
  require_status(h.num_experts <= layout::kMaxExperts, Status::kNotSupported, fn, "the group has ", h.num_experts,
                 " experts; the CUDA prepare supports up to ", layout::kMaxExperts);
  require_status(h.num_ranks <= layout::kMaxRanks, Status::kNotSupported, fn, "the group has ", h.num_ranks,
                 " ranks; the CUDA prepare supports up to ", layout::kMaxRanks);
  cudaStream_t s = to_cuda(stream);
  const HandleLayout L = layout_of(h);
  void* base = h.scratch;
  int32_t* status = at<int32_t>(base, L.status);
  const bool legacy = resolve_kernel() == LayoutKernel::kLegacy;
  if (legacy) {
    EPX_CUDA_CHECK(cudaMemsetAsync(status, 0, 4 * sizeof(int32_t), s));
    EPX_CUDA_CHECK(cudaMemsetAsync(status + 1, 0x7f, sizeof(int32_t), s));  // kNoBadPair
  }

  layout::Params p{};
  p.idx = topk_idx.data();
  p.idx64 = topk_idx.dtype() == DType::kI64;
  p.T = h.num_tokens;
  p.K = h.topk;
  p.E = h.num_experts;
  p.R = h.num_ranks;
  p.Le = h.local_experts;
  p.chunk = chunk_for(h.num_tokens);
  p.capacity = h.capacity;
  p.routed = at<int32_t>(base, L.routed);
  p.pair_pos = at<int32_t>(base, L.pair_pos);
  p.local_rank = at<int32_t>(base, L.local_rank);
  p.block_hist = at<int32_t>(base, L.block_hist);
  p.block_tok = at<int32_t>(base, L.block_tok);
  p.token_slot = at<int32_t>(base, L.token_slot);
  p.send_tokens = at<int32_t>(base, L.send_tokens);
  p.counts = at<int32_t>(base, L.counts);
  p.status = status;
  p.local = local;
  p.align = align;
  p.recv_capacity = recv_capacity_rows;
  p.recv_pairs = at<int32_t>(base, L.recv_pairs);
  p.recv_tokens = at<int32_t>(base, L.recv_tokens);
  p.expert_rows = at<int32_t>(base, L.expert_rows);
  p.expert_offsets = at<int32_t>(base, L.expert_offsets);
  p.group_status = group_status;
  p.block_bad = at<int32_t>(base, L.block_bad);
  p.sync = at<unsigned long long>(base, L.sync);

  const bool by_probability = h.capacity > 0 && options.drop_policy == DropPolicy::kByProbability;
  if (by_probability) {
    // A dropless pass: validated ids, positions and counts; then each expert keeps its `capacity`
    // heaviest pairs in a masked copy of the ids, which a second pass routes dropless.
    layout::Params first = p;
    first.capacity = 0;
    if (legacy)
      run_passes(first, false, s);
    else
      run_fused(first, layout::kPassFirst, s);
    const int64_t npairs = static_cast<int64_t>(p.T) * p.K;
    int32_t* list = at<int32_t>(base, L.pair_list);
    int32_t* masked = at<int32_t>(base, L.masked_ids);
    if (npairs > 0) {
      const int grid = static_cast<int>(std::min<int64_t>((npairs + 255) / 256, 1024));
      layout::list_pairs_kernel<<<grid, 256, 0, s>>>(p.routed, p.pair_pos, p.counts, p.E, npairs, list, masked);
      EPX_CHECK_LAUNCH("list_pairs_kernel");
      layout::rank_by_weight_kernel<<<p.E, 256, 0, s>>>(list, p.counts, topk_weights.ptr<float>(), p.E, h.capacity,
                                                        masked);
      EPX_CHECK_LAUNCH("rank_by_weight_kernel");
    }
    p.idx = masked;
    p.idx64 = false;
    p.capacity = 0;
  }
  if (legacy)
    run_passes(p, true, s);
  else
    run_fused(p, by_probability ? layout::kPassSecond : layout::kPassOnly, s);
}

}  // namespace epx::cuda
