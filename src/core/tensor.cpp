#include "epx/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/device_memory.h"
#include "epx/error.h"

namespace epx {

std::string Device::str() const { return kind == kCPU ? std::string("cpu") : "cuda:" + std::to_string(index); }

Shape::Shape(std::initializer_list<int64_t> dims) {
  require(static_cast<int>(dims.size()) <= kMaxDims, "epx::Shape", "has ", dims.size(), " dimensions, at most ",
          kMaxDims, " are supported");
  for (int64_t d : dims) {
    require(d >= 0, "epx::Shape", "dimension ", ndim_, " is ", d, ", expected >= 0");
    dims_[ndim_++] = d;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[i];
  return ndim_ ? n : 0;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < ndim_; ++i) os << (i ? ", " : "") << dims_[i];
  os << ']';
  return os.str();
}

TensorRef TensorRef::slice_rows(int64_t begin, int64_t end) const {
  require(ndim() >= 1 && begin >= 0 && begin <= end && end <= size(0), "epx::TensorRef::slice_rows", "rows [", begin,
          ", ", end, ") out of range for ", str());
  int64_t row = numel() / (size(0) ? size(0) : 1);
  Shape s = shape_;
  Shape out;
  switch (ndim()) {
    case 1: out = Shape{end - begin}; break;
    case 2: out = Shape{end - begin, s[1]}; break;
    case 3: out = Shape{end - begin, s[1], s[2]}; break;
    default: out = Shape{end - begin, s[1], s[2], s[3]}; break;
  }
  char* p = static_cast<char*>(data_) + static_cast<size_t>(begin * row) * dtype_size(dtype_);
  return TensorRef(size(0) ? p : data_, dtype_, out, device_);
}

TensorRef TensorRef::view(Shape shape) const {
  require(shape.numel() == numel(), "epx::TensorRef::view", "cannot view ", str(), " as ", shape.str());
  return TensorRef(data_, dtype_, shape, device_);
}

std::string TensorRef::str() const {
  return std::string(dtype_name(dtype_)) + shape_.str() + " on " + device_.str();
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  Tensor t;
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  void* p = nullptr;
  if (device.is_cpu()) {
    // 64-byte alignment: vector loads in the reference and pinned-copy friendliness.
    size_t padded = (bytes + 63) / 64 * 64;
    p = padded ? std::aligned_alloc(64, padded) : nullptr;
    if (padded && !p) throw Error(Status::kInternal, detail::concat("epx: host allocation of ", bytes, " bytes failed"));
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    p = detail::device_alloc(bytes, device.index);
    int idx = device.index;
    t.storage_ = std::shared_ptr<void>(p, [idx](void* q) { detail::device_free(q, idx); });
  }
  t.ref_ = TensorRef(p, dtype, shape, device);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  detail::memset_bytes(t.data(), device, 0, t.nbytes());
  return t;
}

Tensor Tensor::full(Shape shape, DType dtype, double value) {
  Tensor t = empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dtype, i, value);
  return t;
}

Tensor Tensor::wrap(const TensorRef& ref, std::shared_ptr<void> keepalive) {
  Tensor t;
  t.storage_ = std::move(keepalive);
  t.ref_ = ref;
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape(), dtype(), device);
  detail::copy_bytes(t.data(), device, data(), this->device(), nbytes());
  return t;
}

double Tensor::item(int64_t i) const {
  require(device().is_cpu(), "epx::Tensor::item", "tensor is on ", device().str(), ", expected cpu (call to(cpu) first)");
  require(i >= 0 && i < numel(), "epx::Tensor::item", "index ", i, " out of range for ", ref_.str());
  return load_as_double(data(), dtype(), i);
}

void copy(const TensorRef& src, const TensorRef& dst) {
  require(src.dtype() == dst.dtype() && src.numel() == dst.numel(), "epx::copy", "src is ", src.str(), ", dst is ",
          dst.str(), ", expected equal dtype and element count");
  detail::copy_bytes(dst.data(), dst.device(), src.data(), src.device(), src.nbytes());
}

}  // namespace epx
