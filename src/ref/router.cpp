// CPU reference of the router, forward and backward.
//
// Per row t (E experts, eligible = logit not NaN):
//   p      = softmax over the eligible logits (limits for infinities, see masked_softmax)
//   score  = p (softmax) | l (softmax after top-k) | sigmoid(l) (sigmoid)
//   sel    = score + bias (selection only; NaN ranks as -inf)
//   groups -> top-k over the surviving candidates, ties to the lower index
//   q_k    = score(e_k) | softmax over the selected logits (after top-k)
//   w_k    = scale * q_k / sum(q)   (the division only when normalising and sum(q) > 0)
//   p_aux  = p (softmax modes) | s / sum(s) (sigmoid), summed into prob_sum
// Backward (selection and counts are constants):
//   dq_k   = scale * (g_k - <g, q> / Q) / Q   when normalising, else scale * g_k
//   softmax Jacobian applied as p_j (G_j - <G, p>), sigmoid's as s_j (1 - s_j),
//   aux:  d/dl_j sum_e c_e p_aux_e with c_e = A * n_e,   z: 2 * lse * p_j * zc / T.
// A softmax whose logsumexp is infinite (a +inf logit, or only -inf ones) is constant around the
// point (every finite perturbation leaves it unchanged), so its Jacobian is taken as zero.
#include "ref/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "epx/error.h"

namespace epx::ref {
namespace {

int64_t read_id(const TensorRef& idx, int64_t i) {
  return idx.dtype() == DType::kI64 ? idx.ptr<int64_t>()[i] : idx.ptr<int32_t>()[i];
}

void write_id(const TensorRef& idx, int64_t i, int64_t v) {
  if (idx.dtype() == DType::kI64)
    idx.ptr<int64_t>()[i] = v;
  else
    idx.ptr<int32_t>()[i] = static_cast<int32_t>(v);
}

int64_t num_sequences(const RouterConfig& c, int64_t T) {
  return c.aux_loss == AuxLossType::kSequence ? T / c.seq_len : 1;
}

int64_t sequence_of(const RouterConfig& c, int64_t t) {
  return c.aux_loss == AuxLossType::kSequence ? t / c.seq_len : 0;
}

// Softmax over the entries with use[i] (the others get 0); returns the logsumexp. Infinities are
// taken as limits: with a +inf maximum the mass is split evenly among the +inf entries; when every
// used entry is -inf (the limit of equal logits) it is split evenly among all of them. Either way
// the returned logsumexp is that infinity, which the backward reads as "saturated".
template <class Acc>
Acc masked_softmax(const Acc* v, const char* use, int n, Acc* p) {
  const Acc inf = std::numeric_limits<Acc>::infinity();
  Acc m = -inf;
  for (int i = 0; i < n; ++i)
    if (use[i]) m = std::max(m, v[i]);
  if (std::isinf(m)) {
    int top = 0;
    for (int i = 0; i < n; ++i) top += use[i] && v[i] == m;
    for (int i = 0; i < n; ++i) p[i] = use[i] && v[i] == m ? Acc(1) / static_cast<Acc>(top) : Acc(0);
    return m;
  }
  Acc sum = 0;
  for (int i = 0; i < n; ++i) {
    p[i] = use[i] ? std::exp(v[i] - m) : Acc(0);
    sum += p[i];
  }
  for (int i = 0; i < n; ++i) p[i] /= sum;
  return m + std::log(sum);
}

template <class Acc>
Acc sigmoid(Acc x) {
  return Acc(1) / (Acc(1) + std::exp(-x));
}

// NaN selection scores (only a non-finite bias can produce one) rank like -inf, so the order is
// total and ties fall to the lower index.
template <class Acc>
Acc rank_key(Acc x) {
  return std::isnan(x) ? -std::numeric_limits<Acc>::infinity() : x;
}

// Everything one row needs, forward and backward.
template <class Acc>
struct RowState {
  int E = 0;
  std::vector<Acc> l, p, s, p_aux;
  std::vector<char> eligible;
  int n_eligible = 0;
  Acc lse = 0;
  Acc s_sum = 0;  // sigmoid: sum of s over the eligible experts

  explicit RowState(int num_experts)
      : E(num_experts), l(E), p(E), s(E), p_aux(E), eligible(E) {}

