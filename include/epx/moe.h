// The MoE layer: gate GEMM -> router -> prepare -> dispatch -> grouped expert FFN -> combine
// (+ optional shared experts), forward and backward, on one rank of an EP group.
//
// Parameters are rank-local: the gate [H, E], the expert bias [E] and the shared experts are
// replicated on every rank; the routed experts are sharded, rank r holding experts
// [r*E/R, (r+1)*E/R). init_params draws every tensor from a counter-based generator keyed by
// (seed, parameter, global expert index, element), so a layer on R ranks holds exactly the experts
// the same layer on one rank holds, whatever R is.
//
// Gradients are rank-local too: expert gradients are complete (every token that reached an expert
// contributed), the replicated parameters' gradients hold this rank's tokens only; sum them over
// the data-parallel ranks as for any replicated parameter. Losses are global over the group.
//
// out = round(round(combine) + round(shared experts)); d_x sums the routed, gate and shared
// contributions in fp32 before one rounding.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "epx/comm.h"
#include "epx/grouped_gemm.h"
#include "epx/layout.h"
#include "epx/router.h"
#include "epx/tensor.h"

namespace epx {

namespace detail {
class SideStream;
}

struct MoEConfig {
  int64_t hidden = 0;
  int64_t ffn_hidden = 0;
  RouterConfig router;  // num_experts, topk, score function, groups, bias, aux/z losses
  Activation activation = Activation::kSwiGLU;
  bool expert_bias_terms = false;  // b_in / b_out in the expert FFNs
  bool apply_weights_early = false;
  /// With the weights applied in combine and no expert biases: backward hands d_out to the experts
  /// unweighted (combine_backward is then a plain copy, the dispatch's) and the expert FFN computes
  /// the row weights' gradient through FC2 (MlpConfig::combine_weight_grads: F-wide dot products
  /// instead of H-wide ones against y). Backward never reads the expert outputs y, so d_y takes
  /// their buffer. Off: combine_backward weights d_y and takes <d_out, y> per row. The same
  /// gradients up to rounding.
  bool weight_grads_in_ffn = true;
  PrepareOptions capacity;         // dropless by default
  int64_t shared_ffn_hidden = 0;   // hidden size of the shared expert FFN; 0 = no shared experts
  DType dtype = DType::kBF16;      // parameters and activations (fp64 for gradient checks)
  /// Forward precision of the expert GEMMs. With an FP8 precision the tokens are quantized once
  /// before dispatch and travel as fp8 + scales (about half the bytes); backward stays in `dtype`.
  MlpPrecision precision = MlpPrecision::kHigh;
  /// Routed-expert weight gradients (w_in, b_in, w_out, b_out) in `dtype` instead of fp32: fp32
  /// accumulation, one rounding. With hundreds of local experts this halves tens of gigabytes.
  bool expert_grads_in_dtype = false;
  /// Backward leaves the saved activations intact, so it may run again on the same forward
  /// (autograd's retain_graph, gradcheck). Off: backward uses them as its scratch (no extra
  /// [rows, (P+1)*F] buffers) and a second backward on that context is an error.
  bool backward_keeps_saved = false;
  /// With precision fp8_block on a GPU: keep the routed experts' FP8 weights (quantized and
  /// transposed) between forwards instead of quantizing them on every forward. The copy is made at
  /// the first forward and by refresh_fp8_weights(), which MUST follow every change of w_in / w_out
  /// (an optimizer step); forwards between two changes (gradient-accumulation microbatches) then
  /// skip the weight pass. Off by default: nothing can go stale.
  bool fp8_weight_cache = false;
  /// Splits each rank's tokens into this many chunks (1..16) of ceil(T / n) rows (the last ones
  /// shorter or empty; every rank runs all n), each with its own routing handle and expert-major
  /// buffers sized for one chunk's worst case (PrepareOptions::recv_capacity_rows; together about
  /// the unchunked layer's, plus a padding block per local expert and chunk), taken through
  /// dispatch, the expert FFNs and combine one after another, so that with overlap_communication a
  /// chunk's FFN runs while another chunk's tokens travel. Results equal the one-chunk layer's bit for bit,
  /// except the routed experts' weight gradients, which add up the chunks' (each sum in fp32, then
  /// one rounding to the gradient's dtype per chunk: with expert_grads_in_dtype on a bf16 layer,
  /// one bf16 rounding per chunk). Needs dropless routing (capacity is decided over the whole batch).
  /// On the staged transport with fixed sizes every exchange moves max_tokens_per_rank rows a peer,
  /// so n chunks move n times the bytes: there, use GroupConfig::staged_exact_sizes or one chunk.
  /// Cost: every chunk's expert GEMMs read all local expert weights again, and every chunk's weight
  /// gradient pass reads and writes the gradients, with fewer rows a group to spread that over. It
  /// pays only where the collectives are a large part of the step: on 2 H200s over NVLink with
  /// T = 4096 a rank they were about 6% of forward+backward, and 2 chunks made the step slower
  /// (DeepSeek-V3-like layer 1.52x, Mixtral-like 1.24x; 4 chunks 2.9x and 1.40x).
  int pipeline_chunks = 1;
  static constexpr int kMaxPipelineChunks = 16;
  /// Runs the layer's collectives (prepare, dispatch, combine, their backward, the statistics'
  /// all-reduce) on a stream of the layer's own, ordered with the caller's stream by events: the
  /// shared experts run while the tokens travel, and with pipeline_chunks > 1 chunk c's FFN runs
  /// while later chunks are dispatched and earlier ones combined. With an SM budget for the
  /// communication kernels (GroupConfig::num_sms = b) the grouped GEMMs that run beside them (the
  /// shared experts', and with chunks the routed experts') take the other SMs (they are persistent:
  /// sized for every SM they would hold the SMs the collectives wait for until they end); without
  /// one both take what they get. No effect on results; on the CPU
  /// reference the steps run in the same order, one after another.
  bool overlap_communication = false;

