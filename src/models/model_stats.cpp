#include "models/model.h"

namespace xinfer {

ParameterCounts count_parameters(const ModelConfig& config) {
    const int64_t hidden = config.hidden_size;
    ParameterCounts counts;
    const int64_t embedding = config.vocab_size * hidden;
    counts.total = embedding + hidden + (config.tie_word_embeddings ? 0 : embedding);
    counts.active = embedding + hidden;  // lm_head (or the tied table) is read in full
    for (const LayerSpec& l : config.layers) {
        int64_t layer = 2 * hidden;                                                   // two norms
        layer += hidden * (int64_t(l.n_q_heads) * l.head_dim_k + int64_t(l.n_kv_heads) * (l.head_dim_k + l.head_dim_v));
        layer += int64_t(l.n_q_heads) * l.head_dim_v * hidden;                        // o_proj
        if (config.qk_norm) layer += 2 * l.head_dim_k;
        if (l.has_sinks) layer += l.n_q_heads;
        int64_t active = layer;
        if (l.ffn == FfnKind::dense) {
            layer += 3 * hidden * config.intermediate_size;
            active = layer;
        } else {
            const int64_t router = int64_t(config.n_experts) * hidden + (config.router_bias ? config.n_experts : 0);
            const int64_t expert = 3 * hidden * config.moe_intermediate_size;
            layer += router + int64_t(config.n_experts) * expert;
            active += router + int64_t(config.router.top_k) * expert;
        }
        counts.total += layer;
        counts.active += active;
    }
    return counts;
}

}  // namespace xinfer
