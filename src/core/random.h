// Counter-based random numbers: value = f(seed, stream, index) with no state, so a tensor can be
// filled identically whatever the order, the thread or the rank that fills it. Used to initialise
// parameters so that a layer sharded over R ranks holds the same experts as on one rank.
#pragma once

#include <cmath>
#include <cstdint>

// The same generator runs in GPU kernels (parameter initialisation on the device).
#if defined(__CUDACC__)
#define EPX_RANDOM_FN __host__ __device__ inline
#else
#define EPX_RANDOM_FN inline
#endif

namespace epx::detail {

EPX_RANDOM_FN uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Uniform in (0, 1), never 0 (safe for log).
EPX_RANDOM_FN double counter_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t h = splitmix64(splitmix64(seed ^ splitmix64(stream)) + index);
  return (static_cast<double>(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

/// Standard normal (Box-Muller over two independent counters).
EPX_RANDOM_FN double counter_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  const double u1 = counter_uniform(seed, stream, 2 * index), u2 = counter_uniform(seed, stream, 2 * index + 1);
  return ::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2);
}

}  // namespace epx::detail