  void validate(const char* fn, const Group& group) const;
  int projections() const { return is_gated(activation) ? 2 : 1; }
};

/// Parameters or their gradients (same shapes; gradients are fp32, fp64 for fp64 layers; the
/// routed experts' in the layer dtype with MoEConfig::expert_grads_in_dtype).
struct MoEParams {
  Tensor gate;          // [H, E]
  Tensor expert_bias;   // [E] fp32, when router.use_expert_bias (updated, never trained)
  Tensor w_in;          // [E_local, H, P, F]
  Tensor b_in;          // [E_local, P, F] when expert_bias_terms
  Tensor w_out;         // [E_local, F, H]
  Tensor b_out;         // [E_local, H] when expert_bias_terms
  Tensor shared_w_in;   // [1, H, P, Fs] when shared_ffn_hidden > 0
  Tensor shared_w_out;  // [1, Fs, H]
};

/// What one forward saves for its backward: the routing handle and the activations. One context
/// per layer and in-flight microbatch.
class MoEContext {
 public:
  MoEContext();
  ~MoEContext();
  MoEContext(MoEContext&&) noexcept;
  MoEContext& operator=(MoEContext&&) noexcept;

  /// [2] {aux_loss, z_loss} on the layer's device, filled by forward.
  const Tensor& losses() const;
  /// The routing of pipeline chunk `chunk` (MoEConfig::pipeline_chunks; 0 is the only one by default).
  const Handle& handle(int chunk = 0) const;
  int num_chunks() const;
  /// [T, K] router outputs of the forward.
  const Tensor& topk_idx() const;
  const Tensor& topk_weights() const;
  /// The router statistics of the forward (prob_sum and counts of the KEPT routing, summed over
  /// the group for the global-batch aux loss): e.g. the counts for update_expert_bias.
  const RouterStats& router_stats() const;

  struct State;
  State& state() const;

