// The model interface: per-layer hyper-parameters read from config.json, the KV layer groups a
// model needs, the ForwardBatch a step passes in, and the registry that maps config.json's
// `architectures[0]` to a model.
#pragma once

#include "backend/backend.h"
#include "loader/checkpoint.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace xinfer {

enum class AttentionKind { full, sliding };
enum class FfnKind { dense, moe };

// Everything that may differ between layers lives here, never in `if (layer == 0)` code.
struct LayerSpec {
    AttentionKind attention = AttentionKind::full;
    int n_q_heads = 0;
    int n_kv_heads = 0;
    int head_dim_k = 0;     // Q/K
    int head_dim_v = 0;     // V (MiMo: 128 vs 192)
    int window = 0;         // sliding layers: keys p-window+1..p (window keys including self)
    bool has_sinks = false; // one learned extra softmax logit per query head
    float rope_theta = 10000.f;
    int rotary_dim = 0;     // partial rotary: first rotary_dim dims of each Q/K head
    FfnKind ffn = FfnKind::dense;
};

// Block-scaled FP8 weights (config.json quantization_config with quant_method "fp8"): the block
// geometry and which modules stay unquantized. Embeddings, norms, routers and sinks never are.
struct Fp8WeightConfig {
    bool enabled = false;
    int64_t block_rows = 128;  // weight_block_size[0]
    int64_t block_cols = 128;  // weight_block_size[1]
    // modules_to_not_convert (HF) / ignored_layers (vLLM): module names ("model.layers.0.self_attn.o_proj")
    // or short names ("o_proj") whose weights stay bf16.
    std::vector<std::string> not_converted;
    // Whether the matrix named `tensor` ("model.layers.3.self_attn.q_proj.weight") is stored in e4m3.
    bool quantizes(std::string_view tensor) const;
};

struct ModelConfig {
    std::string architecture;  // config.json architectures[0]
    int64_t vocab_size = 0;
    int64_t hidden_size = 0;
    int64_t intermediate_size = 0;      // dense SwiGLU width
    int64_t moe_intermediate_size = 0;  // per-expert SwiGLU width
    int n_experts = 0;
    float rms_norm_eps = 1e-6f;
    bool tie_word_embeddings = false;
    bool qk_norm = false;        // Qwen3: RMSNorm over each Q/K head before RoPE
    float value_scale = 1.f;     // MiMo: V multiplied by this before it is cached
    bool router_bias = false;    // e_score_correction_bias present (selection only)
    RouterParams router;
    int64_t max_position_embeddings = 0;
    DType dtype = DType::bf16;   // config.json "dtype" / "torch_dtype": the checkpoint's compute dtype
    Fp8WeightConfig fp8;         // block-scaled FP8 matrices (quantization_config)
    std::vector<LayerSpec> layers;
    // Tensor-name prefixes present in checkpoints but only used by speculation (MTP heads).
    std::vector<std::string> speculative_prefixes;
};

// One KV layer group: layers sharing attention kind and cache geometry share page tables.
struct KvGroupSpec {
    AttentionKind kind = AttentionKind::full;
    int window = 0;
    int n_kv_heads = 0;
    int head_dim_k = 0;
    int head_dim_v = 0;
    std::vector<int> layers;
};
std::vector<KvGroupSpec> kv_groups_for(const ModelConfig& config);

// A layer's cache storage.
struct LayerCache {
    Tensor k;  // [pages, page_size, n_kv, head_dim_k]
    Tensor v;  // [pages, page_size, n_kv, head_dim_v]
};

// Called for every named intermediate when set; costs nothing when empty. layer = -1 for
// tensors outside the decoder layers. The tensor is valid only during the call.
using TapFn = std::function<void(std::string_view name, int layer, const Tensor& value)>;

