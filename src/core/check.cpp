#include "core/check.h"

#include <sstream>

namespace epx::detail {

std::string dtype_list(std::initializer_list<DType> dtypes) {
  std::ostringstream os;
  int i = 0;
  for (DType d : dtypes) os << (i++ ? (i == static_cast<int>(dtypes.size()) ? " or " : ", ") : "") << dtype_name(d);
  return os.str();
}

static std::string shape_pattern(std::initializer_list<int64_t> shape) {
  std::ostringstream os;
  os << '[';
  int i = 0;
  for (int64_t d : shape) {
    if (i++) os << ", ";
    if (d < 0) os << '*'; else os << d;
  }
  os << ']';
  return os.str();
}

void check_tensor(const char* fn, const char* name, const TensorRef& t, std::initializer_list<int64_t> shape,
                  std::initializer_list<DType> dtypes) {
  require(t.defined(), fn, name, " is missing (expected a tensor of shape ", shape_pattern(shape), ")");
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok |= (d == t.dtype());
  require(dtype_ok, fn, name, " has dtype ", dtype_name(t.dtype()), ", expected ", dtype_list(dtypes));
  bool shape_ok = t.ndim() == static_cast<int>(shape.size());
  int i = 0;
  for (int64_t d : shape) {
    if (shape_ok && d >= 0 && t.size(i) != d) shape_ok = false;
    ++i;
  }
  require(shape_ok, fn, name, " has shape ", t.shape().str(), ", expected ", shape_pattern(shape));
  require(t.numel() == 0 || t.data() != nullptr, fn, name, " has a null data pointer for ", t.numel(), " elements");
}

void check_min_rows(const char* fn, const char* name, const TensorRef& t, int64_t min_rows) {
  require(t.ndim() >= 1 && t.size(0) >= min_rows, fn, name, " has ", t.ndim() >= 1 ? t.size(0) : 0,
          " rows, expected at least ", min_rows, " (the group's recv capacity)");
}

void check_device(const char* fn, const char* name, const TensorRef& t, Device device) {
  if (!t.defined()) return;
  require(t.device() == device, fn, name, " is on ", t.device().str(), ", expected ", device.str());
}

void check_all_on(const char* fn, Device device, std::initializer_list<std::pair<const char*, const TensorRef*>> ts) {
  for (auto& [name, t] : ts) check_device(fn, name, *t, device);
}

}  // namespace epx::detail