 private:
  friend class MoELayer;
  std::unique_ptr<State> state_;
};

/// Who holds the parameters and gradients. kExternal is for frameworks whose tensors are the
/// parameters (torch.nn.Parameter, a JAX array): the layer allocates neither, and the caller binds
/// views of its own memory into params() and grads() (Tensor::wrap) with the shapes and dtypes of
/// MoELayer::param_specs; forward checks every parameter it reads, backward every gradient it writes.
enum class ParamStorage : uint8_t { kOwned, kExternal };

/// One parameter of a layer: its name (stable, checkpoint-friendly), shape and dtype, for the
/// parameter itself and for its gradient, and where it lives in MoEParams.
struct ParamSpec {
  const char* name;  // "gate", "expert_bias", "w_in", "b_in", "w_out", "b_out", "shared_w_in", "shared_w_out"
  Tensor MoEParams::*field;
  Shape shape;
  DType dtype;
  DType grad_dtype;  // expert_bias has no gradient: grad_dtype is its dtype and backward never writes it
  bool trained;
};

class MoELayer {
 public:
  MoELayer(Group& group, const MoEConfig& config, ParamStorage storage = ParamStorage::kOwned);
  ~MoELayer();

  const MoEConfig& config() const { return config_; }
  Group& group() const { return group_; }
  MoEParams& params() { return params_; }
  const MoEParams& grads() const { return grads_; }
  /// For ParamStorage::kExternal: bind the gradient tensors backward writes (overwrites).
  MoEParams& grads() { return grads_; }
  /// The parameters this layer has on this rank (only those its config uses), in a fixed order.
  const std::vector<ParamSpec>& param_specs() const { return specs_; }

  /// Deterministic initialisation, independent of the number of ranks (see the header note).
  void init_params(uint64_t seed, double stddev = 0.02);

  /// x [T, H] -> out [T, H] (both in config.dtype, on the group's device). Collective.
  MoEContext forward(const TensorRef& x, const TensorRef& out, Stream stream = {});
  /// The same, reusing ctx's buffers (and routing block) from its previous step: a context reused
  /// with the same T allocates nothing after its first step, so a warmed-up forward + backward can
  /// be captured in a CUDA graph and replayed. Keep one context per in-flight microbatch; x must
  /// stay valid until backward (it is read again there).
  void forward(const TensorRef& x, const TensorRef& out, MoEContext& ctx, Stream stream = {});
  /// d_out [T, H] -> d_x [T, H]; parameter gradients are written to grads() (overwritten), or
  /// with accumulate_grads added to what grads() holds (gradient accumulation over microbatches:
  /// the expert GEMMs add in their epilogue, no second gradient buffer; needs fp32 gradients, so not
  /// with MoEConfig::expert_grads_in_dtype on a bf16 layer). Once per forward: backward consumes the
  /// context's saved activations (a second call is an error). d_aux and d_z seed the auxiliary
  /// losses (1 when they are added to the training loss).
  void backward(MoEContext& ctx, const TensorRef& d_out, const TensorRef& d_x, double d_aux = 1.0,
                double d_z = 1.0, Stream stream = {}, bool accumulate_grads = false);
  /// Re-quantizes the kept FP8 copy of w_in / w_out (MoEConfig::fp8_weight_cache) from the
  /// current weights, on `stream`. Call it after every update of the expert weights. A layer on
  /// the CPU reference keeps no copy (it quantizes on every forward): nothing to do there.
  void refresh_fp8_weights(Stream stream = {});

 private:
  void check_bound(const char* fn, const MoEParams& p, bool grads) const;

  Group& group_;
  MoEConfig config_;
  std::vector<ParamSpec> specs_;
  MoEParams params_;
  MoEParams grads_;
  Tensor fp8_w_in_q_, fp8_w_in_scales_, fp8_w_out_q_, fp8_w_out_scales_;  // fp8_weight_cache
  std::unique_ptr<detail::SideStream> comm_stream_;                      // overlap_communication
  int overlap_gemm_sms_ = 0;  // SMs the grouped GEMMs take beside the collectives (0 = all)
};

}  // namespace epx