  void load(const RouterConfig& c, const TensorRef& logits, int64_t t) {
    load_row(logits.data(), logits.dtype(), t * E, E, l.data());
    n_eligible = 0;
    for (int e = 0; e < E; ++e) {
      eligible[e] = !std::isnan(l[e]);
      n_eligible += eligible[e];
    }
    if (n_eligible == 0) return;
    lse = masked_softmax(l.data(), eligible.data(), E, p.data());
    if (c.score_function == ScoreFunction::kSigmoid) {
      s_sum = 0;
      for (int e = 0; e < E; ++e) {
        s[e] = eligible[e] ? sigmoid(l[e]) : Acc(0);
        s_sum += s[e];
      }
      for (int e = 0; e < E; ++e) p_aux[e] = s_sum > 0 ? s[e] / s_sum : Acc(0);
    } else {
      p_aux = p;
    }
  }

  bool masked() const { return n_eligible == 0; }
  bool saturated() const { return !std::isfinite(lse); }

  // The score before bias: what the weights are made of (after top-k: the logit itself).
  Acc score(const RouterConfig& c, int e) const {
    switch (c.score_function) {
      case ScoreFunction::kSoftmax: return p[e];
      case ScoreFunction::kSigmoid: return s[e];
      default: return l[e];
    }
  }
};

// Expert ids for one row, in slot order; fewer than K candidates leave -1 at the end.
template <class Acc>
std::vector<int> select_row(const RouterConfig& c, const RowState<Acc>& row, const float* bias) {
  const int E = c.num_experts, K = c.topk;
  std::vector<Acc> key(E);
  for (int e = 0; e < E; ++e)
    key[e] = rank_key(row.score(c, e) + (bias ? static_cast<Acc>(bias[e]) : Acc(0)));
  std::vector<char> candidate(row.eligible);

  if (c.num_groups > 1) {
    const int G = c.num_groups, per = E / G;
    const Acc ninf = -std::numeric_limits<Acc>::infinity();
    std::vector<Acc> gscore(G);
    for (int g = 0; g < G; ++g) {
      Acc best1 = ninf, best2 = ninf;
      int n = 0;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        if (!row.eligible[e]) continue;
        ++n;
        if (key[e] > best1) {
          best2 = best1;
          best1 = key[e];
        } else if (key[e] > best2) {
          best2 = key[e];
        }
      }
      // n == 1 keeps best2 out of the sum (it would be -inf); -inf + +inf is NaN, ranked as -inf.
      gscore[g] = n == 0 ? ninf : n == 1 ? best1 : rank_key(best1 + best2);
    }
    std::vector<int> order(G);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gscore[a] > gscore[b]; });
    std::vector<char> kept(G, 0);
    for (int i = 0; i < c.group_topk; ++i) kept[order[i]] = 1;
    for (int e = 0; e < E; ++e) candidate[e] = candidate[e] && kept[e / per];
  }

  std::vector<int> order;
  for (int e = 0; e < E; ++e)
    if (candidate[e]) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
  std::vector<int> ids(K, -1);
  for (int k = 0; k < K && k < static_cast<int>(order.size()); ++k) ids[k] = order[k];
  return ids;
}

// Raw weights q_k of the valid slots (ids[k] >= 0); 0 for the others. Returns whether the
// softmax over the selected logits (after-top-k only) is saturated.
template <class Acc>
bool raw_weights(const RouterConfig& c, const RowState<Acc>& row, const std::vector<int>& ids, std::vector<Acc>& q) {
  const int K = static_cast<int>(ids.size());
  std::fill(q.begin(), q.end(), Acc(0));
  if (c.score_function != ScoreFunction::kSoftmaxAfterTopk) {
    for (int k = 0; k < K; ++k)
      if (ids[k] >= 0) q[k] = row.score(c, ids[k]);
    return false;
  }
  std::vector<Acc> v(K, Acc(0)), out(K);
  std::vector<char> use(K, 0);
  for (int k = 0; k < K; ++k)
    if (ids[k] >= 0) {
      v[k] = row.l[ids[k]];
      use[k] = 1;
    }
  if (std::none_of(use.begin(), use.end(), [](char u) { return u != 0; })) return false;
  const Acc lse = masked_softmax(v.data(), use.data(), K, out.data());
  q = out;
  return !std::isfinite(lse);
}

