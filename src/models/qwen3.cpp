// Qwen3 (dense, q/k RMSNorm, usually tied embeddings) and Qwen3-MoE (softmax router,
// mlp_only_layers, decoder_sparse_step) hyper-parameters. The forward pass is the shared decoder.
#include "models/architectures.h"

#include "core/status.h"

#include <algorithm>

namespace xinfer {

ModelConfig read_qwen3_config(const ConfigReader& cfg, bool moe) {
    ModelConfig config;
    config.vocab_size = cfg.get_int("vocab_size");
    config.hidden_size = cfg.get_int("hidden_size");
    config.intermediate_size = cfg.get_int("intermediate_size");
    config.rms_norm_eps = float(cfg.get_float("rms_norm_eps", 1e-6));
    config.tie_word_embeddings = cfg.get_bool("tie_word_embeddings", !moe);
    config.max_position_embeddings = cfg.get_int("max_position_embeddings", 40960);
    config.qk_norm = true;
    if (cfg.get_bool("attention_bias", false))
        fail("{}: attention_bias=true is not supported for {}", cfg.path().string(), moe ? "Qwen3-MoE" : "Qwen3");
    check_rope_scaling_is_default(cfg);

    const int n_layers = int(cfg.get_int("num_hidden_layers"));
    const int n_heads = int(cfg.get_int("num_attention_heads"));
    const int n_kv_heads = int(cfg.get_int("num_key_value_heads", n_heads));
    const int head_dim = int(cfg.get_int("head_dim", config.hidden_size / n_heads));
    // transformers ≥ 5 writes rope_parameters {rope_theta, rope_type}; older configs rope_theta.
    double rope_theta = cfg.get_float("rope_theta", 1000000.0);
    if (cfg.has("rope_parameters")) rope_theta = cfg.object("rope_parameters").get_float("rope_theta", rope_theta);

    std::vector<AttentionKind> kinds(size_t(n_layers), AttentionKind::full);
    if (cfg.has("layer_types")) {
        std::vector<std::string> names = cfg.get_string_list("layer_types");
        if (names.size() != size_t(n_layers))
            fail("{}: field 'layer_types': expected {} entries, found {}", cfg.path().string(), n_layers, names.size());
        for (size_t i = 0; i < names.size(); ++i) {
            if (names[i] == "sliding_attention") kinds[i] = AttentionKind::sliding;
            else if (names[i] != "full_attention")
                fail("{}: field 'layer_types': unknown layer type \"{}\"", cfg.path().string(), names[i]);
        }
    }
    const int window = cfg.has("sliding_window") ? int(cfg.get_int("sliding_window")) : 0;

    std::vector<int64_t> mlp_only_layers;
    int sparse_step = 1;
    if (moe) {
        // transformers ≥ 5 writes num_local_experts; older configs num_experts.
        config.n_experts = int(cfg.has("num_local_experts") ? cfg.get_int("num_local_experts") : cfg.get_int("num_experts"));
        config.moe_intermediate_size = cfg.get_int("moe_intermediate_size");
        config.router.scoring = RouterParams::Scoring::softmax;
        config.router.top_k = int(cfg.get_int("num_experts_per_tok"));
        config.router.norm_topk_prob = cfg.get_bool("norm_topk_prob", false);
        sparse_step = int(cfg.get_int("decoder_sparse_step", 1));
        if (sparse_step < 1) fail("{}: decoder_sparse_step must be ≥ 1, found {}", cfg.path().string(), sparse_step);
        if (cfg.has("mlp_only_layers")) mlp_only_layers = cfg.get_int_list("mlp_only_layers");
    }

    for (int i = 0; i < n_layers; ++i) {
        LayerSpec layer;
        layer.attention = kinds[size_t(i)];
        layer.n_q_heads = n_heads;
        layer.n_kv_heads = n_kv_heads;
        layer.head_dim_k = head_dim;
        layer.head_dim_v = head_dim;
        layer.window = layer.attention == AttentionKind::sliding ? window : 0;
        if (layer.attention == AttentionKind::sliding && window <= 0)
            fail("{}: layer {} is sliding_attention but sliding_window is not set", cfg.path().string(), i);
        layer.rope_theta = float(rope_theta);
        layer.rotary_dim = head_dim;
        // Same rule as transformers' Qwen3MoeDecoderLayer.
        const bool is_moe = moe && config.n_experts > 0 && (i + 1) % sparse_step == 0 &&
                            std::find(mlp_only_layers.begin(), mlp_only_layers.end(), i) == mlp_only_layers.end();
        layer.ffn = is_moe ? FfnKind::moe : FfnKind::dense;
        config.layers.push_back(layer);
    }
    return config;
}

}  // namespace xinfer
