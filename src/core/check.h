// Argument validation shared by every public entry point. Messages follow one pattern:
// "<fn>: <arg> has <what it has>, expected <what it needs>", so a caller can fix the call
// from the message alone.
#pragma once

#include <initializer_list>
#include <string>
#include <utility>

#include "epx/error.h"
#include "epx/tensor.h"

namespace epx::detail {

/// `shape` entries < 0 match any extent. An undefined tensor fails with "is missing".
void check_tensor(const char* fn, const char* name, const TensorRef& t, std::initializer_list<int64_t> shape,
                  std::initializer_list<DType> dtypes);
/// Rows of the leading dimension must be at least `min_rows`.
void check_min_rows(const char* fn, const char* name, const TensorRef& t, int64_t min_rows);
/// Every defined tensor lives on `device`.
void check_device(const char* fn, const char* name, const TensorRef& t, Device device);
/// check_device over a list of (name, tensor) pairs.
void check_all_on(const char* fn, Device device, std::initializer_list<std::pair<const char*, const TensorRef*>> ts);
std::string dtype_list(std::initializer_list<DType> dtypes);

}  // namespace epx::detail
