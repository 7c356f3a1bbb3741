// The decoder shared by every supported architecture: pre-norm layers of attention (full or
// sliding, optional sinks, q/k norm, partial RoPE, value scale, Q/K ≠ V head dims) and a dense
// SwiGLU or routed-expert FFN, all driven by the per-layer LayerSpec vectors of ModelConfig.
#pragma once

#include "backend/workspace.h"
#include "loader/fp8_block.h"
#include "models/model.h"

#include <map>
#include <span>
#include <vector>

namespace xinfer {

struct LayerWeights {
    Tensor input_norm;      // [hidden] f32
    Tensor post_attn_norm;  // [hidden] f32
    Tensor q_proj;          // [n_q * dk, hidden]
    Tensor k_proj;          // [n_kv * dk, hidden]
    Tensor v_proj;          // [n_kv * dv, hidden]
    // [n_q·dk + n_kv·dk + n_kv·dv, hidden]: q_proj, k_proj and v_proj are views of its row blocks,
    // so a one-token step projects all three in one matmul (one weight stream, not three).
    // FP8 with block scales when all three are (qkv_proj_scale; the parts' scales are its row
    // views); empty when only some are (kept apart).
    Tensor qkv_proj;
    Tensor o_proj;          // [hidden, n_q * dv]
    Tensor q_norm, k_norm;  // [dk] f32 (qk_norm models only)
    Tensor sinks;           // [n_q] f32 (layers with sinks only)
    // Dense FFN.
    Tensor gate_up;         // [2 * intermediate, hidden]: gate rows then up rows
    Tensor down;            // [hidden, intermediate]
    // MoE FFN.
    Tensor router;          // [n_experts, hidden] f32
    Tensor router_bias;     // [n_experts] f32 (selection only)
    Tensor experts_gate_up; // [n_experts, 2 * moe_intermediate, hidden]
    Tensor experts_down;    // [n_experts, hidden, moe_intermediate]
    // Block scales of the matrices above that stay f8_e4m3 on the device (FP8 checkpoints on a
    // backend that runs fp8 MATMUL / MOE_EXPERTS; src/models/fp8_weights.h); empty otherwise.
    // br × bc blocks: bc = weight_block_size[1], br = weight_block_size[0] or finer (see there).
    BlockScales qkv_proj_scale;         // [ceil(rows of qkv_proj / br), ceil(hidden / bc)] f32 (views below)
    BlockScales q_proj_scale;           // [ceil(n_q * dk / br), ceil(hidden / bc)] f32
    BlockScales k_proj_scale;           // [ceil(n_kv * dk / br), ceil(hidden / bc)] f32
    BlockScales v_proj_scale;           // [ceil(n_kv * dv / br), ceil(hidden / bc)] f32
    BlockScales o_proj_scale;           // [ceil(hidden / br), ceil(n_q * dv / bc)] f32
    BlockScales gate_up_scale;          // [ceil(2 * intermediate / br), ceil(hidden / bc)] f32
    BlockScales down_scale;             // [ceil(hidden / br), ceil(intermediate / bc)] f32
    BlockScales experts_gate_up_scale;  // [n_experts, ceil(2 * moe_intermediate / br), ceil(hidden / bc)] f32
    BlockScales experts_down_scale;     // [n_experts, ceil(hidden / br), ceil(moe_intermediate / bc)] f32 (same br)
};

class DecoderModel final : public Model {
public:
    // Loads every tensor strictly (Checkpoint::finish is called at the end).
    DecoderModel(ModelConfig config, Checkpoint& checkpoint, Backend& backend, const LoadOptions& options);

    const ModelConfig& config() const override { return config_; }
    DType activation_dtype() const override { return act_dtype_; }
    void forward(const ForwardBatch& batch, const Tensor& logits) override;
    std::map<DType, uint64_t> weight_bytes() const override;
    uint64_t weight_bytes_per_decode_token() const override;
    uint64_t expert_weight_bytes() const override;
    const Tensor& token_embedding() const override { return embed_tokens_; }
    const Tensor& lm_head() const override { return lm_head_; }

private:
    void load_weights(Checkpoint& checkpoint);
    // Loads one tensor (keep_f32: small parameters kept in f32) or, in dummy mode, makes it.
    Tensor load(Checkpoint& checkpoint, const std::string& name, std::initializer_list<int64_t> shape, bool keep_f32);
    // Loads tensors `names` (each of `part_shape`) stacked along a new leading dim into one tensor of `shape`.
    Tensor load_stacked(Checkpoint& checkpoint, const std::vector<std::string>& names,
                        std::initializer_list<int64_t> part_shape, std::initializer_list<int64_t> shape);
    void load_experts(Checkpoint& checkpoint, const std::string& prefix, LayerWeights& weights);
    // q_proj, k_proj and v_proj of the layer with prefix `p` (rows: their output widths): as views of
    // one qkv_proj buffer (bf16/f32, or e4m3 when all three are FP8 that stays e4m3), else apart.
    void load_qkv(Checkpoint& checkpoint, const std::string& p, int64_t q_rows, int64_t k_rows, int64_t v_rows,
                  LayerWeights& w);
    // A weight matrix made of `names` stacked along rows (each of `part_shape`; a single name may
    // hold the whole `shape`). FP8 parts stay e4m3 with their op scales in `scale` when FP8
    // residency is on and the backend takes the shape; otherwise as load / load_stacked.
    Tensor load_matrix(Checkpoint& checkpoint, const std::vector<std::string>& names,
                       std::initializer_list<int64_t> part_shape, std::initializer_list<int64_t> shape,
                       BlockScales& scale);
    // The stored scale grid of every part of `names` when they are block-scaled FP8 that may stay
    // resident (dummy: the config's contiguous grids); empty when they are not.
    std::vector<Fp8ScaleGrid> fp8_grids(Checkpoint& checkpoint, const std::vector<std::string>& names,
                                        std::span<const int64_t> part_shape) const;
    // Loads (or, in dummy mode, makes) FP8 `names` as e4m3 `shape` plus op scales at `block_rows`.
    Tensor load_fp8(Checkpoint& checkpoint, const std::vector<std::string>& names, std::span<const int64_t> part_shape,
                    std::span<const int64_t> shape, const std::vector<Fp8ScaleGrid>& grids, int64_t block_rows,
                    BlockScales& scale);
    Tensor allocate(DType dtype, std::initializer_list<int64_t> shape);
    void fill_dummy(const Tensor& t, bool is_norm);
    DType dummy_matrix_dtype() const { return backend_.props().host_memory ? options_.dummy_dtype : act_dtype_; }

    LoadOptions options_;

    ModelConfig config_;
    Backend& backend_;
    uint64_t dummy_counter_ = 0;
    DType act_dtype_;  // activations and KV cache
    bool keep_fp8_ = false;  // FP8 matrices stay e4m3 + scales (keep_fp8_weights)
    Workspace workspace_;          // activations, reused every step
    std::vector<Buffer> buffers_;  // owns every weight
    Tensor embed_tokens_;          // [vocab, hidden]
    Tensor final_norm_;            // [hidden] f32
    Tensor lm_head_;               // [vocab, hidden] (the embedding when tied)
    std::vector<LayerWeights> layers_;
};

}  // namespace xinfer
