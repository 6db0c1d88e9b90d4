// The XLA FFI handlers of the epx ops, as a submodule of epx._C (built when JAX's FFI headers are
// found at configure time).
#pragma once

#include <nanobind/nanobind.h>

namespace epx::jax {
void bind_jax_ffi(nanobind::module_& m);
}
