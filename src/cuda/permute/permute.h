// Moving rows between token order [T, H] and the expert-major padded layout on one GPU: the
// dispatch and combine of a one-rank group, and the local halves the multi-rank transports reuse.
#pragma once

#include <cstdint>

#include "core/ep_state.h"
#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx::cuda {

/// Largest top-k the permute kernels take (one warp lane per slot).
constexpr int kPermuteMaxTopk = 32;

/// Which dispatch kernel moves the rows (tuning, not semantics: every choice writes the same bytes).
enum class PermuteKernel : uint8_t {
  kAuto,  // EPX_PERMUTE_KERNEL=warp|bulk if set (read once), else kBulk wherever it applies
  kWarp,  // a warp per token: 16-byte register loads, each value stored to every destination
  kBulk,  // a warp per token with two shared-memory stages: the row arrives by one bulk (TMA) copy
          // and leaves by one bulk store per destination (needs 16-byte rows and pointers)
};
const char* permute_kernel_name(PermuteKernel k);

/// How quantize-while-permuting schedules its x loads and staged rows (tuning, not semantics: every
/// choice writes the same bytes). A lane reads x in batches of 8 16-byte vectors.
enum class QuantizeSchedule : uint8_t {
  kAuto,               // EPX_QUANT_PERMUTE_SCHEDULE=batched|pipelined|pipelined_one_stage if set (read
                       // once), else kPipelinedOneStage
  kBatched,            // a batch loads when the warp gets to it; two staged rows a warp
  kPipelined,          // the next batch (the row's next or the next token's first) loads while one is
                       // quantized; two staged rows a warp
  kPipelinedOneStage,  // pipelined, one staged row a warp (twice the warps an SM; a token's codes wait
                       // until the previous token's stores have read the stage)
};
const char* quantize_schedule_name(QuantizeSchedule s);

struct PermuteTuning {
  PermuteKernel kernel = PermuteKernel::kAuto;
  /// Cap on the CTAs launched (tests set it low so that every warp walks many tokens); 0 = auto.
  int max_ctas = 0;
  QuantizeSchedule quantize_schedule = QuantizeSchedule::kAuto;
};

/// dispatch of a one-rank group: recv_x[row(t,k)] = x[t] (and the scale row for a quantized x),
/// recv_weights[row] = topk_weights[t,k], padding rows zero; h.recv_row records row(t,k). Nothing
/// is written when the padded total exceeds recv_capacity_rows (h.status[0] says by how much).
/// `align` is the group's segment alignment (it bounds the padding rows of an expert).
void permute_forward(HandleState& h, const TensorRef& x, const TensorRef& x_scales, const TensorRef& topk_weights,
                     const TensorRef& recv_x, const TensorRef& recv_scales, const TensorRef& recv_weights,
                     int64_t recv_capacity_rows, int align, Stream stream, const PermuteTuning& tuning = {});

/// Quantize while permuting: x [T, H] fp32/bf16/fp16, recipe kFp8Block1x128 or kMxfp8Rowwise with
/// H a multiple of its block (validated by the caller). One kernel reads each token row once,
/// quantizes it block by block (the helpers of src/cuda/quant, so the bits are those of
/// cuda::quantize and epx::ref::quantize) and writes the fp8 row and its scale row to each of the
/// token's destinations; recv_weights, recv_row and the zero padding rows as permute_forward.
/// kBulk sends the staged row with bulk stores, kWarp with lane stores (both stage in shared memory).
void permute_quantize_forward(HandleState& h, QuantRecipe recipe, E8M0Rounding mx_rounding, const TensorRef& x,
                              const TensorRef& topk_weights, const TensorRef& recv_x, const TensorRef& recv_scales,
                              const TensorRef& recv_weights, int64_t recv_capacity_rows, int align, Stream stream,
                              const PermuteTuning& tuning = {});

/// Whether permute_quantize_forward's two shared-memory stages (fp8 row + scale row) fit for rows
/// of `hidden` elements on the current device.
bool permute_quantize_fits(int64_t hidden);

/// combine of a one-rank group: out[t] = round(fma chain over k ascending of w_row * y[row]).
void unpermute_forward(const HandleState& h, const TensorRef& y, const TensorRef& row_weights, const TensorRef& out,
                       Stream stream);

/// combine_backward of a one-rank group: d_y[row] = round(w_row * d_out[t]) (or a copy),
/// d_row_weights[row] = <d_out[t], y[row]> (fp32, fixed reduction tree), zero padding rows.
void permute_backward(const HandleState& h, const TensorRef& d_out, const TensorRef& y, const TensorRef& row_weights,
                      const TensorRef& d_y, const TensorRef& d_row_weights, Stream stream);

/// dispatch_backward of a one-rank group: d_x[t] = round(sum over k ascending of d_recv_x[row]),
/// d_topk_weights[t, k] = d_recv_weights[row] (0 for masked or dropped slots).
void unpermute_backward(const HandleState& h, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                        const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream);

}  // namespace epx::cuda