template <class Acc>
void forward_impl(const RouterConfig& c, const TensorRef& logits, const TensorRef& expert_bias,
                  const TensorRef& topk_idx, const TensorRef& topk_weights, const RouterStats& stats) {
  const int64_t T = logits.size(0);
  const int E = c.num_experts, K = c.topk;
  const int64_t S = num_sequences(c, T);
  const float* bias = expert_bias.defined() ? expert_bias.ptr<float>() : nullptr;
  std::vector<Acc> prob_sum(static_cast<size_t>(S * E), Acc(0));
  Acc lse_sq = 0, valid = 0;
  RowState<Acc> row(E);
  std::vector<Acc> q(K), w(K);

  for (int64_t t = 0; t < T; ++t) {
    row.load(c, logits, t);
    std::vector<int> ids(K, -1);
    std::fill(w.begin(), w.end(), Acc(0));
    if (!row.masked()) {
      ids = select_row(c, row, bias);
      raw_weights(c, row, ids, q);
      Acc sum = 0;
      for (int k = 0; k < K; ++k) sum += q[k];
      const bool divide = c.normalize_weights && sum > 0;
      for (int k = 0; k < K; ++k)
        w[k] = static_cast<Acc>(c.routed_scaling_factor) * (divide ? q[k] / sum : q[k]);

      Acc* ps = prob_sum.data() + sequence_of(c, t) * E;
      for (int e = 0; e < E; ++e) ps[e] += row.p_aux[e];
      lse_sq += row.lse * row.lse;
      valid += 1;
    }
    for (int k = 0; k < K; ++k) write_id(topk_idx, t * K + k, ids[k]);
    store_row(topk_weights.data(), topk_weights.dtype(), t * K, K, w.data());
  }
  if (stats.prob_sum.defined()) store_row(stats.prob_sum.data(), stats.prob_sum.dtype(), 0, S * E, prob_sum.data());
  if (stats.scalars.defined()) {
    const Acc sc[2] = {lse_sq, valid};
    store_row(stats.scalars.data(), stats.scalars.dtype(), 0, 2, sc);
  }
}

// Ids of row t checked against [-1, E) and for repeats; `fn` names the public op for the message.
std::vector<int> read_row_ids(const char* fn, const char* name, const TensorRef& idx, int64_t t, int E) {
  const int64_t K = idx.size(1);
  std::vector<int> ids(K);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t e = read_id(idx, t * K + k);
    require(e >= -1 && e < E, fn, name, "[", t, ", ", k, "] is ", e, ", expected -1 (masked) or an expert id in [0, ",
            E, ")");
    for (int64_t k2 = 0; k2 < k; ++k2)
      require(e < 0 || ids[k2] != e, fn, name, " row ", t, " names expert ", e, " twice (slots ", k2, " and ", k,
              "); each token picks distinct experts");
    ids[k] = static_cast<int>(e);
  }
  return ids;
}

