// Launchers of the one-GPU row movers (kernels: permute_kernels.cuh, permute_bulk.cuh).
// Dispatch: the bulk kernel (shared-memory stages, bulk copies) wherever rows and pointers are
// 16-byte aligned and two stages fit in shared memory, else the warp kernel with the widest vector
// the rows and pointers allow; PermuteTuning or EPX_PERMUTE_KERNEL=warp|bulk (read once) choose.
// Quantize-while-permuting: one kernel, bulk stores where the pointers allow, by default x loads
// pipelined across batches and tokens and one staged row a warp (PermuteTuning::quantize_schedule or
// EPX_QUANT_PERMUTE_SCHEDULE).
// EPX_DEBUG=1 prints the resolved choice of every launch.
#include "cuda/permute/permute.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "core/env_choice.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/row_reduce_tuning.h"
#include "cuda/permute/permute_bulk.cuh"
#include "cuda/permute/permute_kernels.cuh"

namespace epx::cuda {

const char* quantize_schedule_name(QuantizeSchedule sc) {
  switch (sc) {
    case QuantizeSchedule::kAuto: return "auto";
    case QuantizeSchedule::kBatched: return "batched";
    case QuantizeSchedule::kPipelined: return "pipelined";
    case QuantizeSchedule::kPipelinedOneStage: return "pipelined_one_stage";
  }
  return "?";
}

const char* permute_kernel_name(PermuteKernel k) {
  switch (k) {
    case PermuteKernel::kAuto: return "auto";
    case PermuteKernel::kWarp: return "warp";
    case PermuteKernel::kBulk: return "bulk";
  }
  return "?";
}

namespace {

bool debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("EPX_DEBUG");
    return v && *v && *v != '0';
  }();
  return on;
}

// EPX_PERMUTE_KERNEL, read once (an unknown value is an error).
PermuteKernel env_kernel() {
  static const PermuteKernel k = [] {
    const PermuteKernel kinds[] = {PermuteKernel::kAuto, PermuteKernel::kWarp, PermuteKernel::kBulk};
    const int i = ::epx::detail::env_choice("EPX_PERMUTE_KERNEL", {"auto", "warp", "bulk"});
    return i < 0 ? PermuteKernel::kAuto : kinds[i];
  }();
  return k;
}

PermuteKernel wanted_kernel(const PermuteTuning& tuning) {
  if (tuning.kernel != PermuteKernel::kAuto) return tuning.kernel;
  const PermuteKernel e = env_kernel();
  return e != PermuteKernel::kAuto ? e : PermuteKernel::kBulk;
}

permute::Layout layout_of(const HandleState& h) {
  permute::Layout L;
  L.T = h.num_tokens;
  L.K = h.topk;
  L.Le = h.local_experts;
  L.routed = h.routed_experts.ptr<int32_t>();
  L.pair_pos = h.pair_pos.ptr<int32_t>();
  L.offsets = h.expert_offsets.ptr<int32_t>();
  L.expert_rows = h.expert_rows.ptr<int32_t>();
  L.recv_row = h.recv_row.ptr<int32_t>();
  return L;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

/// Largest of 16, 8, 4, 2, 1 dividing the address and every extra extent given.
int alignment_of(const void* p, int64_t a = 0, int64_t b = 0) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(p) | static_cast<uint64_t>(a) | static_cast<uint64_t>(b) | 16u;
  return static_cast<int>(bits & (~bits + 1));
}

int64_t round_up16(int64_t v) { return (v + 15) / 16 * 16; }

int grid_for(int64_t items) {
  const int64_t per_block = permute::kWarps;
  const int64_t want = (items + per_block - 1) / per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, static_cast<int64_t>(sm_count()) * 16)));
}

