#include "core/gemm_sm_limit.h"

namespace epx::detail {
namespace {
thread_local int t_gemm_sm_limit = 0;
}

int gemm_sm_limit() { return t_gemm_sm_limit; }

GemmSmLimit::GemmSmLimit(int sms) : saved_(t_gemm_sm_limit) { t_gemm_sm_limit = sms > 0 ? sms : 0; }
GemmSmLimit::~GemmSmLimit() { t_gemm_sm_limit = saved_; }

}  // namespace epx::detail
