// The split router kernel's top-8 networks (src/cuda/router/router_topk_network.cuh), run on the host:
// the sorting network on every 0/1 input (by the 0-1 principle, then on every input), and the running
// top-8 with its 9th against a sort of the whole stream, on random keys, many equal keys and zeros.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "cuda/router/router_topk_network.cuh"

namespace {

namespace rk = epx::cuda::router_kernels;

TEST(TopkNetwork, Sort8SortsEveryZeroOneInput) {
  for (uint32_t bits = 0; bits < 256; ++bits) {
    uint32_t k[8];
    for (int i = 0; i < 8; ++i) k[i] = (bits >> i) & 1u;
    rk::sort8_desc(k);
    EXPECT_TRUE(std::is_sorted(k, k + 8, std::greater<uint32_t>())) << "input bits " << bits;
    EXPECT_EQ(static_cast<int>(std::count(k, k + 8, 1u)), __builtin_popcount(bits)) << "input bits " << bits;
  }
}

TEST(TopkNetwork, BitonicCleanSortsEveryBitonicZeroOneInput) {
  // 0/1 bitonic sequences of 8: a run of ones inside zeros, or of zeros inside ones, at any place.
  for (int lo = 0; lo <= 8; ++lo)
    for (int hi = lo; hi <= 8; ++hi)
      for (uint32_t inside : {0u, 1u}) {
        uint32_t k[8];
        for (int i = 0; i < 8; ++i) k[i] = (i >= lo && i < hi) ? inside : 1u - inside;
        const int ones = static_cast<int>(std::count(k, k + 8, 1u));
        rk::bitonic8_desc(k);
        EXPECT_TRUE(std::is_sorted(k, k + 8, std::greater<uint32_t>())) << lo << " " << hi << " " << inside;
        EXPECT_EQ(static_cast<int>(std::count(k, k + 8, 1u)), ones);
      }
}

// Streams of n keys in blocks of 8 through top8_init8 / top8_add8, and pairs of such lists through
// top8_merge (the kernel's merge of two groups, and of two lanes), against the sorted stream.
TEST(TopkNetwork, RunningTop8KeepsTheLargestAndTheNinth) {
  std::mt19937_64 rng(12345);
  for (int trial = 0; trial < 3000; ++trial) {
    const int blocks = 1 + static_cast<int>(rng() % 8);
    const uint32_t range = trial % 3 == 0 ? 4u : trial % 3 == 1 ? 1000u : 0xffffffffu;  // many ties, some, none
    std::vector<uint32_t> all;
    auto run = [&](rk::Top8<uint32_t>& t) {
      for (int b = 0; b < blocks; ++b) {
        uint32_t k[8];
        for (int i = 0; i < 8; ++i) {
          k[i] = static_cast<uint32_t>(rng() % (static_cast<uint64_t>(range) + 1));
          all.push_back(k[i]);
        }
        if (b == 0)
          rk::top8_init8(t, k);
        else
          rk::top8_add8(t, k);
      }
    };
    rk::Top8<uint32_t> a, b;
    run(a);
    const bool pair = trial % 2 == 1;
    if (pair) {
      run(b);
      rk::top8_merge(a, b.a, b.a9);
    }
    std::vector<uint32_t> want = all;
    std::sort(want.begin(), want.end(), std::greater<uint32_t>());
    want.resize(9, 0u);  // a stream of 8 lets nothing go: the 9th is 0
    for (int i = 0; i < 8; ++i) EXPECT_EQ(a.a[i], want[i]) << "trial " << trial << " slot " << i;
    EXPECT_EQ(a.a9, want[8]) << "trial " << trial << " (the 9th)";
  }
}

// A dropped group's list (top8_keep_if(.., false)) merges as nothing; a kept one is left as it was.
TEST(TopkNetwork, DroppedListMergesAsEmpty) {
  rk::Top8<uint32_t> a, empty, kept;
  uint32_t k0[8] = {4, 6, 11, 10, 12, 13, 14, 15};
  rk::top8_init8(empty, k0);
  rk::top8_keep_if(empty, false);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(empty.a[i], 0u);
  EXPECT_EQ(empty.a9, 0u);
  uint32_t k[8] = {5, 9, 1, 7, 3, 3, 8, 2};
  rk::top8_init8(a, k);
  kept = a;
  rk::top8_keep_if(kept, true);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(kept.a[i], a.a[i]);
  EXPECT_EQ(kept.a9, a.a9);
  rk::top8_merge(empty, a.a, a.a9);
  const uint32_t want[8] = {9, 8, 7, 5, 3, 3, 2, 1};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(empty.a[i], want[i]);
  EXPECT_EQ(empty.a9, 0u);
}

}  // namespace