int current_device() {
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

/// Largest dynamic shared memory one CTA may opt in to on the current device.
int smem_optin_limit() {
  static std::mutex mu;
  static std::map<int, int> cache;
  const int dev = current_device();
  std::lock_guard<std::mutex> lk(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  int v = 0;
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return cache[dev] = v;
}

/// Opts `kernel` in to `smem` bytes of dynamic shared memory on the current device where that is
/// above the default 48 KB, and returns how many CTAs of `threads` threads fit on one SM (once per
/// kernel, device, block size and shared memory size).
int resident_ctas(const void* kernel, int threads, size_t smem, const char* name) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  const int dev = current_device();
  std::lock_guard<std::mutex> lk(mu);
  const auto key = std::make_tuple(kernel, dev, threads, smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (smem > 48 * 1024)
    EPX_CUDA_CHECK_IMPL(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                        name);
  int blocks = 0;
  EPX_CUDA_CHECK_IMPL(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem), name);
  return cache[key] = blocks;
}

int prepare_bulk_launch(const void* kernel, size_t smem, const char* name) { return resident_ctas(kernel, 32, smem, name); }

/// Dynamic shared memory a two-stage bulk kernel may use: the opt-in limit less room for the
/// kernels' static shared memory.
int64_t bulk_smem_budget() { return static_cast<int64_t>(smem_optin_limit()) - 1024; }

/// CTAs of a one-warp-per-CTA kernel: every resident CTA, no more than there are work items.
int bulk_grid(int64_t items, int blocks_per_sm, const PermuteTuning& tuning) {
  int64_t n = std::min<int64_t>(std::max<int64_t>(items, 1), static_cast<int64_t>(sm_count()) * blocks_per_sm);
  if (tuning.max_ctas > 0) n = std::min<int64_t>(n, tuning.max_ctas);
  return static_cast<int>(std::max<int64_t>(n, 1));
}

template <class F>
void with_element(DType dt, F&& f) {
  switch (dt) {
    case DType::kF32: f(float{}); break;
    case DType::kBF16: f(__nv_bfloat16{}); break;
    case DType::kF16: f(__half{}); break;
    default:
      throw Error(Status::kNotSupported, detail::concat("epx: the CUDA combine supports fp32, bf16 and fp16 rows, not ",
                                                        dtype_name(dt)));
  }
}

void check_topk(const HandleState& h, const char* fn) {
  require_status(h.topk <= kPermuteMaxTopk, Status::kNotSupported, fn, "top-k is ", h.topk,
                 "; the CUDA kernels support up to ", kPermuteMaxTopk);
}

int pad_chunks_for(int align) { return align > 1 ? (align - 1 + permute::kPadRows - 1) / permute::kPadRows : 0; }

}  // namespace

