// Top-8 of unsigned keys held in one thread's registers, by sorting networks (no data-dependent
// branches: every thread of a warp runs the same instructions whatever its keys). The split router
// kernel (router_split_kernels.cuh) keeps, per thread, the 8 largest keys seen so far and the largest
// one it let go (the 9th), which decides whether the 8th pick is certain. Host-callable too, so that
// a CPU test checks the networks on every 0/1 input (the 0-1 principle) and on random keys.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace epx::cuda::router_kernels {

template <class T>
EPX_HOST_DEVICE inline T topk_max(T a, T b) {
  return a > b ? a : b;
}
template <class T>
EPX_HOST_DEVICE inline T topk_min(T a, T b) {
  return a < b ? a : b;
}

// Compare-exchange: the larger key to a.
template <class T>
EPX_HOST_DEVICE inline void topk_ce(T& a, T& b) {
  const T hi = topk_max(a, b);
  b = topk_min(a, b);
  a = hi;
}

// Sorts 8 keys in descending order: the 19-comparator, depth-6 network.
template <class T>
EPX_HOST_DEVICE inline void sort8_desc(T (&k)[8]) {
  topk_ce(k[0], k[2]), topk_ce(k[1], k[3]), topk_ce(k[4], k[6]), topk_ce(k[5], k[7]);
  topk_ce(k[0], k[4]), topk_ce(k[1], k[5]), topk_ce(k[2], k[6]), topk_ce(k[3], k[7]);
  topk_ce(k[0], k[1]), topk_ce(k[2], k[3]), topk_ce(k[4], k[5]), topk_ce(k[6], k[7]);
  topk_ce(k[2], k[4]), topk_ce(k[3], k[5]);
  topk_ce(k[1], k[4]), topk_ce(k[3], k[6]);
  topk_ce(k[1], k[2]), topk_ce(k[3], k[4]), topk_ce(k[5], k[6]);
}

// A bitonic sequence of 8 (descending then ascending, or the reverse) into descending order.
template <class T>
EPX_HOST_DEVICE inline void bitonic8_desc(T (&k)[8]) {
  topk_ce(k[0], k[4]), topk_ce(k[1], k[5]), topk_ce(k[2], k[6]), topk_ce(k[3], k[7]);
  topk_ce(k[0], k[2]), topk_ce(k[1], k[3]), topk_ce(k[4], k[6]), topk_ce(k[5], k[7]);
  topk_ce(k[0], k[1]), topk_ce(k[2], k[3]), topk_ce(k[4], k[5]), topk_ce(k[6], k[7]);
}

// A running top-8: a[0] >= ... >= a[7], and a9, the largest key seen and not kept (0: none).
template <class T>
struct Top8 {
  T a[8];
  T a9;
};

// t as it is where keep, else empty (every key 0), without a branch.
template <class T>
EPX_HOST_DEVICE inline void top8_keep_if(Top8<T>& t, bool keep) {
  const T mask = keep ? ~T(0) : T(0);
  for (int i = 0; i < 8; ++i) t.a[i] &= mask;
  t.a9 &= mask;
}

// t := the top 8 of t and b (both sorted descending), b9 being what b let go. The larger of a[i] and
// b[7 - i] are the 8 largest of the 16 (a bitonic sequence, sorted by 12 comparators), the smaller
// ones are what is let go.
template <class T>
EPX_HOST_DEVICE inline void top8_merge(Top8<T>& t, const T (&b)[8], T b9) {
  T lo[8];
  for (int i = 0; i < 8; ++i) {
    const T x = t.a[i], y = b[7 - i];
    t.a[i] = topk_max(x, y);
    lo[i] = topk_min(x, y);
  }
  const T l01 = topk_max(lo[0], lo[1]), l23 = topk_max(lo[2], lo[3]);
  const T l45 = topk_max(lo[4], lo[5]), l67 = topk_max(lo[6], lo[7]);
  t.a9 = topk_max(topk_max(topk_max(l01, l23), topk_max(l45, l67)), topk_max(t.a9, b9));
  bitonic8_desc(t.a);
}

// t := 8 unsorted keys, sorted (the first block of a running top-8: no merge needed).
template <class T>
EPX_HOST_DEVICE inline void top8_init8(Top8<T>& t, const T (&k)[8]) {
  for (int i = 0; i < 8; ++i) t.a[i] = k[i];
  t.a9 = T(0);
  sort8_desc(t.a);
}

// Adds 8 unsorted keys to t.
template <class T>
EPX_HOST_DEVICE inline void top8_add8(Top8<T>& t, T (&k)[8]) {
  sort8_desc(k);
  top8_merge(t, k, T(0));
}

}  // namespace epx::cuda::router_kernels
