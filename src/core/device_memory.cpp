#include "core/device_memory.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

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

int device_sm_count(int device) {
  int n = 0;
  cuda_check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
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

void copy_async(const TensorRef& src, const TensorRef& dst, Stream stream) {
  require(src.nbytes() == dst.nbytes(), "epx::copy_async", "src is ", src.str(), ", dst is ", dst.str(),
          ", expected equal byte counts");
  if (src.nbytes() == 0) return;
  if (src.device().is_cpu() && dst.device().is_cpu()) {
    std::memcpy(dst.data(), src.data(), src.nbytes());
    return;
  }
  cuda_check(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault,
                             static_cast<cudaStream_t>(stream.handle)),
             "cudaMemcpyAsync");
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

bool profiling_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("EPX_PROFILE");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

namespace {
thread_local std::string t_phase_prefix;
struct PhaseEvent {
  cudaEvent_t event;
  std::string name;  // the phase this event ends ("" = a start)
};
struct Profile {
  std::mutex mu;
  std::map<cudaStream_t, std::vector<PhaseEvent>> marks;
};
Profile& profile() {
  static Profile p;
  return p;
}
}  // namespace

void phase_mark(Stream stream, const char* name) {
  if (!profiling_enabled()) return;
  cudaEvent_t e = nullptr;
  cuda_check(cudaEventCreate(&e), "cudaEventCreate");
  cuda_check(cudaEventRecord(e, static_cast<cudaStream_t>(stream.handle)), "cudaEventRecord");
  Profile& p = profile();
  std::lock_guard<std::mutex> lk(p.mu);
  p.marks[static_cast<cudaStream_t>(stream.handle)].push_back({e, *name ? t_phase_prefix + name : std::string()});
}

std::string phase_report() {
  if (!profiling_enabled()) return "{}";
  Profile& p = profile();
  std::lock_guard<std::mutex> lk(p.mu);
  std::vector<std::pair<std::string, double>> order;  // first-seen order of the phases
  for (auto& [stream, events] : p.marks) {
    for (size_t i = 0; i < events.size(); ++i) {
      cuda_check(cudaEventSynchronize(events[i].event), "cudaEventSynchronize");
      if (i > 0 && !events[i].name.empty()) {
        float ms = 0;
        cuda_check(cudaEventElapsedTime(&ms, events[i - 1].event, events[i].event), "cudaEventElapsedTime");
        auto it = std::find_if(order.begin(), order.end(), [&](const auto& o) { return o.first == events[i].name; });
        if (it == order.end()) order.emplace_back(events[i].name, ms);
        else it->second += ms;
      }
    }
    for (auto& e : events) cudaEventDestroy(e.event);
  }
  p.marks.clear();
  std::string out = "{";
  char buf[64];
  for (size_t i = 0; i < order.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%.3f", order[i].second);
    out += (i ? ",\"" : "\"") + order[i].first + "\":" + buf;
  }
  return out + "}";
}

PhasePrefix::PhasePrefix(const char* prefix) : saved_(t_phase_prefix) { t_phase_prefix += prefix; }
PhasePrefix::~PhasePrefix() { t_phase_prefix = saved_; }

#else  // CPU-only build

bool cuda_backend_built() { return false; }
int cuda_device_count() { return 0; }
int device_sm_count(int) {
  throw Error(Status::kNotSupported,
              "epx: a device's SM count was asked for but epx was built without the CUDA backend");
}

void* device_alloc(size_t, int) {
  throw Error(Status::kNotSupported, "epx: device memory requested but epx was built without the CUDA backend");
}
void device_free(void*, int) noexcept {}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (!dst_device.is_cpu() || !src_device.is_cpu())
    throw Error(Status::kNotSupported, "epx: device copy requested but epx was built without the CUDA backend");
  if (bytes) std::memcpy(dst, src, bytes);
}

void copy_async(const TensorRef& src, const TensorRef& dst, Stream) {
  require(src.nbytes() == dst.nbytes(), "epx::copy_async", "src is ", src.str(), ", dst is ", dst.str(),
          ", expected equal byte counts");
  require_status(src.device().is_cpu() && dst.device().is_cpu(), Status::kNotSupported, "epx::copy_async",
                 "device copy requested but epx was built without the CUDA backend");
  if (src.nbytes()) std::memcpy(dst.data(), src.data(), src.nbytes());
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
bool profiling_enabled() { return false; }
void phase_mark(Stream, const char*) {}
PhasePrefix::PhasePrefix(const char*) {}
PhasePrefix::~PhasePrefix() = default;
std::string phase_report() { return "{}"; }

#endif

}  // namespace epx::detail