void permute_forward(HandleState& h, const TensorRef& x, const TensorRef& x_scales, const TensorRef& topk_weights,
                     const TensorRef& recv_x, const TensorRef& recv_scales, const TensorRef& recv_weights,
                     int64_t recv_capacity_rows, int align, Stream stream, const PermuteTuning& tuning) {
  check_topk(h, "epx::dispatch_forward");
  permute::PermuteArgs a;
  a.L = layout_of(h);
  a.capacity = recv_capacity_rows;
  a.x = static_cast<const char*>(x.data());
  a.row_bytes = x.size(1) * static_cast<int64_t>(dtype_size(x.dtype()));
  a.x_scales = x_scales.defined() ? static_cast<const char*>(x_scales.data()) : nullptr;
  a.scale_bytes = x_scales.defined() ? x_scales.size(1) * static_cast<int64_t>(dtype_size(x_scales.dtype())) : 0;
  a.topk_weights = topk_weights.defined() ? topk_weights.ptr<float>() : nullptr;
  a.recv = static_cast<char*>(recv_x.data());
  a.recv_scales = recv_scales.defined() ? static_cast<char*>(recv_scales.data()) : nullptr;
  a.recv_weights = recv_weights.defined() ? recv_weights.ptr<float>() : nullptr;
  a.pad_chunks = pad_chunks_for(align);
  const int64_t items = static_cast<int64_t>(h.num_tokens) + static_cast<int64_t>(h.local_experts) * a.pad_chunks;
  cudaStream_t s = to_cuda(stream);

  // Bulk: 16-byte rows and pointers, two stages in shared memory.
  const bool bulk_scales = a.scale_bytes > 0 && a.scale_bytes % 16 == 0 && aligned16(a.x_scales) &&
                           aligned16(a.recv_scales);
  const int64_t scale_off = round_up16(a.row_bytes);
  const int64_t stage = scale_off + (bulk_scales ? round_up16(a.scale_bytes) : 0);
  const bool bulk_ok = a.row_bytes > 0 && a.row_bytes % 16 == 0 && aligned16(a.x) && aligned16(a.recv) &&
                       2 * stage <= bulk_smem_budget();
  if (wanted_kernel(tuning) == PermuteKernel::kBulk && bulk_ok) {
    permute::BulkArgs b;
    b.p = a;
    b.stage_bytes = static_cast<uint32_t>(stage);
    b.scale_off = static_cast<uint32_t>(scale_off);
    b.bulk_scales = bulk_scales;
    const size_t smem = static_cast<size_t>(2 * stage);
    const void* k = reinterpret_cast<const void*>(&permute::permute_bulk_kernel);
    const int per_sm = prepare_bulk_launch(k, smem, "permute_bulk_kernel");
    if (per_sm > 0) {
      const int grid = bulk_grid(items, per_sm, tuning);
      if (debug_enabled())
        std::fprintf(stderr, "[epx] dispatch_forward (one GPU): kernel=bulk ctas=%d (%d per SM) stage=%lld bytes "
                     "row=%lld scales=%lld (%s)\n", grid, per_sm, static_cast<long long>(stage),
                     static_cast<long long>(a.row_bytes), static_cast<long long>(a.scale_bytes),
                     bulk_scales ? "bulk" : "lanes");
      permute::permute_bulk_kernel<<<grid, 32, smem, s>>>(b);
      EPX_CHECK_LAUNCH("permute_bulk_kernel");
      return;
    }
  }
  // Warp kernel: one wave of resident CTAs at most (a second, partial wave would run its tokens
  // after every other warp has finished, at a fraction of the bandwidth).
  const int vec = a.row_bytes % 16 == 0 && aligned16(a.x) && aligned16(a.recv)                ? 16
                  : a.row_bytes % 4 == 0 && (reinterpret_cast<uintptr_t>(a.x) & 3) == 0 &&
                            (reinterpret_cast<uintptr_t>(a.recv) & 3) == 0                      ? 4
                                                                                                  : 1;
  const void* k = vec == 16  ? reinterpret_cast<const void*>(&permute::permute_kernel<uint4>)
                  : vec == 4 ? reinterpret_cast<const void*>(&permute::permute_kernel<uint32_t>)
                             : reinterpret_cast<const void*>(&permute::permute_kernel<uint8_t>);
  const int per_sm = std::max(1, resident_ctas(k, permute::kThreads, 0, "permute_kernel"));
  int64_t grid = std::min<int64_t>((std::max<int64_t>(items, 1) + permute::kWarps - 1) / permute::kWarps,
                                   static_cast<int64_t>(sm_count()) * per_sm);
  if (tuning.max_ctas > 0) grid = std::min<int64_t>(grid, tuning.max_ctas);
  if (vec == 16) permute::permute_kernel<uint4><<<static_cast<int>(grid), permute::kThreads, 0, s>>>(a);
  else if (vec == 4) permute::permute_kernel<uint32_t><<<static_cast<int>(grid), permute::kThreads, 0, s>>>(a);
  else permute::permute_kernel<uint8_t><<<static_cast<int>(grid), permute::kThreads, 0, s>>>(a);
  EPX_CHECK_LAUNCH("permute_kernel");
  if (debug_enabled())
    std::fprintf(stderr, "[epx] dispatch_forward (one GPU): kernel=warp ctas=%lld (%d per SM) x %d warps vector=%d "
                 "bytes row=%lld scales=%lld\n", static_cast<long long>(grid), per_sm, permute::kWarps, vec,
                 static_cast<long long>(a.row_bytes), static_cast<long long>(a.scale_bytes));
}

