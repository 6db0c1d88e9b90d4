// Router: logits [T, E] -> top-k expert ids and weights, plus what the auxiliary losses need.
//
// Scores. softmax before top-k (score = softmax over E), softmax after top-k (select on the raw
// logits, weights = softmax over the K selected logits), or sigmoid (score = sigmoid(logit)).
// Selection. An optional expert bias b[E] is added to the scores for SELECTION only (DeepSeek-V3's
// aux-loss-free balancing); weights never see it. With num_groups G > 1 the E experts form G
// contiguous groups of E/G; a group's score is the sum of its two best selection scores (its best
// one when a group holds a single eligible expert, -inf when it holds none), the best `group_topk`
// groups are kept and the top-k is taken inside them. Ties go to the lower expert (and group)
// index, so routing is deterministic; the K slots are in order of decreasing selection score.
// A NaN selection score (only a non-finite bias can make one) ranks as -inf.
// Weights. score of each selected expert (no bias); optionally divided by their sum (when that sum
// is > 0), then times routed_scaling_factor.
// Non-finite logits. A NaN logit makes that expert ineligible (probability 0, never selected); a
// row with fewer than K eligible experts gets -1 ("no expert", weight 0) in the remaining slots, so
// an all-NaN row is fully masked and contributes nothing to any loss. +-inf are treated as limits:
// softmax over a row whose maximum is +inf splits the mass evenly among the +inf entries (and
// among all of them when every eligible logit is -inf); such a row's logsumexp is infinite, its
// softmax is constant around it, so it passes no gradient through a softmax.
// Losses (global over the EP/DP group: reduce two E-vectors, never gather logits):
//   aux = coeff * E / (K * T^2) * sum_e P_e * n_e,   P_e = sum_t p[t,e],  n_e = routed pairs,
//   where p is softmax(logits) for both softmax modes and s / sum(s) for sigmoid (each over the
//   row's eligible experts), n counts the ACTUAL routing (grouped top-k and capacity dropping
//   included) and T counts the valid tokens (rows with at least one eligible logit).
//   Sequence-level aux: the same per sequence of `seq_len` tokens (T / seq_len sequences, T a
//   multiple of seq_len), with seq_len in place of T, averaged over the sequences.
//   z = coeff * sum over valid t of logsumexp(eligible logits_t)^2 / T (whatever the score
//   function). Each loss is 0 when its coefficient is 0 or when there is no token.
// Backward. Selection, counts and T are constants (top-k is piecewise constant); the bias gets no
// gradient; masked slots, NaN logits and masked rows get zero gradient.
// Dtypes. logits fp32, bf16 or fp64; ids int32 or int64; the float tensors (topk_weights,
// d_topk_weights, stats) are fp32, or fp64 when the logits are fp64 (finite-difference checks);
// d_logits has the logits' dtype; expert_bias fp32. Arithmetic is fp32 (fp64 for fp64 logits).
// T = 0 is valid: outputs are empty and the stats are written as zeros.
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
/// The ops OVERWRITE what they write (no accumulation across calls). A tensor is required exactly
/// where the config's losses use it: prob_sum and counts when aux_loss != kNone, scalars when
/// aux_loss == kGlobalBatch or z_loss_coeff > 0; a tensor given anyway is checked and written.
struct RouterStats {
  TensorRef prob_sum;  // [S, E] sum over valid tokens of p[t, e]                (route_forward)
  TensorRef counts;    // [S, E] routed pairs kept per expert                    (count_routed)
  TensorRef scalars;   // [2] {sum over valid tokens of logsumexp^2, valid tokens} (route_forward)
};

/// logits [T, E] fp32, bf16 or fp64; expert_bias [E] fp32 (given iff config.use_expert_bias).
/// Writes topk_idx [T, K] int32/int64, topk_weights [T, K] fp32 (fp64 for fp64 logits),
/// stats.prob_sum and stats.scalars. Rows are independent: no cross-token state.
void route_forward(const RouterConfig& config, const TensorRef& logits, const TensorRef& expert_bias,
                   const TensorRef& topk_idx, const TensorRef& topk_weights, const RouterStats& stats,
                   Stream stream = {});

/// stats.counts [S, E] (fp32 or fp64) from the routing actually used: routed_experts [T, K] int32
/// or int64 (Handle::routed_experts(), or route_forward's topk_idx when nothing is dropped);
/// -1 = none; any other id outside [0, E), or an id repeated within a row, is an error.
void count_routed(const RouterConfig& config, const TensorRef& routed_experts, const RouterStats& stats,
                  Stream stream = {});

/// losses [2] {aux, z} (fp32 or fp64, on the stats' device) from stats (reduced over the group
/// where the loss is global; T is stats.scalars[1]; in sequence mode S is prob_sum's row count).
/// The aux loss is 0 when config.aux_loss is kNone, z when z_loss_coeff is 0.
void router_losses(const RouterConfig& config, const RouterStats& stats, const TensorRef& losses,
                   Stream stream = {});

/// d_logits [T, E] (logits' dtype, overwritten) from d_topk_weights [T, K] (undefined = no
/// gradient through the weights) and the finite loss seeds d_aux, d_z (usually 1), with the same
/// (possibly group-reduced) stats as the forward; topk_idx is route_forward's output.
///   d_logits = J_w^T d_topk_weights + d_aux * d aux / d logits + d_z * d z / d logits,
/// e.g. d z / d l[t, e] = z_loss_coeff * 2 * lse_t * softmax(l_t)_e / T.
void route_backward(const RouterConfig& config, const TensorRef& logits, const TensorRef& expert_bias,
                    const TensorRef& topk_idx, const TensorRef& d_topk_weights, const RouterStats& stats,
                    double d_aux, double d_z, const TensorRef& d_logits, Stream stream = {});

/// Aux-loss-free balancing (DeepSeek-V3): bias[e] += rate * sign(mean(counts) - counts[e]),
/// sign(0) = 0; expert_bias [E] fp32, counts [E] fp32 or fp64 reduced over the group (a [1, E]
/// stats.counts viewed as [E]), rate finite and >= 0.
void update_expert_bias(const TensorRef& expert_bias, const TensorRef& counts, float rate, Stream stream = {});

}  // namespace epx
