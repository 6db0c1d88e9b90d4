// cuBLASLt is column-major; a row-major C [M, N] is the column-major C^T [N, M], so we ask it for
// C^T = op(B)^T . op(A)^T: the operands swap places and keep their transpose flags. One handle and
// one 32 MiB workspace per device, created once; the algorithm of each problem shape is chosen by
// the heuristic once and cached, so repeated calls do no host work beyond the launch.
#include "cuda/gemm/dense_gemm.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "cuda/common/cuda_check.h"
#include "epx/error.h"

namespace epx::cuda {
namespace {

void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(Status::kCudaError, detail::concat("epx: ", what, " failed: cuBLAS status ", static_cast<int>(s)));
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kF64: return CUDA_R_64F;
    default: throw Error(Status::kNotSupported, detail::concat("epx::gemm: dtype ", dtype_name(t), " on CUDA"));
  }
}

struct DeviceContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = size_t(32) << 20;
  std::map<std::tuple<int64_t, int64_t, int64_t, int, int, int, int, int>, cublasLtMatmulAlgo_t> algos;
};

DeviceContext& context() {
  static std::mutex mu;
  static std::map<int, DeviceContext> per_device;
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lk(mu);
  DeviceContext& c = per_device[dev];
  if (!c.handle) {
    lt_check(cublasLtCreate(&c.handle), "cublasLtCreate");
    EPX_CUDA_CHECK(cudaMalloc(&c.workspace, c.workspace_bytes));
  }
  return c;
}

}  // namespace

void dense_gemm(const TensorRef& a, const TensorRef& b, const TensorRef& c, bool transpose_a, bool transpose_b,
                bool accumulate, Stream stream) {
  const int64_t M = c.size(0), N = c.size(1), K = transpose_a ? a.size(0) : a.size(1);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) EPX_CUDA_CHECK(cudaMemsetAsync(c.data(), 0, c.nbytes(), to_cuda(stream)));
    return;
  }
  DeviceContext& ctx = context();
  const bool fp64 = a.dtype() == DType::kF64;
  const cublasComputeType_t compute = fp64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const cudaDataType_t scale_t = fp64 ? CUDA_R_64F : CUDA_R_32F;
  const cudaDataType_t in_t = cuda_type(a.dtype()), out_t = cuda_type(c.dtype());
  // Column-major view: A' = b (rows of b are its columns), B' = a.
  const cublasOperation_t op_a = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int64_t lda = b.size(1), ldb = a.size(1), ldc = N;
  cublasLtMatmulDesc_t desc;
  lt_check(cublasLtMatmulDescCreate(&desc, compute, scale_t), "cublasLtMatmulDescCreate");
  lt_check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a), "set TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b), "set TRANSB");
  cublasLtMatrixLayout_t la, lb, lc;
  // A' is N x K (op_a applied) stored as (op_a == N ? N x K : K x N) column-major with ld = lda.
  lt_check(cublasLtMatrixLayoutCreate(&la, in_t, op_a == CUBLAS_OP_N ? N : K, op_a == CUBLAS_OP_N ? K : N, lda),
           "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&lb, in_t, op_b == CUBLAS_OP_N ? K : M, op_b == CUBLAS_OP_N ? M : K, ldb),
           "layout B");
  lt_check(cublasLtMatrixLayoutCreate(&lc, out_t, N, M, ldc), "layout C");
  const auto key = std::make_tuple(M, N, K, static_cast<int>(a.dtype()), static_cast<int>(c.dtype()),
                                   static_cast<int>(transpose_a), static_cast<int>(transpose_b), static_cast<int>(accumulate));
  auto it = ctx.algos.find(key);
  if (it == ctx.algos.end()) {
    cublasLtMatmulPreference_t pref;
    lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
    lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ctx.workspace_bytes,
                                                  sizeof ctx.workspace_bytes),
             "preference workspace");
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    lt_check(cublasLtMatmulAlgoGetHeuristic(ctx.handle, desc, la, lb, lc, lc, pref, 1, &res, &found), "heuristic");
    cublasLtMatmulPreferenceDestroy(pref);
    require_status(found > 0, Status::kNotSupported, "epx::gemm", "cuBLASLt has no algorithm for [", M, ", ", K,
                   "] x [", K, ", ", N, "] ", dtype_name(a.dtype()), " -> ", dtype_name(c.dtype()));
    it = ctx.algos.emplace(key, res.algo).first;
  }
  const double one64 = 1.0, beta64 = accumulate ? 1.0 : 0.0;
  const float one32 = 1.0f, beta32 = accumulate ? 1.0f : 0.0f;
  const void* alpha = fp64 ? static_cast<const void*>(&one64) : static_cast<const void*>(&one32);
  const void* beta = fp64 ? static_cast<const void*>(&beta64) : static_cast<const void*>(&beta32);
  lt_check(cublasLtMatmul(ctx.handle, desc, alpha, b.data(), la, a.data(), lb, beta, c.data(), lc, c.data(), lc,
                          &it->second, ctx.workspace, ctx.workspace_bytes, to_cuda(stream)),
           "cublasLtMatmul");
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
}

}  // namespace epx::cuda
