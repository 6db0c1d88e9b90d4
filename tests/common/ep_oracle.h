// A brute-force oracle of the EP ops for tests: it sees every rank's data at once and builds the
// expert-major layout straight from its definition (sort the kept (source rank, token, slot) pairs
// of each expert), with none of the window / slot / offset machinery the backends use. Shared by
// the CPU tests of the host backend and the GPU tests of the NCCL backend.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "epx/dtype.h"
#include "epx/layout.h"

namespace epx::testing {

struct RankRouting {
  int num_tokens = 0;
  int topk = 0;
  std::vector<int32_t> routed;  // [T*K] kept expert or -1
};

struct ExpertMajorLayout {
  std::vector<int64_t> offsets;  // [Le+1]
  std::vector<int64_t> rows;     // [Le] unpadded
  // For every expert-major row in use: which (source rank, token, slot) it holds; -1 on padding.
  std::vector<int> src_rank, src_token, src_slot;
};

/// Layout of the rows rank `dest` receives, by definition.
inline ExpertMajorLayout oracle_layout(const std::vector<RankRouting>& ranks, int num_experts, int dest, int align) {
  const int R = static_cast<int>(ranks.size()), Le = num_experts / R;
  ExpertMajorLayout L;
  L.offsets.assign(Le + 1, 0);
  L.rows.assign(Le, 0);
  for (int j = 0; j < Le; ++j) {
    const int e = dest * Le + j;
    int64_t n = 0;
    for (int s = 0; s < R; ++s)
      for (int t = 0; t < ranks[s].num_tokens; ++t)
        for (int k = 0; k < ranks[s].topk; ++k)
          if (ranks[s].routed[t * ranks[s].topk + k] == e) {
            L.src_rank.push_back(s);
            L.src_token.push_back(t);
            L.src_slot.push_back(k);
            ++n;
          }
    L.rows[j] = n;
    const int64_t padded = round_up(n, align);
    for (int64_t p = n; p < padded; ++p) {
      L.src_rank.push_back(-1);
      L.src_token.push_back(-1);
      L.src_slot.push_back(-1);
    }
    L.offsets[j + 1] = L.offsets[j] + padded;
  }
  return L;
}

/// Row of (source s, token t, slot k) in rank dest's layout, or -1.
inline int64_t oracle_row(const ExpertMajorLayout& L, int s, int t, int k) {
  for (size_t r = 0; r < L.src_rank.size(); ++r)
    if (L.src_rank[r] == s && L.src_token[r] == t && L.src_slot[r] == k) return static_cast<int64_t>(r);
  return -1;
}

/// Kept routing by definition: validation already done; capacity per expert over (t, k) order or by
/// weight (descending, ties by position).
inline std::vector<int32_t> oracle_keep(const std::vector<int64_t>& ids, const std::vector<float>& w, int T, int K,
                                        int E, int capacity, DropPolicy policy) {
  std::vector<int32_t> out(ids.begin(), ids.end());
  if (capacity <= 0) return out;
  for (int e = 0; e < E; ++e) {
    std::vector<int> pairs;
    for (int p = 0; p < T * K; ++p)
      if (out[p] == e) pairs.push_back(p);
    if (static_cast<int>(pairs.size()) <= capacity) continue;
    if (policy == DropPolicy::kByProbability) {
      // selection sort by (weight desc, position asc): obviously correct, fine for test sizes
      for (size_t a = 0; a < pairs.size(); ++a)
        for (size_t b = a + 1; b < pairs.size(); ++b) {
          const float wa = std::isnan(w[pairs[a]]) ? -INFINITY : w[pairs[a]];
          const float wb = std::isnan(w[pairs[b]]) ? -INFINITY : w[pairs[b]];
          if (wb > wa || (wb == wa && pairs[b] < pairs[a])) std::swap(pairs[a], pairs[b]);
        }
    }
    for (size_t i = capacity; i < pairs.size(); ++i) out[pairs[i]] = -1;
  }
  return out;
}

}  // namespace epx::testing
