#include "core/device_memory.h"

#include <cstring>

#include "epx/error.h"

#ifdef EPX_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace epx::detail {

#ifdef EPX_HAVE_CUDA

static void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(Status::kCudaError, detail::concat("epx: ", what, " failed: ", cudaGetErrorString(e)));
}

namespace {
struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous);
    if (previous != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (previous >= 0 && now != previous) cudaSetDevice(previous);
  }
};
}  // namespace

bool cuda_backend_built() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

void* device_alloc(size_t bytes, int device) {
  if (bytes == 0) return nullptr;
  int previous = -1;
  cudaGetDevice(&previous);
  void* p = nullptr;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMalloc(&p, bytes);
  if (previous >= 0) cudaSetDevice(previous);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw Error(Status::kCudaError, detail::concat("epx: cannot allocate ", bytes, " bytes on cuda:", device, ": ",
                                                   cudaGetErrorString(e)));
  }
  return p;
}

void device_free(void* ptr, int device) noexcept {
  if (!ptr) return;
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  cudaFree(ptr);
  if (previous >= 0) cudaSetDevice(previous);
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
}

void memset_bytes(void* dst, Device device, int value, size_t bytes) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    std::memset(dst, value, bytes);
    return;
  }
  DeviceGuard g(device.index);
  cuda_check(cudaMemset(dst, value, bytes), "cudaMemset");
}

void device_synchronize(int device) {
  DeviceGuard g(device);
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

size_t device_memory_used(int device) {
  DeviceGuard g(device);
  size_t free_b = 0, total_b = 0;
  cuda_check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return total_b - free_b;
}

#else  // CPU-only build

bool cuda_backend_built() { return false; }
int cuda_device_count() { return 0; }

void* device_alloc(size_t, int) {
  throw Error(Status::kNotSupported, "epx: device memory requested but epx was built without the CUDA backend");
}
void device_free(void*, int) noexcept {}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (!dst_device.is_cpu() || !src_device.is_cpu())
    throw Error(Status::kNotSupported, "epx: device copy requested but epx was built without the CUDA backend");
  if (bytes) std::memcpy(dst, src, bytes);
}

void memset_bytes(void* dst, Device device, int value, size_t bytes) {
  if (!device.is_cpu())
    throw Error(Status::kNotSupported, "epx: device memset requested but epx was built without the CUDA backend");
  if (bytes) std::memset(dst, value, bytes);
}

void device_synchronize(int) {
  throw Error(Status::kNotSupported, "epx: device synchronize requested but epx was built without the CUDA backend");
}
size_t device_memory_used(int) { return 0; }

#endif

}  // namespace epx::detail
