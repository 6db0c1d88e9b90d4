// One forward + backward of a reduced layer shaped like a preset (hidden 256, ffn 64, 32 experts,
// 64 tokens per rank) on this process's GPU group against R simulated ranks of the CPU reference
// with the same parameters, tokens and output gradients. Used by `epx demo` and the multi-GPU tests.
#pragma once

#include <cstdint>

#include "epx/grouped_gemm.h"
#include "epx/presets.h"
#include "epx/tensor.h"

namespace epx::tools {

struct Compare {
  double rel = 0;      // ||got - want|| / ||want||
  double max_abs = 0;  // max |got - want|
};
Compare compare(const TensorRef& got, const TensorRef& want);

struct LayerCheck {
  Compare out, d_x, w_in, gate;
  double routing_agreement = 0;  // fraction of tokens whose top-k experts match the reference's
  bool ok = false;               // within the bf16 tolerances below
};

/// Collective over this process's GPU group (make_gpu_group); each process checks its own rank.
/// With precision fp8_block the FFN widths are 128 (whole scale blocks) and the tolerances 1.5x.
LayerCheck check_layer_against_reference(const ShapePreset& preset, uint64_t seed,
                                         MlpPrecision precision = MlpPrecision::kHigh);

}  // namespace epx::tools
