// Built when CUTLASS was not found: the GPU grouped GEMMs report themselves unavailable and the
// ops that need them raise kNotSupported with that reason.
#include "cuda/gemm/grouped_gemm_cuda.h"
#include "epx/error.h"

namespace epx::cuda {

bool grouped_gemm_available() { return false; }

namespace {
[[noreturn]] void unavailable() {
  throw Error(Status::kNotSupported,
              "epx: this build has no GPU grouped GEMM (CUTLASS headers were not found at configure time)");
}
}  // namespace

void grouped_forward_bf16(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t, const int32_t*,
                          const int32_t*, int, int64_t, Stream, int64_t) {
  unavailable();
}
void grouped_forward_bf16_contiguous(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t, const int32_t*,
                                     const int32_t*, int, int64_t, Stream) {
  unavailable();
}
void grouped_dgrad_bf16(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t, const int32_t*,
                        const int32_t*, int, int64_t, Stream, int64_t) {
  unavailable();
}
void grouped_dgrad_bf16_contiguous(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t, const int32_t*,
                                   const int32_t*, int, int64_t, Stream) {
  unavailable();
}
void grouped_wgrad_bf16(GroupedOperand, GroupedOperand, float*, int64_t, int64_t, int64_t, const int32_t*,
                        const int32_t*, int, Stream, float) {
  unavailable();
}
void grouped_wgrad_bf16_out(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t, const int32_t*,
                            const int32_t*, int, Stream, float) {
  unavailable();
}
void grouped_wgrad_bf16_pingpong(GroupedOperand, GroupedOperand, float*, int64_t, int64_t, int64_t, const int32_t*,
                                 const int32_t*, int, Stream, float) {
  unavailable();
}
void grouped_wgrad_bf16_out_pingpong(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t, const int32_t*,
                                     const int32_t*, int, Stream, float) {
  unavailable();
}
void grouped_wgrad_bf16_out_nosource(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t, const int32_t*,
                                     const int32_t*, int, Stream) {
  unavailable();
}
void grouped_wgrad_bf16_out_pingpong_nosource(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t,
                                              const int32_t*, const int32_t*, int, Stream) {
  unavailable();
}
void grouped_wgrad_bf16_out_coop_tma(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t, const int32_t*,
                                     const int32_t*, int, Stream) {
  unavailable();
}
bool wgrad_coop_tma_supports(const void*, int64_t, int64_t) { return false; }
void grouped_wgrad_f32_pingpong_nosource(GroupedOperand, GroupedOperand, float*, int64_t, int64_t, int64_t,
                                         const int32_t*, const int32_t*, int, Stream) {
  unavailable();
}
void grouped_wgrad_bf16_out_cluster(GroupedOperand, GroupedOperand, void*, int64_t, int64_t, int64_t, const int32_t*,
                                    const int32_t*, int, Stream, float) {
  unavailable();
}
void grouped_forward_fp8_blockwise(const void*, const float*, const void*, const float*, void*, int64_t, int64_t,
                                   int64_t, const int32_t*, const int32_t*, int, int64_t, Stream) {
  unavailable();
}
void grouped_forward_fp8_blockwise_pingpong(const void*, const float*, const void*, const float*, void*, int64_t,
                                            int64_t, int64_t, const int32_t*, const int32_t*, int, Stream) {
  unavailable();
}
void grouped_forward_fp8_contiguous(const void*, const float*, const void*, const float*, void*, int64_t, int64_t,
                                    int64_t, const int32_t*, const int32_t*, int, int64_t, Stream) {
  unavailable();
}
ForwardGemmSchedule forward_gemm_schedule(int64_t, int64_t, int, int64_t) { return ForwardGemmSchedule::kCooperative; }
Fp8GemmSchedule fp8_gemm_schedule(int64_t, int, int64_t) { return Fp8GemmSchedule::kCooperative; }
std::vector<const char*> fp8_gemm_schedule_names() { return {"cooperative", "pingpong", "contiguous"}; }

}  // namespace epx::cuda
