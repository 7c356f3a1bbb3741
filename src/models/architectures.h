// Per-architecture config readers (one file each), used by the registry in registry.cpp.
#pragma once

#include "loader/hf_config.h"
#include "models/model.h"

namespace xinfer {

// MiMoV2FlashForCausalLM: accepts both the hub (remote-code) and the transformers-native dialect.
ModelConfig read_mimo_v2_flash_config(const ConfigReader& cfg);
// Qwen3ForCausalLM and Qwen3MoeForCausalLM.
ModelConfig read_qwen3_config(const ConfigReader& cfg, bool moe);

// Helpers shared by the readers.
// Rotary dims as every reference computes them: int(head_dim · partial_rotary_factor).
int rotary_dim_for(int head_dim, double partial_rotary_factor);
// Reads `rope_parameters` / `rope_scaling` and rejects scaling types we do not implement.
void check_rope_scaling_is_default(const ConfigReader& cfg);

}  // namespace xinfer