namespace {

/// The fused quantize-permute's schedule by default. H200, bench_permute, T=4096, H=7168, K=8, 1x128
/// scales: 86.9-87.3 us pipelined with one stage, 91.4 us with two, 95.8-95.9 us batched.
constexpr QuantizeSchedule kDefaultQuantizeSchedule = QuantizeSchedule::kPipelinedOneStage;

// EPX_QUANT_PERMUTE_SCHEDULE, read once (an unknown value is an error).
QuantizeSchedule env_quantize_schedule() {
  static const QuantizeSchedule l = [] {
    const QuantizeSchedule kinds[] = {QuantizeSchedule::kAuto, QuantizeSchedule::kBatched,
                                      QuantizeSchedule::kPipelined, QuantizeSchedule::kPipelinedOneStage};
    const int i = ::epx::detail::env_choice("EPX_QUANT_PERMUTE_SCHEDULE",
                                            {"auto", "batched", "pipelined", "pipelined_one_stage"});
    return i < 0 ? QuantizeSchedule::kAuto : kinds[i];
  }();
  return l;
}

QuantizeSchedule wanted_quantize_schedule(const PermuteTuning& tuning) {
  if (tuning.quantize_schedule != QuantizeSchedule::kAuto) return tuning.quantize_schedule;
  const QuantizeSchedule e = env_quantize_schedule();
  return e != QuantizeSchedule::kAuto ? e : kDefaultQuantizeSchedule;
}

template <class T, bool kMx, bool kAlignedX, bool kPipelined, int kStages>
void launch_quantize_kernel(const permute::QuantPermuteArgs& q, int64_t items, const PermuteTuning& tuning,
                            cudaStream_t s) {
  const size_t smem = kStages * static_cast<size_t>(q.stage_bytes);
  const void* k =
      reinterpret_cast<const void*>(&permute::permute_quantize_kernel<T, kMx, kAlignedX, kPipelined, kStages>);
  const int per_sm = prepare_bulk_launch(k, smem, "permute_quantize_kernel");
  require_status(per_sm > 0, Status::kNotSupported, "epx::dispatch_forward",
                 "the fused quantize-dispatch kernel needs ", smem, " bytes of shared memory, more than an SM has");
  const int grid = bulk_grid(items, per_sm, tuning);
  if (debug_enabled())
    std::fprintf(stderr, "[epx] dispatch_forward (one GPU, quantize on the way): %s ctas=%d (%d per SM) stages=%d x "
                 "%u bytes payload=%s scales=%s x16=%d loads=%s\n", kMx ? "mxfp8_rowwise" : "fp8_block_1x128", grid,
                 per_sm, kStages, q.stage_bytes, q.payload_align ? "lanes" : "bulk", q.scale_align ? "lanes" : "bulk",
                 kAlignedX ? 1 : 0, kPipelined ? "pipelined" : "batched");
  permute::permute_quantize_kernel<T, kMx, kAlignedX, kPipelined, kStages><<<grid, 32, smem, s>>>(q);
  EPX_CHECK_LAUNCH("permute_quantize_kernel");
}

template <class T, bool kMx, bool kAlignedX>
void launch_quantize_scheduled(const permute::QuantPermuteArgs& q, int64_t items, const PermuteTuning& tuning,
                               cudaStream_t s) {
  switch (wanted_quantize_schedule(tuning)) {
    case QuantizeSchedule::kBatched: return launch_quantize_kernel<T, kMx, kAlignedX, false, 2>(q, items, tuning, s);
    case QuantizeSchedule::kPipelined: return launch_quantize_kernel<T, kMx, kAlignedX, true, 2>(q, items, tuning, s);
    default: return launch_quantize_kernel<T, kMx, kAlignedX, true, 1>(q, items, tuning, s);
  }
}

template <class T, bool kMx>
void launch_quantize_typed(const permute::QuantPermuteArgs& q, bool aligned_x, int64_t items,
                           const PermuteTuning& tuning, cudaStream_t s) {
  if (aligned_x) launch_quantize_scheduled<T, kMx, true>(q, items, tuning, s);
  else launch_quantize_scheduled<T, kMx, false>(q, items, tuning, s);
}

}  // namespace

