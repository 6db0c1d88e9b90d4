// Functions that both the host and CUDA code call (layouts, index arithmetic).
#pragma once

#if defined(__CUDACC__)
#define EPX_HOST_DEVICE __host__ __device__
#else
#define EPX_HOST_DEVICE
#endif
