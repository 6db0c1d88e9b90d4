// Router: logits [T, E] -> top-k expert ids and weights, plus what the auxiliary losses need.
//
// Scores. softmax before top-k (score = softmax over E), softmax after top-k (select on the raw
// logits, weights = softmax over the K selected logits), or sigmoid (score = sigmoid(logit)).
// Selection. An optional expert bias b[E] is added to the scores for SELECTION only (DeepSeek-V3's
// aux-loss-free balancing); weights never see it. With num_groups G > 1 the E experts form G
// contiguous groups of E/G; a group's score is the sum of its two best selection scores (its best
// one when a group holds a single expert), the best `group_topk` groups are kept and the top-k
// is taken inside them. Ties go to the lower expert (and group) index, so routing is deterministic.
// Weights. score of each selected expert (no bias); optionally divided by their sum, then times
// routed_scaling_factor.
// Non-finite logits. A NaN logit makes that expert ineligible (probability 0, never selected); a
// row with fewer than K eligible experts gets -1 ("no expert", weight 0) in the remaining slots, so
// an all-NaN row is fully masked and contributes nothing to any loss. +-inf are treated as limits:
// softmax over a row whose maximum is +inf splits the mass evenly among the +inf entries.
// Losses (global over the EP/DP group: reduce two E-vectors, never gather logits):
//   aux = coeff * E / (K * T^2) * sum_e P_e * n_e,   P_e = sum_t p[t,e],  n_e = routed pairs,
//   where p is softmax(logits) for the softmax modes and s / sum(s) for sigmoid, n counts the
//   ACTUAL routing (grouped top-k and capacity dropping included) and T counts the tokens.
//   Sequence-level aux: the same per sequence of `seq_len` tokens, averaged over sequences.
//   z = coeff * mean_t(logsumexp(logits_t)^2).
#pragma once

#include <cstdint>

#include "epx/tensor.h"

namespace epx {

enum class ScoreFunction : uint8_t {
  kSoftmax,          // softmax over all experts, then top-k
  kSoftmaxAfterTopk, // top-k on logits, softmax over the k selected
  kSigmoid,
};
const char* score_function_name(ScoreFunction f);

enum class AuxLossType : uint8_t { kNone, kGlobalBatch, kSequence };

struct RouterConfig {
  int num_experts = 0;
  int topk = 0;
  ScoreFunction score_function = ScoreFunction::kSoftmax;
  int num_groups = 1;       // G; 1 = no grouped top-k
  int group_topk = 1;       // groups kept when G > 1
  bool normalize_weights = false;
  float routed_scaling_factor = 1.0f;
  bool use_expert_bias = false;
  AuxLossType aux_loss = AuxLossType::kNone;
  float aux_loss_coeff = 0.0f;
  int seq_len = 0;          // tokens per sequence for AuxLossType::kSequence
  float z_loss_coeff = 0.0f;

  /// Throws epx::Error naming the offending field.
  void validate(const char* fn) const;
};

/// Statistics of one forward: the only things the losses need from the logits. All of one float
/// dtype (fp32, or fp64 when the logits are fp64) so that one all-reduce over the group sums them.
/// S = 1 for the global-batch loss, T / seq_len for the sequence loss (sequences are rank-local,
/// so in that mode prob_sum and counts are NOT reduced over the group; scalars always may be).
struct RouterStats {
  TensorRef prob_sum;  // [S, E] sum over tokens of p[t, e]         (route_forward)
  TensorRef counts;    // [S, E] routed pairs kept per expert          (count_routed)
  TensorRef scalars;   // [2] {sum over tokens of logsumexp^2, tokens} (route_forward)
};

/// logits [T, E] fp32, bf16 or fp64; expert_bias [E] fp32 (given iff config.use_expert_bias).
/// Writes topk_idx [T, K] int32/int64, topk_weights [T, K] fp32 (fp64 for fp64 logits),
/// stats.prob_sum and stats.scalars. Rows are independent: no cross-token state.
void route_forward(const RouterConfig& config, const TensorRef& logits, const TensorRef& expert_bias,
                   const TensorRef& topk_idx, const TensorRef& topk_weights, const RouterStats& stats,
                   Stream stream = {});

/// stats.counts from the routing actually used (Handle::routed_experts(), -1 = none).
void count_routed(const RouterConfig& config, const TensorRef& routed_experts, const RouterStats& stats,
                  Stream stream = {});

/// losses [2] {aux, z} (fp32 or fp64, host or device) from stats (reduced over the group where the
/// loss is global). The aux loss is 0 when config.aux_loss is kNone, z when z_loss_coeff is 0.
void router_losses(const RouterConfig& config, const RouterStats& stats, const TensorRef& losses,
                   Stream stream = {});

/// d_logits [T, E] (logits' dtype) from d_topk_weights [T, K] and the loss seeds d_aux, d_z
/// (usually 1), with the same stats as the forward; topk_idx is route_forward's output.
void route_backward(const RouterConfig& config, const TensorRef& logits, const TensorRef& expert_bias,
                    const TensorRef& topk_idx, const TensorRef& d_topk_weights, const RouterStats& stats,
                    double d_aux, double d_z, const TensorRef& d_logits, Stream stream = {});

/// Aux-loss-free balancing (DeepSeek-V3): bias[e] += rate * sign(mean(counts) - counts[e]),
/// counts [E] reduced over the group.
void update_expert_bias(const TensorRef& expert_bias, const TensorRef& counts, float rate, Stream stream = {});

}  // namespace epx
