// Approximate special functions of the router kernels that trade the legacy kernel's bit-exact
// expf/logf for single MUFU instructions (wide and lean kernels). Accuracy (PTX ISA): ex2.approx
// within 2 ulp, rcp.approx within 1 ulp, lg2.approx within 2^-22 absolute near 1; .ftz flushes
// subnormal inputs and results to zero, which the callers' range checks make harmless.
#pragma once

namespace epx::cuda::router_kernels {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace epx::cuda::router_kernels