template <class Acc>
void backward_impl(const RouterConfig& c, const TensorRef& logits, const TensorRef& topk_idx,
                   const TensorRef& d_topk_weights, const RouterStats& stats, double d_aux, double d_z,
                   const TensorRef& d_logits) {
  const char* fn = "epx::route_backward";
  const int64_t T = logits.size(0);
  const int E = c.num_experts, K = c.topk;
  const Acc scale = static_cast<Acc>(c.routed_scaling_factor);

  // The loss seeds folded with the constant factors of each loss; T (valid rows over the group)
  // and the counts come from the stats, exactly as router_losses reads them.
  Acc tokens = 0;
  if (stats.scalars.defined()) tokens = static_cast<Acc>(load_as_double(stats.scalars.data(), stats.scalars.dtype(), 1));
  Acc aux_scale = 0;
  if (c.aux_loss != AuxLossType::kNone && c.aux_loss_coeff > 0 && d_aux != 0) {
    const Acc base = static_cast<Acc>(d_aux) * static_cast<Acc>(c.aux_loss_coeff) * static_cast<Acc>(E) / static_cast<Acc>(K);
    if (c.aux_loss == AuxLossType::kGlobalBatch && tokens > 0) aux_scale = base / (tokens * tokens);
    if (c.aux_loss == AuxLossType::kSequence && T > 0) {
      const Acc L = static_cast<Acc>(c.seq_len);
      aux_scale = base / (L * L) / static_cast<Acc>(num_sequences(c, T));
    }
  }
  const Acc z_scale = c.z_loss_coeff > 0 && d_z != 0 && tokens > 0
                          ? static_cast<Acc>(d_z) * static_cast<Acc>(c.z_loss_coeff) / tokens
                          : Acc(0);
  std::vector<Acc> counts;
  if (aux_scale != 0) {
    counts.resize(stats.counts.numel());
    load_row(stats.counts.data(), stats.counts.dtype(), 0, stats.counts.numel(), counts.data());
  }

  RowState<Acc> row(E);
  std::vector<Acc> d(E), g(K), q(K), dq(K), G(E);
  for (int64_t t = 0; t < T; ++t) {
    row.load(c, logits, t);
    std::fill(d.begin(), d.end(), Acc(0));
    std::vector<int> ids = read_row_ids(fn, "topk_idx", topk_idx, t, E);
    if (row.masked()) {
      store_row(d_logits.data(), d_logits.dtype(), t * E, E, d.data());
      continue;
    }
    // A slot naming an ineligible (NaN) expert cannot come out of route_forward; it is treated
    // as masked so that NaN logits never receive gradient.
    for (int& e : ids)
      if (e >= 0 && !row.eligible[e]) e = -1;

    // Through the weights.
    if (d_topk_weights.defined()) {
      load_row(d_topk_weights.data(), d_topk_weights.dtype(), t * K, K, g.data());
      for (int k = 0; k < K; ++k)
        if (ids[k] < 0) g[k] = 0;
      const bool sel_saturated = raw_weights(c, row, ids, q);
      Acc Q = 0, gq = 0;
      for (int k = 0; k < K; ++k) {
        Q += q[k];
        gq += g[k] * q[k];
      }
      const bool divide = c.normalize_weights && Q > 0;
      for (int k = 0; k < K; ++k) dq[k] = divide ? scale * (g[k] - gq / Q) / Q : scale * g[k];
      for (int k = 0; k < K; ++k)
        if (ids[k] < 0) dq[k] = 0;

      switch (c.score_function) {
        case ScoreFunction::kSoftmax: {
          if (row.saturated()) break;
          std::fill(G.begin(), G.end(), Acc(0));
          for (int k = 0; k < K; ++k)
            if (ids[k] >= 0) G[ids[k]] += dq[k];
          Acc dot = 0;
          for (int e = 0; e < E; ++e) dot += G[e] * row.p[e];
          for (int e = 0; e < E; ++e) d[e] += row.p[e] * (G[e] - dot);
          break;
        }
        case ScoreFunction::kSigmoid:
          for (int k = 0; k < K; ++k)
            if (ids[k] >= 0) d[ids[k]] += dq[k] * row.s[ids[k]] * (Acc(1) - row.s[ids[k]]);
          break;
        case ScoreFunction::kSoftmaxAfterTopk: {
          if (sel_saturated) break;
          Acc dot = 0;
          for (int k = 0; k < K; ++k) dot += q[k] * dq[k];
          for (int k = 0; k < K; ++k)
            if (ids[k] >= 0) d[ids[k]] += q[k] * (dq[k] - dot);
          break;
        }
      }
    }

    // Aux loss: d/dl of sum_e c_e p_aux[e] with c_e = aux_scale * n[s, e].
    if (aux_scale != 0) {
      const Acc* n = counts.data() + sequence_of(c, t) * E;
      Acc dot = 0;
      for (int e = 0; e < E; ++e) dot += aux_scale * n[e] * row.p_aux[e];
      if (c.score_function == ScoreFunction::kSigmoid) {
        if (row.s_sum > 0)
          for (int e = 0; e < E; ++e)
            d[e] += row.s[e] * (Acc(1) - row.s[e]) * (aux_scale * n[e] - dot) / row.s_sum;
      } else if (!row.saturated()) {
        for (int e = 0; e < E; ++e) d[e] += row.p[e] * (aux_scale * n[e] - dot);
      }
    }

    // z loss: d (lse^2) / dl = 2 lse softmax(l).
    if (z_scale != 0 && !row.saturated())
      for (int e = 0; e < E; ++e) d[e] += z_scale * Acc(2) * row.lse * row.p[e];

    for (int e = 0; e < E; ++e)
      if (!row.eligible[e]) d[e] = 0;
    store_row(d_logits.data(), d_logits.dtype(), t * E, E, d.data());
  }
}