void permute_quantize_forward(HandleState& h, QuantRecipe recipe, E8M0Rounding mx_rounding, const TensorRef& x,
                              const TensorRef& topk_weights, const TensorRef& recv_x, const TensorRef& recv_scales,
                              const TensorRef& recv_weights, int64_t recv_capacity_rows, int align, Stream stream,
                              const PermuteTuning& tuning) {
  const char* fn = "epx::dispatch_forward";
  check_topk(h, fn);
  const bool mx = recipe == QuantRecipe::kMxfp8Rowwise;
  require_status(mx || recipe == QuantRecipe::kFp8Block1x128, Status::kNotSupported, fn, "recipe ",
                 quant_recipe_name(recipe), " cannot be quantized on the way; expected fp8_block_1x128 or mxfp8_rowwise");
  const int64_t H = x.size(1), block = mx ? 32 : 128;
  require(H % block == 0, fn, "x has ", H, " columns (hidden), expected a multiple of ", block);
  const size_t es = dtype_size(x.dtype());
  require(reinterpret_cast<uintptr_t>(x.data()) % es == 0, fn, "x at address ", x.data(), " is not aligned to its ",
          es, "-byte elements, expected an element-aligned pointer");
  permute::QuantPermuteArgs q;
  permute::PermuteArgs& a = q.p;
  a.L = layout_of(h);
  a.capacity = recv_capacity_rows;
  a.x = static_cast<const char*>(x.data());
  a.row_bytes = H * static_cast<int64_t>(es);
  a.x_scales = nullptr;
  a.scale_bytes = (H / block) * static_cast<int64_t>(dtype_size(recv_scales.dtype()));
  a.topk_weights = topk_weights.defined() ? topk_weights.ptr<float>() : nullptr;
  a.recv = static_cast<char*>(recv_x.data());
  a.recv_scales = static_cast<char*>(recv_scales.data());
  a.recv_weights = recv_weights.defined() ? recv_weights.ptr<float>() : nullptr;
  a.pad_chunks = pad_chunks_for(align);
  q.H = H;
  q.ceil_rounding = mx_rounding == E8M0Rounding::kCeil;
  const bool bulk = wanted_kernel(tuning) == PermuteKernel::kBulk;
  // Rows of recv_x are H bytes (a multiple of 32) apart, so every row has the base's alignment.
  q.payload_align = bulk && aligned16(a.recv) ? 0 : alignment_of(a.recv, H);
  q.scale_align = q.payload_align == 0 && a.scale_bytes % 16 == 0 && aligned16(a.recv_scales)
                      ? 0
                      : alignment_of(a.recv_scales, a.scale_bytes);
  const int64_t stage = round_up16(H + a.scale_bytes);
  require_status(2 * stage <= bulk_smem_budget(), Status::kNotSupported, fn, "hidden ", H,
                 " needs two shared-memory stages of ", stage, " bytes, more than the device allows (",
                 bulk_smem_budget(), " bytes)");
  q.stage_bytes = static_cast<uint32_t>(stage);
  const int64_t items = static_cast<int64_t>(h.num_tokens) + static_cast<int64_t>(h.local_experts) * a.pad_chunks;
  const bool aligned_x = aligned16(a.x);  // rows are H * es bytes apart, a multiple of 16
  cudaStream_t s = to_cuda(stream);
  switch (x.dtype()) {
    case DType::kF32:
      if (mx) launch_quantize_typed<float, true>(q, aligned_x, items, tuning, s);
      else launch_quantize_typed<float, false>(q, aligned_x, items, tuning, s);
      return;
    case DType::kBF16:
      if (mx) launch_quantize_typed<__nv_bfloat16, true>(q, aligned_x, items, tuning, s);
      else launch_quantize_typed<__nv_bfloat16, false>(q, aligned_x, items, tuning, s);
      return;
    case DType::kF16:
      if (mx) launch_quantize_typed<__half, true>(q, aligned_x, items, tuning, s);
      else launch_quantize_typed<__half, false>(q, aligned_x, items, tuning, s);
      return;
    default: break;
  }
  throw Error(Status::kInvalidArgument,
              detail::concat(fn, ": x has dtype ", dtype_name(x.dtype()), ", expected fp32, bf16 or fp16"));
}

bool permute_quantize_fits(int64_t hidden) {
  // The widest scale row: MX, one byte per 32 elements; 1x128 fp32 scales take H / 32 bytes too.
  return 2 * round_up16(hidden + hidden / 32) <= bulk_smem_budget();
}

