// Random top-k routing for the EP and layout tests: per token, slot 0 to `hot` when it is set, every
// other slot masked (-1) with probability mask_p or else an expert the token has not chosen yet,
// drawn uniformly, Zipf-skewed (E * u^zipf, low experts hot), or uniformly among the experts
// [only_first, only_first + only_count). 64 draws that all hit chosen experts leave the slot masked.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace epx::testing {

struct RoutingDraw {
  int E = 16, K = 4;
  int hot = -1;
  double mask_p = 0.1;
  double zipf = 0;
  int only_first = -1, only_count = 0;
};

// Calls on_slot(t, k, e) for every slot of tokens [0, T) in order, drawing from u(rng) only, so a
// caller may interleave draws of its own (a weight per slot) and keep its sequence.
template <class Rng, class OnSlot>
void draw_routing(Rng& rng, std::uniform_real_distribution<double>& u, int T, const RoutingDraw& d, OnSlot&& on_slot) {
  for (int t = 0; t < T; ++t) {
    std::vector<char> used(d.E, 0);
    for (int k = 0; k < d.K; ++k) {
      int64_t e = -1;
      if (k == 0 && d.hot >= 0) {
        e = d.hot;
      } else if (u(rng) >= d.mask_p) {
        for (int tries = 0; tries < 64 && e < 0; ++tries) {
          int cand;
          if (d.only_first >= 0)
            cand = d.only_first + static_cast<int>(u(rng) * d.only_count);
          else
            cand = d.zipf > 0 ? static_cast<int>(std::pow(u(rng), d.zipf) * d.E) : static_cast<int>(u(rng) * d.E);
          cand = std::min(cand, d.E - 1);
          if (!used[cand]) e = cand;
        }
      }
      if (e >= 0) used[e] = 1;
      on_slot(t, k, e);
    }
  }
}

}  // namespace epx::testing
