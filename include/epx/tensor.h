// Tensors. TensorRef is a non-owning, contiguous, row-major view (pointer, dtype, shape, device):
// what every op takes and what the C ABI and framework bindings wrap without copying.
// Tensor owns its storage (host memory, or device memory when the CUDA backend is built) and
// hands out TensorRefs. No CUDA type appears here: the CPU-only build includes this header.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "epx/dtype.h"

namespace epx {

struct Device {
  enum Kind : uint8_t { kCPU, kCUDA };
  Kind kind = kCPU;
  int index = 0;

  static Device cpu() { return Device{kCPU, 0}; }
  static Device cuda(int i) { return Device{kCUDA, i}; }
  bool is_cpu() const { return kind == kCPU; }
  bool is_cuda() const { return kind == kCUDA; }
  bool operator==(const Device& o) const { return kind == o.kind && (kind == kCPU || index == o.index); }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;
};

/// A CUDA stream as an opaque handle (cudaStream_t), so this header needs no CUDA include.
/// The default (null) is the legacy default stream; CPU ops ignore it.
struct Stream {
  void* handle = nullptr;
};

constexpr int kMaxDims = 4;

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  int ndim() const { return ndim_; }
  int64_t operator[](int d) const { return dims_[d]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "[4096, 7168]"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

class TensorRef {
 public:
  TensorRef() = default;
  TensorRef(void* data, DType dtype, Shape shape, Device device = Device::cpu())
      : data_(data), dtype_(dtype), shape_(shape), device_(device) {}

  void* data() const { return data_; }
  template <class T>
  T* ptr() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return shape_.ndim(); }
  int64_t size(int d) const { return shape_[d]; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  Device device() const { return device_; }
  /// A default-constructed ref means "not given" for optional arguments.
  bool defined() const { return shape_.ndim() > 0 || data_ != nullptr; }
  /// Rows [begin, end) of the leading dimension.
  TensorRef slice_rows(int64_t begin, int64_t end) const;
  /// Same storage, other shape with the same element count.
  TensorRef view(Shape shape) const;
  std::string str() const;  // "bf16[4096, 7168] on cuda:0"

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Shape shape_;
  Device device_;
};

/// Owning tensor. Copying shares the storage (like a shared_ptr); use clone() for a deep copy.
class Tensor {
 public:
  Tensor() = default;
  /// Uninitialised storage. Device memory needs the CUDA backend (Error kNotSupported otherwise).
  static Tensor empty(Shape shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::cpu());
  /// Host tensor filled with `value` (rounded to dtype).
  static Tensor full(Shape shape, DType dtype, double value);
  /// A tensor over memory someone else owns; `keepalive` (may be null) is held as long as any copy.
  static Tensor wrap(const TensorRef& ref, std::shared_ptr<void> keepalive);

  const TensorRef& ref() const { return ref_; }
  operator const TensorRef&() const { return ref_; }
  void* data() const { return ref_.data(); }
  template <class T>
  T* ptr() const { return ref_.ptr<T>(); }
  DType dtype() const { return ref_.dtype(); }
  const Shape& shape() const { return ref_.shape(); }
  int64_t size(int d) const { return ref_.size(d); }
  int64_t numel() const { return ref_.numel(); }
  size_t nbytes() const { return ref_.nbytes(); }
  Device device() const { return ref_.device(); }
  bool defined() const { return storage_ != nullptr || ref_.defined(); }

  /// Host copy of any tensor / copy to another device (synchronous; not for hot paths).
  Tensor to(Device device) const;
  Tensor clone() const { return to(device()); }
  /// Element i as double (host tensors only; for tests and tools).
  double item(int64_t i) const;

 private:
  std::shared_ptr<void> storage_;
  TensorRef ref_;
};

/// Synchronous copy between any two refs of equal dtype and numel (host<->device included).
void copy(const TensorRef& src, const TensorRef& dst);

}  // namespace epx
