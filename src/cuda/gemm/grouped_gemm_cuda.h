// Grouped GEMMs over the expert-major layout on Hopper (CUTLASS 3 pointer-array kernels, TMA +
// WGMMA, persistent, problem sizes read on the device). A small setup kernel turns the device-side
// offsets/rows into per-group problem shapes, pointers and strides, so nothing is copied to the host.
// Groups with no rows get an empty problem (no tiles): their outputs are left as the caller set them.
//
// Shapes (row-major; ld = elements between rows):
//   forward  out_g [rows_g, N] (ld_out)  = a_g [rows_g, K] (ld_a) . b_g [K, N]        bf16 -> bf16
//   dgrad    out_g [rows_g, N] (ld_out)  = a_g [rows_g, K] (ld_a) . b_g [N, K]^T       bf16 -> bf16
//   wgrad    out_g [K, N]                = a_g [rows_g, K]^T (ld_a) . d_g [rows_g, N] (ld_d)  bf16 -> fp32 or bf16
// where a_g starts at row offsets[g], b_g / out_g (wgrad) at g * group_stride elements.
#pragma once

#include <cstdint>
#include <vector>

#include "epx/tensor.h"

namespace epx::cuda {

/// True when this build has the CUTLASS grouped kernels (found at configure time).
bool grouped_gemm_available();

struct GroupedOperand {
  const void* ptr = nullptr;
  int64_t ld = 0;            // elements between rows
  int64_t group_stride = 0;  // elements between groups (weights), 0 for row-offset operands
};

/// row_align: what the caller guarantees of every offsets[g] (a multiple of it); see
/// forward_gemm_schedule for what a multiple of 128 changes.
void grouped_forward_bf16(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                          const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows, Stream stream,
                          int64_t row_align = 1);
void grouped_dgrad_bf16(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                        const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows, Stream stream,
                        int64_t row_align = 1);
/// The forward's and dgrad's schedule: EPX_GEMM_FORWARD_KERNEL=auto (default) | cooperative | pingpong
/// | contiguous, read at every call (tests and benchmarks switch it). auto: ping-pong 128x128 tiles where
/// the contraction is at most 2048 deep and groups average at least 1024 rows of capacity (one warp
/// group's epilogue runs under the other's MMAs: 1.07-1.09x the cooperative kernel at 32 x 1024 rows,
/// K = 2048, N = 7168 on an H200, bit-identical; 1.06x the contiguous kernel there); elsewhere, where
/// row_align (the caller's guarantee: every offsets[g] a multiple of it) is a multiple of 128 and
/// groups average at least 256 rows of capacity, the forward over m-grouped contiguous rows
/// (grouped_forward_bf16_contiguous: no per-group TMA descriptors; 1.00-1.07x the cooperative kernel on
/// an H200 at every such shape; the one-GPU DeepSeek-V3 layer with align 128, ~1 block a group, ran
/// its bf16 forward 1.2x slower with it), otherwise cooperative 128x256 tiles (ping-pong was level at 256 rows a group, 0.94x with
/// Zipf-skewed groups and 0.85x at decode). contiguous with a row_align that is not a multiple of 128
/// is an error.
enum class ForwardGemmSchedule { kCooperative, kPingpong, kContiguous };
ForwardGemmSchedule forward_gemm_schedule(int64_t contraction, int64_t row_capacity, int groups,
                                          int64_t row_align = 1);
/// The forward over m-grouped contiguous rows (cutlass/contiguous_groups_sm90.cuh): one GEMM over all
/// rows whose 128-row tiles each load their group's weights, on the cooperative kernel's tiles and
/// epilogue (the same bits). Every group must start at a multiple of 128 rows; the padding rows of out
/// are written (the caller zeroes them), rows from the end of the last group's last 128-row block on
/// are not.
void grouped_forward_bf16_contiguous(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K,
                                     int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                     int64_t total_rows, Stream stream);
/// The dgrad the same way (b_g [N, K] as grouped_dgrad_bf16's).
void grouped_dgrad_bf16_contiguous(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                                   const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows,
                                   Stream stream);
/// The contiguous kernels' epilogue: EPX_CONTIGUOUS_EPILOGUE=auto (default) | staged | cutlass, read at
/// every call. staged (staged_tile_epilogue_sm90.cuh) converts the whole tile into shared memory once
/// and leaves it to TMA box stores that the next tile's MMAs hide; cutlass is CUTLASS's sub-tiled
/// epilogue (the same bits); auto takes staged except for a dgrad whose contraction is longer than
/// 2048. true where staged is chosen and out can be a tensor map's base (16-byte aligned, N and
/// ld_out multiples of 8).
bool contiguous_staged_epilogue(const void* out, int64_t N, int64_t ld_out, bool dgrad, int64_t contraction);
void grouped_forward_bf16_contiguous_staged(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K,
                                            int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                            int64_t total_rows, Stream stream);
void grouped_dgrad_bf16_contiguous_staged(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K,
                                          int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                          int64_t total_rows, Stream stream);
/// The forward and dgrad on the ping-pong schedule (the arguments as above).
void grouped_forward_bf16_pingpong(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K,
                                   int64_t N, const int32_t* offsets, const int32_t* rows, int groups, Stream stream);
void grouped_dgrad_bf16_pingpong(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N,
                                 const int32_t* offsets, const int32_t* rows, int groups, Stream stream);
/// Wgrad: out_g [K, N] = a_g^T . d_g over each group's rows, fp32 accumulation. beta 0 overwrites
/// out (groups without rows are not written); beta 1 adds to what out holds (gradient accumulation:
/// groups without rows keep it).
void grouped_wgrad_bf16(GroupedOperand a, GroupedOperand d, float* out, int64_t out_group_stride, int64_t K, int64_t N,
                        const int32_t* offsets, const int32_t* rows, int groups, Stream stream, float beta = 0.0f);
/// The same with bf16 out (fp32 accumulation, rounded once).
void grouped_wgrad_bf16_out(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride, int64_t K,
                            int64_t N, const int32_t* offsets, const int32_t* rows, int groups, Stream stream,
                            float beta = 0.0f);
/// Both again with the ping-pong schedule (128x128 tiles, one warp group's epilogue under the
/// other's math): the same results, faster when groups have few rows.
void grouped_wgrad_bf16_pingpong(GroupedOperand a, GroupedOperand d, float* out, int64_t out_group_stride, int64_t K,
                                 int64_t N, const int32_t* offsets, const int32_t* rows, int groups, Stream stream,
                                 float beta = 0.0f);
void grouped_wgrad_bf16_out_pingpong(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                     int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                     Stream stream, float beta = 0.0f);

/// bf16 out, overwriting only (no beta), on cooperative tiles without a source operand and with
/// larger epilogue stores.
void grouped_wgrad_bf16_out_nosource(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                     int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                     Stream stream);

/// The same on ping-pong 128x128 tiles without a source operand, in 2x1 clusters (the default for
/// overwritten bf16 gradients: wgrad_schedule()).
void grouped_wgrad_bf16_out_pingpong_nosource(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                              int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows,
                                              int groups, Stream stream);

/// bf16 out, overwriting only, on cooperative 128x256 tiles that leave by TMA stores from one staged tile
/// (cutlass/wgrad_tma_store_sm90.cuh; the default for overwritten bf16 gradients: wgrad_schedule()).
/// Needs out 16-byte aligned and N and out_group_stride multiples of 8 (wgrad_coop_tma_supports).
void grouped_wgrad_bf16_out_coop_tma(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                     int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                     Stream stream);
bool wgrad_coop_tma_supports(const void* out, int64_t N, int64_t out_group_stride);

/// fp32 out, overwriting only, on the same kernel (the default for overwritten fp32 gradients where
/// groups are large enough: wgrad_schedule()).
void grouped_wgrad_f32_pingpong_nosource(GroupedOperand a, GroupedOperand d, float* out, int64_t out_group_stride,
                                         int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                         Stream stream);

/// bf16 out on 2x1 clusters sharing B by multicast (cooperative tiles).
void grouped_wgrad_bf16_out_cluster(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride,
                                    int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                    Stream stream, float beta = 0.0f);

/// FP8 e4m3 forward with DeepSeek-V3 block scales, bf16 out, fp32 accumulation:
///   out_g [rows_g, N] (ld_out) = (a_g [rows_g, K] x its 1x128 scales) . (bt_g [N, K] x its 128x128 scales)^T
/// a: fp8 rows (ld = K) from row offsets[g]; a_scales: fp32, group g's block starts at
/// offsets[g] * K/128 and is M-major, scale(row r, k block j) at offsets[g] * K/128 + j * rows[g] +
/// (r - offsets[g]) (grouped_scales_from_rowwise makes it from quantize()'s [rows, K/128]);
/// bt: fp8, per group [N, K] (K contiguous: Hopper's FP8 MMA reads both operands K-major), group
/// stride N * K; b_scales: fp32, per group [K/128, N/128] row-major (quantize()'s 128x128 scales of
/// w_g [K, N]), group stride K/128 * N/128. K and N multiples of 128. Padding rows are not written.
/// Runs the schedule fp8_gemm_schedule(row_capacity, groups) picks; row_capacity: the rows of a.
void grouped_forward_fp8_blockwise(const void* a, const float* a_scales, const void* bt, const float* b_scales,
                                   void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
                                   const int32_t* rows, int groups, int64_t row_capacity, Stream stream);
/// The same on ping-pong 64x128 tiles (one per consumer warp group; epilogue under the other group's
/// MMAs) instead of cooperative 128x128 ones. Both schedules promote a K block's partial sums while
/// the next block's MMAs run (cutlass/fp8_overlapped_promotion_sm90.cuh).
void grouped_forward_fp8_blockwise_pingpong(const void* a, const float* a_scales, const void* bt,
                                            const float* b_scales, void* out, int64_t ld_out, int64_t K, int64_t N,
                                            const int32_t* offsets, const int32_t* rows, int groups, Stream stream);

/// The same over m-grouped contiguous rows (cutlass/contiguous_groups_sm90.cuh): one GEMM over
/// all rows whose 128-row tiles each load their group's weights, no per-group TMA descriptors. Every
/// group must start at a multiple of 128 rows (offsets[g] % 128 == 0: a layout with align = 128); the
/// padding rows of y are written (the caller zeroes them), rows from the end of the last group's last
/// 128-row block on are not. a_scales_mmajor: the 1x128 scales of every row, M-major over
/// round_up(total_rows, 128) rows (transpose_activation_scales makes it from quantize()'s
/// [rows, K/128]); bt, b_scales as grouped_forward_fp8_blockwise's.
void grouped_forward_fp8_contiguous(const void* a, const float* a_scales_mmajor, const void* bt, const float* b_scales,
                                    void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
                                    const int32_t* rows, int groups, int64_t total_rows, Stream stream);
/// The same with the staged tile's epilogue (contiguous_staged_epilogue).
void grouped_forward_fp8_contiguous_staged(const void* a, const float* a_scales_mmajor, const void* bt,
                                           const float* b_scales, void* out, int64_t ld_out, int64_t K, int64_t N,
                                           const int32_t* offsets, const int32_t* rows, int groups, int64_t total_rows,
                                           Stream stream);

/// The FP8 forward's schedule: EPX_FP8_GEMM_KERNEL=cooperative | pingpong | contiguous | auto
/// (default), read at every call (tests and benchmarks switch it). row_align: what the caller
/// guarantees of every offsets[g] (a multiple of it). auto: ping-pong where a group averages at most
/// 64 rows of capacity (decode: its 64-row tiles waste less of a small group and it streams the
/// weights 1.3x faster, 136 vs 180 us at 32 x 16 rows, K=7168, N=2048 on an H200); elsewhere the
/// contiguous kernel where row_align is a multiple of 128 (1.04-1.15x the cooperative kernel on an H200
/// at every such shape), the cooperative pointer-array kernel otherwise (1.2-1.4x faster than
/// ping-pong at 256 rows or more per group). contiguous with a row_align that is not a multiple of 128
/// is an error.
enum class Fp8GemmSchedule { kCooperative, kPingpong, kContiguous };
Fp8GemmSchedule fp8_gemm_schedule(int64_t row_capacity, int groups, int64_t row_align = 1);
/// Every value of EPX_FP8_GEMM_KERNEL besides auto: the shipped schedules, then, in a build with
/// -DEPX_GEMM_TRIALS=ON, the candidate kernels' names (tests and benchmarks run each).
std::vector<const char*> fp8_gemm_schedule_names();

/// Which wgrad schedule the FFN and grouped_gemm_wgrad use: EPX_WGRAD_KERNEL=auto (the default)
/// |cooperative|pingpong|cluster|nosource|pingpong_nosource|coop_tma, read once. cluster = cooperative
/// 2x1 clusters for bf16 gradients, ping-pong for fp32; nosource = grouped_wgrad_bf16_out_nosource for
/// overwritten bf16 gradients, cooperative otherwise; pingpong_nosource = the no-source ping-pong
/// kernels for overwritten gradients, cooperative for accumulating bf16 ones and ping-pong for
/// accumulating fp32 ones; coop_tma = grouped_wgrad_bf16_out_coop_tma for overwritten bf16 gradients
/// (pingpong_nosource where its alignment rules fail), the pingpong_nosource choices otherwise.
/// auto: overwritten bf16 gradients take coop_tma where the operands hold fewer than
/// kCoopTmaWgradMaxRowsPerGroup rows a group and its alignment rules hold. On an H200, in the one-GPU
/// DeepSeek-V3-like layer (128 rows a group) its wgrad phases ran 1.08-1.10x the no-source cooperative
/// kernel's and the step 1.035x; back to back in bench_grouped_gemm's interleaved contests it was
/// 0.94-0.98x the best other kernel, so the layer's figure is the one the choice follows
/// (bench/NOTES.md). Where groups hold kCoopTmaWgradMaxRowsPerGroup rows or more (the Mixtral-like
/// layer: its step 0.985x with coop_tma) and for overwritten fp32 gradients: the no-source ping-pong
/// kernels where the operands hold at least kPingpongWgradMinRowsPerGroup rows a group (fp32: 1.04-1.11x
/// ping-pong at 128 groups x 256 rows, 0.97-1.01x at 32 x 1024), below that nosource for bf16 and
/// ping-pong for fp32; ping-pong for accumulating gradients. The rows are the capacity, which the layer
/// sizes for the worst case (every token to this rank), so a layer on R ranks counts R times its
/// average rows.
inline constexpr int64_t kPingpongWgradMinRowsPerGroup = 192;
inline constexpr int64_t kCoopTmaWgradMaxRowsPerGroup = 1024;
enum class WgradSchedule { kAuto, kCooperative, kPingpong, kCluster, kNoSource, kPingpongNoSource, kCoopTma };
WgradSchedule wgrad_schedule();

}  // namespace epx::cuda