template <class Acc>
void losses_impl(const RouterConfig& c, const RouterStats& stats, const TensorRef& losses) {
  const int E = c.num_experts, K = c.topk;
  auto at = [](const TensorRef& t, int64_t i) { return static_cast<Acc>(load_as_double(t.data(), t.dtype(), i)); };
  const Acc tokens = stats.scalars.defined() ? at(stats.scalars, 1) : Acc(0);
  const Acc factor = static_cast<Acc>(c.aux_loss_coeff) * static_cast<Acc>(E) / static_cast<Acc>(K);

  Acc aux = 0;
  if (c.aux_loss == AuxLossType::kGlobalBatch && c.aux_loss_coeff > 0 && tokens > 0) {
    Acc sum = 0;
    for (int e = 0; e < E; ++e) sum += at(stats.prob_sum, e) * at(stats.counts, e);
    aux = factor / (tokens * tokens) * sum;
  } else if (c.aux_loss == AuxLossType::kSequence && c.aux_loss_coeff > 0 && stats.prob_sum.size(0) > 0) {
    const int64_t S = stats.prob_sum.size(0);
    const Acc L = static_cast<Acc>(c.seq_len);
    Acc total = 0;
    for (int64_t s = 0; s < S; ++s) {
      Acc sum = 0;
      for (int e = 0; e < E; ++e) sum += at(stats.prob_sum, s * E + e) * at(stats.counts, s * E + e);
      total += factor / (L * L) * sum;
    }
    aux = total / static_cast<Acc>(S);
  }
  Acc z = 0;
  if (c.z_loss_coeff > 0 && tokens > 0) z = static_cast<Acc>(c.z_loss_coeff) * at(stats.scalars, 0) / tokens;
  const Acc out[2] = {aux, z};
  store_row(losses.data(), losses.dtype(), 0, 2, out);
}

template <class Acc>
void count_impl(const RouterConfig& c, const TensorRef& routed, const RouterStats& stats) {
  const int64_t T = routed.size(0), K = routed.size(1);
  const int E = c.num_experts;
  std::vector<Acc> counts(static_cast<size_t>(stats.counts.numel()), Acc(0));
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<int> ids = read_row_ids("epx::count_routed", "routed_experts", routed, t, E);
    for (int64_t k = 0; k < K; ++k)
      if (ids[k] >= 0) counts[sequence_of(c, t) * E + ids[k]] += 1;
  }
  store_row(stats.counts.data(), stats.counts.dtype(), 0, stats.counts.numel(), counts.data());
}

}  // namespace

void route_forward(const RouterConfig& config, const TensorRef& logits, const TensorRef& expert_bias,
                   const TensorRef& topk_idx, const TensorRef& topk_weights, const RouterStats& stats) {
  if (logits.dtype() == DType::kF64)
    forward_impl<double>(config, logits, expert_bias, topk_idx, topk_weights, stats);
  else
    forward_impl<float>(config, logits, expert_bias, topk_idx, topk_weights, stats);
}

void count_routed(const RouterConfig& config, const TensorRef& routed_experts, const RouterStats& stats) {
  if (stats.counts.dtype() == DType::kF64)
    count_impl<double>(config, routed_experts, stats);
  else
    count_impl<float>(config, routed_experts, stats);
}

void router_losses(const RouterConfig& config, const RouterStats& stats, const TensorRef& losses) {
  const TensorRef& any = stats.scalars.defined() ? stats.scalars : stats.prob_sum;
  if (any.defined() && any.dtype() == DType::kF64)
    losses_impl<double>(config, stats, losses);
  else
    losses_impl<float>(config, stats, losses);
}

void route_backward(const RouterConfig& config, const TensorRef& logits, const TensorRef& topk_idx,
                    const TensorRef& d_topk_weights, const RouterStats& stats, double d_aux, double d_z,
                    const TensorRef& d_logits) {
  if (logits.dtype() == DType::kF64)
    backward_impl<double>(config, logits, topk_idx, d_topk_weights, stats, d_aux, d_z, d_logits);
  else
    backward_impl<float>(config, logits, topk_idx, d_topk_weights, stats, d_aux, d_z, d_logits);
}

void update_expert_bias(const TensorRef& expert_bias, const TensorRef& counts, float rate) {
  const int64_t E = expert_bias.numel();
  std::vector<double> n(E);
  load_row(counts.data(), counts.dtype(), 0, E, n.data());
  // sign(mean - n_e) = sign(sum - E * n_e): no division, so equal loads give exactly 0.
  double sum = 0;
  for (double v : n) sum += v;
  float* b = expert_bias.ptr<float>();
  for (int64_t e = 0; e < E; ++e) {
    const double diff = sum - static_cast<double>(E) * n[e];
    const float sign = diff > 0 ? 1.0f : diff < 0 ? -1.0f : 0.0f;
    b[e] += rate * sign;
  }
}

}  // namespace epx::ref