// Everything one forward step needs, passed explicitly (no global batch state).
struct ForwardBatch {
    int n_tokens = 0;
    Tensor token_ids;                    // [n_tokens] i32
    Tensor positions;                    // [n_tokens] i32 (same tensor as groups[g].positions)
    std::vector<AttentionBatch> groups;  // one per KvGroupSpec, same order as kv_groups_for()
    std::vector<int> layer_group;        // [n_layers] group index of each layer
    std::vector<LayerCache> caches;      // [n_layers]
    Tensor logit_rows;                   // [n_out] i32: which token rows produce logits
    TapFn tap;
};

class Model {
public:
    virtual ~Model() = default;
    virtual const ModelConfig& config() const = 0;
    // Dtype of activations and of the KV cache on the model's backend.
    virtual DType activation_dtype() const = 0;
    // Runs the decoder over the batch, writing K/V into the caches and logits for the
    // requested rows into `logits` ([n_out, vocab] f32 on the model's backend).
    virtual void forward(const ForwardBatch& batch, const Tensor& logits) = 0;
    // Bytes of weights held on the device, by dtype.
    virtual std::map<DType, uint64_t> weight_bytes() const = 0;
    // Weight bytes one batch-1 decode step reads: every dense weight, top_k of n_experts
    // experts per MoE layer, one embedding row (the whole table when it doubles as lm_head).
    virtual uint64_t weight_bytes_per_decode_token() const = 0;
    // Bytes of one expert of one MoE layer as held (gate, up and down with their block scales);
    // 0 without experts. A step whose MoE layers touch d distinct experts each reads
    // weight_bytes_per_decode_token() + (d - top_k) · MoE layers · this.
    virtual uint64_t expert_weight_bytes() const = 0;
    // Borrowed by drafters (DFlash, MTP) that share the target's vocabulary projections.
    virtual const Tensor& token_embedding() const = 0;  // [vocab, hidden]
    virtual const Tensor& lm_head() const = 0;          // [vocab, hidden] (the embedding when tied)
};

// How weights are obtained: from the checkpoint's safetensors, or random values of the
// checkpoint's shapes (`--load-format dummy`: a directory with only config.json suffices).
struct LoadOptions {
    bool dummy = false;
    DType dummy_dtype = DType::bf16;  // dtype of dummy matrices (norms, sinks, routers stay f32)
    uint64_t dummy_seed = 0;
    // Activation (and KV cache) dtype on accelerators: "auto" follows config.json's dtype
    // (as vLLM's --dtype auto), else "float32" or "bfloat16". Host-memory backends always
    // compute in f32: they are the reference.
    std::string dtype = "auto";
    // On host-memory backends, FP8 block-scaled weights are dequantized at load to this dtype:
    // f32 (the default) reproduces the checkpoint's values exactly, which the oracle needs;
    // bf16 halves memory.
    DType dequant_dtype = DType::f32;
    // Block-scaled FP8 matrices on accelerators (`--fp8-weights`): "auto" keeps them e4m3 with
    // their f32 block scales wherever the backend's supports_op accepts f8 MATMUL / MOE_EXPERTS
    // (host-memory backends, the oracle, always dequantize) and activations are bf16 (f32
    // activations get exact dequantized weights; "keep" keeps e4m3 for them too); "dequantize"
    // expands them to the activation dtype at load. With --load-format dummy, a config with an fp8 quantization_config
    // gets random e4m3 weights + scales the same way.
    std::string fp8_weights = "auto";
};

// Parameter counts derived from the config alone (no weights needed).
struct ParameterCounts {
    int64_t total = 0;   // every weight of the decoder (embedding and lm_head counted separately if untied)
    int64_t active = 0;  // read per token: top_k experts per MoE layer, lm_head, no embedding table
};
ParameterCounts count_parameters(const ModelConfig& config);

// Reads config.json of `dir` into a ModelConfig (both MiMo dialects, Qwen3, Qwen3-MoE).
// Unknown architectures are an error listing the supported ones.
ModelConfig read_model_config(const Checkpoint& checkpoint);
// Loads the weights strictly onto `backend`.
std::unique_ptr<Model> load_model(Checkpoint& checkpoint, Backend& backend, const LoadOptions& options = {});
std::vector<std::string> supported_architectures();

}  // namespace xinfer