namespace {

template <class T>
void launch_reduce(const permute::ReduceArgs& a, cudaStream_t s) {
  const int grid = grid_for(a.L.T);
  constexpr int N = 16 / sizeof(T);
  if (a.H % N == 0 && aligned16(a.rows_in) && aligned16(a.out))
    permute::reduce_rows_kernel<T, N><<<grid, permute::kThreads, 0, s>>>(a);
  else
    permute::reduce_rows_kernel<T, 1><<<grid, permute::kThreads, 0, s>>>(a);
  EPX_CHECK_LAUNCH("reduce_rows_kernel");
}

template <class T, int KMAX, int G>
void launch_spread_kg(const permute::SpreadArgs& a, int grid, bool vec, cudaStream_t s) {
  constexpr int N = 16 / sizeof(T);
  if (vec)
    permute::spread_rows_kernel<T, N, KMAX, G><<<grid, permute::kThreads, 0, s>>>(a);
  else
    permute::spread_rows_kernel<T, 1, KMAX, G><<<grid, permute::kThreads, 0, s>>>(a);
  EPX_CHECK_LAUNCH("spread_rows_kernel");
}

// 4 y rows at a time by default: 8 (all of them where K <= 8) took 274.4-274.5 us against 272.5-272.7
// at T=4096, H=7168, K=8 on an H200 (bench_permute, combine_backward_local).
template <class T, int KMAX>
void launch_spread_k(const permute::SpreadArgs& a, int grid, bool vec, cudaStream_t s) {
  if (KMAX == 8 && spread_y_rows_k8(4) == 8) launch_spread_kg<T, KMAX, 8>(a, grid, vec, s);
  else launch_spread_kg<T, KMAX, spread_group<KMAX>()>(a, grid, vec, s);
}

template <class T>
void launch_spread(const permute::SpreadArgs& a, cudaStream_t s) {
  const int grid = grid_for(static_cast<int64_t>(a.L.T) + a.L.Le);
  constexpr int N = 16 / sizeof(T);
  const bool vec = a.H % N == 0 && aligned16(a.d_out) && aligned16(a.d_y) && (!a.y || aligned16(a.y));
  if (a.L.K <= 8) launch_spread_k<T, 8>(a, grid, vec, s);
  else if (a.L.K <= 16) launch_spread_k<T, 16>(a, grid, vec, s);
  else launch_spread_k<T, 32>(a, grid, vec, s);
}

}  // namespace

void unpermute_forward(const HandleState& h, const TensorRef& y, const TensorRef& row_weights, const TensorRef& out,
                       Stream stream) {
  check_topk(h, "epx::combine_forward");
  permute::ReduceArgs a{};
  a.L = layout_of(h);
  a.H = y.size(1);
  a.rows_in = y.data();
  a.row_weights = row_weights.defined() ? row_weights.ptr<float>() : nullptr;
  a.out = out.data();
  with_element(y.dtype(), [&](auto tag) { launch_reduce<decltype(tag)>(a, to_cuda(stream)); });
}

void unpermute_backward(const HandleState& h, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                        const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream) {
  check_topk(h, "epx::dispatch_backward");
  permute::ReduceArgs a{};
  a.L = layout_of(h);
  a.H = d_recv_x.size(1);
  a.rows_in = d_recv_x.data();
  a.out = d_x.data();
  a.d_row_in = d_recv_weights.defined() ? d_recv_weights.ptr<float>() : nullptr;
  a.d_topk_weights = d_topk_weights.defined() ? d_topk_weights.ptr<float>() : nullptr;
  with_element(d_recv_x.dtype(), [&](auto tag) { launch_reduce<decltype(tag)>(a, to_cuda(stream)); });
}

void permute_backward(const HandleState& h, const TensorRef& d_out, const TensorRef& y, const TensorRef& row_weights,
                      const TensorRef& d_y, const TensorRef& d_row_weights, Stream stream) {
  check_topk(h, "epx::combine_backward");
  permute::SpreadArgs a{};
  a.L = layout_of(h);
  a.H = d_out.size(1);
  a.d_out = d_out.data();
  a.y = d_row_weights.defined() ? y.data() : nullptr;
  a.row_weights = row_weights.defined() ? row_weights.ptr<float>() : nullptr;
  a.d_y = d_y.data();
  a.d_row_weights = d_row_weights.defined() ? d_row_weights.ptr<float>() : nullptr;
  with_element(d_out.dtype(), [&](auto tag) { launch_spread<decltype(tag)>(a, to_cuda(stream)); });
}

}  // namespace epx::cuda
