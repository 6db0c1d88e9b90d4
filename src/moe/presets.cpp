#include "epx/presets.h"

#include "epx/error.h"

namespace epx {

const std::vector<ShapePreset>& shape_presets() {
  static const std::vector<ShapePreset> presets = [] {
    std::vector<ShapePreset> v;
    ShapePreset ds;
    ds.name = "deepseek-v3";
    ds.description = "DeepSeek-V3 MoE layer: sigmoid + expert bias, 8 groups keep 4, top-8 of 256, scaling 2.5";
    ds.tokens = 4096;
    ds.hidden = 7168;
    ds.ffn_hidden = 2048;
    ds.shared_ffn_hidden = 2048;
    ds.experts = 256;
    ds.topk = 8;
    ds.groups = 8;
    ds.group_topk = 4;
    ds.score = ScoreFunction::kSigmoid;
    ds.expert_bias = true;
    ds.normalize = true;
    ds.scaling = 2.5f;
    v.push_back(ds);
    ShapePreset dec = ds;
    dec.name = "deepseek-v3-decode";
    dec.description = "DeepSeek-V3 layer at decode batch size (128 tokens per rank)";
    dec.tokens = 128;
    v.push_back(dec);
    ShapePreset mx;
    mx.name = "mixtral";
    mx.description = "Mixtral 8x7B MoE layer: top-2 of 8, softmax over the selected logits";
    mx.tokens = 4096;
    mx.hidden = 4096;
    mx.ffn_hidden = 14336;
    mx.experts = 8;
    mx.topk = 2;
    mx.score = ScoreFunction::kSoftmaxAfterTopk;
    v.push_back(mx);
    ShapePreset sm = ds;
    sm.name = "small";
    sm.description = "DeepSeek-style layer scaled down for the CPU reference (demo)";
    sm.tokens = 64;
    sm.hidden = 64;
    sm.ffn_hidden = 32;
    sm.shared_ffn_hidden = 32;
    sm.experts = 16;
    sm.topk = 4;
    sm.groups = 4;
    sm.group_topk = 2;
    v.push_back(sm);
    ShapePreset tiny = sm;
    tiny.name = "tiny";
    tiny.description = "smallest DeepSeek-style layer, for unit tests";
    tiny.tokens = 8;
    tiny.hidden = 8;
    tiny.ffn_hidden = 4;
    tiny.shared_ffn_hidden = 4;
    tiny.experts = 8;
    tiny.topk = 2;
    tiny.groups = 4;
    tiny.group_topk = 2;
    v.push_back(tiny);
    return v;
  }();
  return presets;
}

const ShapePreset& find_preset(const std::string& name) {
  std::string known;
  for (const auto& p : shape_presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  throw Error(Status::kInvalidArgument, "epx::find_preset: unknown preset '" + name + "', expected one of " + known);
}

MoEConfig moe_config(const ShapePreset& p, DType dtype) {
  MoEConfig c;
  c.hidden = p.hidden;
  c.ffn_hidden = p.ffn_hidden;
  c.shared_ffn_hidden = p.shared_ffn_hidden;
  c.dtype = dtype;
  c.router.num_experts = p.experts;
  c.router.topk = p.topk;
  c.router.score_function = p.score;
  c.router.num_groups = p.groups;
  c.router.group_topk = p.group_topk;
  c.router.use_expert_bias = p.expert_bias;
  c.router.normalize_weights = p.normalize;
  c.router.routed_scaling_factor = p.scaling;
  c.router.aux_loss = AuxLossType::kGlobalBatch;
  c.router.aux_loss_coeff = 1e-3f;
  c.router.z_loss_coeff = 1e-3f;
  return c;
}

}  // namespace epx
