// GPU paths of the expert FFN and the public grouped GEMMs (arguments validated by src/moe/gemm_ops.cpp).
#pragma once

#include "epx/grouped_gemm.h"

namespace epx::cuda {

void expert_mlp_forward_cuda(const MlpConfig& config, const MlpTensors& t, Stream stream);
void expert_mlp_backward_cuda(const MlpConfig& config, const MlpTensors& t, const MlpGrads& g, Stream stream);
void grouped_forward_cuda(const TensorRef& x, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                          const TensorRef& y, Stream stream, int64_t row_align = 1);
void grouped_dgrad_cuda(const TensorRef& dy, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dx, Stream stream, int64_t row_align = 1);
void grouped_wgrad_cuda(const TensorRef& x, const TensorRef& dy, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dw, bool accumulate, Stream stream);
void quantize_grouped_weights_fp8_cuda(const TensorRef& w, const TensorRef& w_q, const TensorRef& w_scales,
                                       Stream stream);
void grouped_forward_fp8_cuda(const TensorRef& x_q, const TensorRef& x_scales, const TensorRef& w_q,
                              const TensorRef& w_scales, const TensorRef& offsets, const TensorRef& rows,
                              const TensorRef& y, Stream stream, int64_t row_align = 1);

}  // namespace epx::cuda
