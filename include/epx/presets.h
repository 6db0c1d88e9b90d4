// Named layer shapes shared by the tests, the CLI and the benchmarks, so that "the DeepSeek-V3
// shape" means the same numbers everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/moe.h"

namespace epx {

struct ShapePreset {
  std::string name;
  std::string description;
  int64_t tokens = 0;  // per rank
  int64_t hidden = 0;
  int64_t ffn_hidden = 0;
  int64_t shared_ffn_hidden = 0;
  int experts = 0;
  int topk = 0;
  int groups = 1;
  int group_topk = 1;
  ScoreFunction score = ScoreFunction::kSoftmax;
  bool expert_bias = false;
  bool normalize = false;
  float scaling = 1.0f;
};

/// deepseek-v3, deepseek-v3-decode, mixtral, small (the CPU demo), tiny (unit tests).
const std::vector<ShapePreset>& shape_presets();
/// Throws epx::Error listing the known names.
const ShapePreset& find_preset(const std::string& name);
/// The layer configuration of a preset (aux loss 1e-3 global-batch, z loss 1e-3, dropless).
MoEConfig moe_config(const ShapePreset& p, DType dtype);

}  // namespace epx
