// The bf16 forward over m-grouped contiguous rows (grouped_bf16_contiguous_sm90.cuh): out [rows, N] =
// a [rows, K] . w_g [K, N], both row-major; CUTLASS's epilogue here, the staged tile's in
// grouped_forward_contiguous_staged_sm90.cu; and the choice between the two.
#include "core/env_choice.h"
#include "cuda/gemm/cutlass/grouped_bf16_contiguous_sm90.cuh"

namespace epx::cuda {

bool contiguous_staged_epilogue(const void* out, int64_t N, int64_t ld_out, bool dgrad, int64_t contraction) {
  const int choice = detail::env_choice("EPX_CONTIGUOUS_EPILOGUE", {"auto", "staged", "cutlass"});
  if (choice == 2 || !staged_tile::tma_output_supported(out, N, ld_out, ld_out)) return false;
  // auto: the dgrads over contractions of 7168 and 4096 ran 2-4% slower with the staged tile (its
  // mainloop has a stage less), the one over 2048 2-3% faster; the forwards level to 5% faster
  // (bench/NOTES.md).
  return choice == 1 || !dgrad || contraction <= 2048;
}

void grouped_forward_bf16_contiguous(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K,
                                     int64_t N, const int32_t* offsets, const int32_t* rows, int groups,
                                     int64_t total_rows, Stream stream) {
  if (contiguous_staged_epilogue(out, N, ld_out, false, K))
    return grouped_forward_bf16_contiguous_staged(a, b, out, ld_out, K, N, offsets, rows, groups, total_rows, stream);
  contiguous::run_bf16<cutlass::layout::RowMajor, contiguous::Bf16CutlassEpilogue, 12>(
      a, b, out, ld_out, K, N, offsets, rows, groups, total_rows, stream, "epx::grouped_gemm_forward");
}

}  // namespace epx::cuda
