// MiMo-V2-Flash hyper-parameters from config.json (research/mimo_v2_flash.md §2-§4).
//
// Two dialects describe the same model:
//  - hub / remote code: hybrid_layer_pattern (0 full, 1 sliding), moe_layer_freq (0 dense,
//    1 MoE), swa_* head counts and dims, rope_theta / swa_rope_theta, layernorm_epsilon,
//    add_{swa,full}_attention_sink_bias, sliding_window(_size);
//  - transformers-native: layer_types, mlp_layer_types, rope_parameters keyed by layer type,
//    rms_norm_eps; sliding layers have 2× the full layers' KV heads and carry sinks.
// The forward pass is the shared decoder (decoder.cpp); only hparams differ per architecture.
#include "models/architectures.h"

#include "core/status.h"

namespace xinfer {
namespace {

struct AttentionGeometry {
    int n_q_heads, n_kv_heads, head_dim_k, head_dim_v;
    double rope_theta, partial_rotary_factor;
    bool sinks;
};

std::vector<AttentionKind> layer_kinds_from_names(const ConfigReader& cfg, const std::string& key, size_t n_layers) {
    std::vector<AttentionKind> kinds;
    for (const std::string& name : cfg.get_string_list(key)) {
        if (name == "full_attention") kinds.push_back(AttentionKind::full);
        else if (name == "sliding_attention") kinds.push_back(AttentionKind::sliding);
        else fail("{}: field '{}': unknown layer type \"{}\" (expected full_attention or sliding_attention)",
                  cfg.path().string(), key, name);
    }
    if (kinds.size() != n_layers)
        fail("{}: field '{}': expected {} entries (num_hidden_layers), found {}", cfg.path().string(), key, n_layers,
             kinds.size());
    return kinds;
}

template <typename T>
std::vector<T> flags_to(const ConfigReader& cfg, const std::string& key, size_t n_layers, T if_zero, T if_one) {
    std::vector<int64_t> flags = cfg.get_int_list(key);
    if (flags.size() != n_layers)
        fail("{}: field '{}': expected {} entries (num_hidden_layers), found {}", cfg.path().string(), key, n_layers,
             flags.size());
    std::vector<T> out;
    for (int64_t f : flags) {
        if (f != 0 && f != 1) fail("{}: field '{}': entries must be 0 or 1, found {}", cfg.path().string(), key, f);
        out.push_back(f ? if_one : if_zero);
    }
    return out;
}

}  // namespace

ModelConfig read_mimo_v2_flash_config(const ConfigReader& cfg) {
    ModelConfig config;
    config.vocab_size = cfg.get_int("vocab_size");
    config.hidden_size = cfg.get_int("hidden_size");
    config.intermediate_size = cfg.get_int("intermediate_size");
    config.moe_intermediate_size = cfg.get_int("moe_intermediate_size");
    config.n_experts = int(cfg.get_int("n_routed_experts"));
    config.tie_word_embeddings = cfg.get_bool("tie_word_embeddings", false);
    config.max_position_embeddings = cfg.get_int("max_position_embeddings", 262144);
    config.value_scale = float(cfg.get_float("attention_value_scale", 1.0));
    config.router_bias = true;  // noaux_tc: e_score_correction_bias is always present
    config.speculative_prefixes = {"model.mtp."};
    if (cfg.get_bool("attention_bias", false))
        fail("{}: attention_bias=true is not supported for MiMoV2FlashForCausalLM", cfg.path().string());
    if (cfg.has("n_shared_experts") && cfg.get_int("n_shared_experts") != 0)
        fail("{}: n_shared_experts={} is not supported (MiMo-V2-Flash has none)", cfg.path().string(),
             cfg.get_int("n_shared_experts"));

    const std::string scoring = cfg.get_string("scoring_func", "sigmoid");
    if (scoring != "sigmoid") fail("{}: scoring_func \"{}\" is not supported (expected sigmoid)", cfg.path().string(), scoring);
    config.router.scoring = RouterParams::Scoring::sigmoid;
    config.router.top_k = int(cfg.get_int("num_experts_per_tok"));
    config.router.n_group = int(cfg.get_int("n_group", 1));
    config.router.topk_group = int(cfg.get_int("topk_group", 1));
    config.router.norm_topk_prob = cfg.get_bool("norm_topk_prob", true);
    config.router.routed_scaling_factor = float(cfg.get_float("routed_scaling_factor", 1.0));

    const size_t n_layers = size_t(cfg.get_int("num_hidden_layers"));
    const int head_dim = int(cfg.get_int("head_dim"));
    const int v_head_dim = int(cfg.get_int("v_head_dim"));
    const int n_heads = int(cfg.get_int("num_attention_heads"));
    const int n_kv_heads = int(cfg.get_int("num_key_value_heads"));

    std::vector<AttentionKind> kinds;
    std::vector<FfnKind> ffns;
    AttentionGeometry full{}, sliding{};
    int window = 0;
    if (cfg.has("layer_types")) {  // transformers-native dialect
        kinds = layer_kinds_from_names(cfg, "layer_types", n_layers);
        if (cfg.has("mlp_layer_types")) {
            for (const std::string& name : cfg.get_string_list("mlp_layer_types")) {
                if (name == "dense") ffns.push_back(FfnKind::dense);
                else if (name == "sparse") ffns.push_back(FfnKind::moe);
                else fail("{}: field 'mlp_layer_types': unknown entry \"{}\" (expected dense or sparse)",
                          cfg.path().string(), name);
            }
            if (ffns.size() != n_layers)
                fail("{}: field 'mlp_layer_types': expected {} entries, found {}", cfg.path().string(), n_layers,
                     ffns.size());
        } else {
            ffns.assign(n_layers, FfnKind::moe);
            ffns[0] = FfnKind::dense;
        }
        ConfigReader rope = cfg.object("rope_parameters");
        ConfigReader rope_full = rope.object("full_attention");
        ConfigReader rope_sliding = rope.object("sliding_attention");
        for (const ConfigReader* r : {&rope_full, &rope_sliding}) {
            const std::string type = r->get_string("rope_type", "default");
            if (type != "default") fail("{}: rope_type \"{}\" is not supported (only default)", cfg.path().string(), type);
        }
        full = {n_heads, n_kv_heads, head_dim, v_head_dim, rope_full.get_float("rope_theta"),
                rope_full.get_float("partial_rotary_factor", 0.334), false};
        // The native class hard-codes: sliding layers have twice the KV heads and carry sinks.
        sliding = {n_heads, 2 * n_kv_heads, head_dim, v_head_dim, rope_sliding.get_float("rope_theta"),
                   rope_sliding.get_float("partial_rotary_factor", 0.334), true};
        window = int(cfg.get_int("sliding_window"));
        config.rms_norm_eps = float(cfg.get_float("rms_norm_eps", 1e-5));
    } else if (cfg.has("hybrid_layer_pattern")) {  // hub dialect
        kinds = flags_to(cfg, "hybrid_layer_pattern", n_layers, AttentionKind::full, AttentionKind::sliding);
        if (!cfg.json().contains("moe_layer_freq") || !cfg.json()["moe_layer_freq"].is_array())
            fail("{}: field 'moe_layer_freq': expected a list of {} 0/1 entries", cfg.path().string(), n_layers);
        ffns = flags_to(cfg, "moe_layer_freq", n_layers, FfnKind::dense, FfnKind::moe);
        check_rope_scaling_is_default(cfg);
        const double partial = cfg.get_float("partial_rotary_factor", 1.0);
        full = {n_heads, n_kv_heads, head_dim, v_head_dim, cfg.get_float("rope_theta"), partial,
                cfg.get_bool("add_full_attention_sink_bias", false)};
        sliding = {int(cfg.get_int("swa_num_attention_heads", n_heads)), int(cfg.get_int("swa_num_key_value_heads")),
                   int(cfg.get_int("swa_head_dim", head_dim)), int(cfg.get_int("swa_v_head_dim", v_head_dim)),
                   cfg.get_float("swa_rope_theta", cfg.get_float("rope_theta")), partial,
                   cfg.get_bool("add_swa_attention_sink_bias", false)};
        window = int(cfg.has("sliding_window_size") ? cfg.get_int("sliding_window_size") : cfg.get_int("sliding_window"));
        config.rms_norm_eps = float(cfg.get_float("layernorm_epsilon", cfg.get_float("rms_norm_eps", 1e-5)));
    } else {
        fail("{}: MiMoV2FlashForCausalLM needs either 'layer_types' (transformers dialect) or "
             "'hybrid_layer_pattern' (hub dialect)",
             cfg.path().string());
    }

    for (size_t i = 0; i < n_layers; ++i) {
        const AttentionGeometry& g = kinds[i] == AttentionKind::full ? full : sliding;
        LayerSpec layer;
        layer.attention = kinds[i];
        layer.n_q_heads = g.n_q_heads;
        layer.n_kv_heads = g.n_kv_heads;
        layer.head_dim_k = g.head_dim_k;
        layer.head_dim_v = g.head_dim_v;
        layer.window = kinds[i] == AttentionKind::sliding ? window : 0;
        layer.has_sinks = g.sinks;
        layer.rope_theta = float(g.rope_theta);
        layer.rotary_dim = rotary_dim_for(g.head_dim_k, g.partial_rotary_factor);
        layer.ffn = ffns[i];
        config.layers.push_back(layer);
    }
    return config;
}

}  // namespace xinfer
