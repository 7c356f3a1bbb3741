#include "models/decoder.h"

#include "core/status.h"
#include "models/dummy_weights.h"

#include <cmath>
#include <cstring>

namespace xinfer {
namespace {

// Activations: f32 on host-memory backends (the oracle); on accelerators the requested dtype,
// "auto" meaning the checkpoint's own (f16 checkpoints run in bf16: same range as training).
DType choose_activation_dtype(const ModelConfig& config, const LoadOptions& options, const Backend& backend) {
    if (backend.props().host_memory) return DType::f32;
    if (options.dtype == "float32") return DType::f32;
    if (options.dtype == "bfloat16") return DType::bf16;
    if (options.dtype != "auto") fail("--dtype \"{}\": expected auto, float32 or bfloat16", options.dtype);
    return config.dtype == DType::f32 ? DType::f32 : DType::bf16;
}

// Where a weight matrix lives and in which dtype: host-memory backends (the CPU oracle) keep
// f32/bf16/f16 as stored and dequantize block-scaled FP8 to options.dequant_dtype (f32: exact);
// accelerators hold every matrix in the activation dtype.
DType resident_dtype(DType stored, const LoadOptions& options, bool host_memory, DType activation) {
    if (!host_memory) return activation;
    switch (stored) {
        case DType::f32:
        case DType::bf16:
        case DType::f16: return stored;
        default: return options.dequant_dtype;
    }
}

}  // namespace

DecoderModel::DecoderModel(ModelConfig config, Checkpoint& checkpoint, Backend& backend, const LoadOptions& options)
    : options_(options),
      config_(std::move(config)),
      backend_(backend),
      act_dtype_(choose_activation_dtype(config_, options_, backend_)),
      workspace_(backend) {
    load_weights(checkpoint);
}

Tensor DecoderModel::allocate(DType dtype, std::initializer_list<int64_t> shape) {
    Tensor t(nullptr, dtype, shape);
    buffers_.push_back(backend_.alloc(t.nbytes()));
    t.data = buffers_.back().data();
    return t;
}

// Dummy weights (src/models/dummy_weights.h), deterministic for a given seed and load order.
void DecoderModel::fill_dummy(const Tensor& t, bool is_norm) {
    const uint64_t stream = options_.dummy_seed * 0x9e3779b97f4a7c15ull + (++dummy_counter_) * 0xbf58476d1ce4e5b9ull;
    fill_dummy_weights(backend_, t, is_norm, stream);
}

Tensor DecoderModel::load(Checkpoint& checkpoint, const std::string& name, std::initializer_list<int64_t> shape,
                          bool keep_f32) {
    if (options_.dummy) {
        Tensor t = allocate(keep_f32 ? DType::f32 : dummy_matrix_dtype(), shape);
        fill_dummy(t, name.ends_with("norm.weight"));
        return t;
    }
    const bool host_memory = backend_.props().host_memory != 0;
    Tensor t = allocate(keep_f32 ? DType::f32 : resident_dtype(checkpoint.info(name).dtype, options_, host_memory, act_dtype_), shape);
    std::vector<uint8_t> host(t.nbytes());
    checkpoint.read(name, std::span<const int64_t>(shape.begin(), shape.size()), t.dtype, host.data());
    backend_.upload(t, host.data());
    backend_.synchronize();  // `host` dies here; uploads may be stream-ordered
    return t;
}

Tensor DecoderModel::load_stacked(Checkpoint& checkpoint, const std::vector<std::string>& names,
                                  std::initializer_list<int64_t> part_shape, std::initializer_list<int64_t> shape) {
    if (options_.dummy) {
        Tensor t = allocate(dummy_matrix_dtype(), shape);
        fill_dummy(t, false);
        return t;
    }
    const bool host_memory = backend_.props().host_memory != 0;
    Tensor t = allocate(resident_dtype(checkpoint.info(names.front()).dtype, options_, host_memory, act_dtype_), shape);
    XINFER_CHECK(t.nbytes() % names.size() == 0, "stacking {} tensors into {}", names.size(), t.shape_string());
    const size_t part_bytes = t.nbytes() / names.size();
    std::vector<uint8_t> host(t.nbytes());
    for (size_t i = 0; i < names.size(); ++i)
        checkpoint.read(names[i], std::span<const int64_t>(part_shape.begin(), part_shape.size()), t.dtype,
                        host.data() + i * part_bytes);
    backend_.upload(t, host.data());
    backend_.synchronize();
    return t;
}

// Experts come either stacked (transformers-native: experts.gate_up_proj [E, 2I, H] and
// experts.down_proj [E, H, I]) or one tensor per expert and projection (hub checkpoints:
// experts.E.{gate,up,down}_proj.weight). Both end up stacked as the grouped-expert op wants.
void DecoderModel::load_experts(Checkpoint& checkpoint, const std::string& prefix, LayerWeights& w) {
    const int64_t n_experts = config_.n_experts, hidden = config_.hidden_size, inter = config_.moe_intermediate_size;
    if (options_.dummy || checkpoint.has(prefix + "gate_up_proj")) {
        w.experts_gate_up = load(checkpoint, prefix + "gate_up_proj", {n_experts, 2 * inter, hidden}, false);
        w.experts_down = load(checkpoint, prefix + "down_proj", {n_experts, hidden, inter}, false);
        return;
    }
    std::vector<std::string> gate_up_names, down_names;
    for (int64_t e = 0; e < n_experts; ++e) {
        const std::string expert = prefix + std::to_string(e) + ".";
        gate_up_names.push_back(expert + "gate_proj.weight");
        gate_up_names.push_back(expert + "up_proj.weight");
        down_names.push_back(expert + "down_proj.weight");
    }
    w.experts_gate_up = load_stacked(checkpoint, gate_up_names, {inter, hidden}, {n_experts, 2 * inter, hidden});
    w.experts_down = load_stacked(checkpoint, down_names, {hidden, inter}, {n_experts, hidden, inter});
}

void DecoderModel::load_weights(Checkpoint& checkpoint) {
    const int64_t hidden = config_.hidden_size, vocab = config_.vocab_size;
    if (!options_.dummy)
        for (const std::string& prefix : config_.speculative_prefixes) checkpoint.skip_prefix(prefix);

    embed_tokens_ = load(checkpoint, "model.embed_tokens.weight", {vocab, hidden}, false);
    final_norm_ = load(checkpoint, "model.norm.weight", {hidden}, true);
    if (config_.tie_word_embeddings) {
        lm_head_ = embed_tokens_;
        if (!options_.dummy) checkpoint.skip_prefix("lm_head.weight");  // some exporters write the tied copy anyway
    } else {
        lm_head_ = load(checkpoint, "lm_head.weight", {vocab, hidden}, false);
    }

    layers_.resize(config_.layers.size());
    for (size_t i = 0; i < config_.layers.size(); ++i) {
        const LayerSpec& spec = config_.layers[i];
        LayerWeights& w = layers_[i];
        const std::string p = "model.layers." + std::to_string(i) + ".";
        w.input_norm = load(checkpoint, p + "input_layernorm.weight", {hidden}, true);
        w.post_attn_norm = load(checkpoint, p + "post_attention_layernorm.weight", {hidden}, true);
        w.q_proj = load(checkpoint, p + "self_attn.q_proj.weight", {spec.n_q_heads * spec.head_dim_k, hidden}, false);
        w.k_proj = load(checkpoint, p + "self_attn.k_proj.weight", {spec.n_kv_heads * spec.head_dim_k, hidden}, false);
        w.v_proj = load(checkpoint, p + "self_attn.v_proj.weight", {spec.n_kv_heads * spec.head_dim_v, hidden}, false);
        w.o_proj = load(checkpoint, p + "self_attn.o_proj.weight", {hidden, spec.n_q_heads * spec.head_dim_v}, false);
        if (config_.qk_norm) {
            w.q_norm = load(checkpoint, p + "self_attn.q_norm.weight", {spec.head_dim_k}, true);
            w.k_norm = load(checkpoint, p + "self_attn.k_norm.weight", {spec.head_dim_k}, true);
        }
        if (spec.has_sinks) {
            // Hub checkpoints name it attention_sink_bias; transformers-native ones sinks.
            const std::string hub_name = p + "self_attn.attention_sink_bias";
            const bool hub = !options_.dummy && checkpoint.has(hub_name);
            w.sinks = load(checkpoint, hub ? hub_name : p + "self_attn.sinks", {spec.n_q_heads}, true);
        }
        if (spec.ffn == FfnKind::dense) {
            const int64_t inter = config_.intermediate_size;
            w.gate_up = load_stacked(checkpoint, {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, {inter, hidden},
                                     {2 * inter, hidden});
            w.down = load(checkpoint, p + "mlp.down_proj.weight", {hidden, inter}, false);
        } else {
            w.router = load(checkpoint, p + "mlp.gate.weight", {config_.n_experts, hidden}, true);
            if (config_.router_bias)
                w.router_bias = load(checkpoint, p + "mlp.gate.e_score_correction_bias", {config_.n_experts}, true);
            load_experts(checkpoint, p + "mlp.experts.", w);
        }
    }
    if (!options_.dummy) checkpoint.finish();
}

std::map<DType, uint64_t> DecoderModel::weight_bytes() const {
    std::map<DType, uint64_t> bytes;
    // Buffers do not record dtypes, so sum over the tensors (tied lm_head counted once).
    auto add = [&](const Tensor& t) {
        if (t.data) bytes[t.dtype] += t.nbytes();
    };
    add(embed_tokens_);
    add(final_norm_);
    if (!config_.tie_word_embeddings) add(lm_head_);
    for (const LayerWeights& w : layers_) {
        for (const Tensor* t : {&w.input_norm, &w.post_attn_norm, &w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj, &w.q_norm,
                                &w.k_norm, &w.sinks, &w.gate_up, &w.down, &w.router, &w.router_bias,
                                &w.experts_gate_up, &w.experts_down})
            add(*t);
    }
    return bytes;
}

uint64_t DecoderModel::weight_bytes_per_decode_token() const {
    uint64_t bytes = 0;
    for (const auto& [dtype, n] : weight_bytes()) bytes += n;
    // One embedding row instead of the table (unless the table is also the lm_head).
    if (!config_.tie_word_embeddings) bytes -= embed_tokens_.nbytes() - embed_tokens_.row_bytes();
    // Only top_k of the experts of each MoE layer.
    for (const LayerWeights& w : layers_) {
        if (!w.experts_gate_up.data) continue;
        const uint64_t expert_bytes = w.experts_gate_up.nbytes() + w.experts_down.nbytes();
        bytes -= expert_bytes - expert_bytes * uint64_t(config_.router.top_k) / uint64_t(config_.n_experts);
    }
    return bytes;
}

void DecoderModel::forward(const ForwardBatch& batch, const Tensor& logits) {
    const int64_t n_tokens = batch.n_tokens, hidden = config_.hidden_size;
    XINFER_CHECK(batch.layer_group.size() == config_.layers.size() && batch.caches.size() == config_.layers.size(),
                 "batch has {} layer groups / {} caches for {} layers", batch.layer_group.size(), batch.caches.size(),
                 config_.layers.size());
    const float eps = config_.rms_norm_eps;
    workspace_.reset();
    Workspace& scratch = workspace_;
    const DType act = act_dtype_;
    auto tap = [&](std::string_view name, int layer, const Tensor& t) {
        if (batch.tap) batch.tap(name, layer, t);
    };

    Tensor residual = scratch.make(act, {n_tokens, hidden});  // the residual stream x
    Tensor normed = scratch.make(act, {n_tokens, hidden});    // RMSNorm(x), input of each block
    Tensor block_out = scratch.make(act, {n_tokens, hidden}); // output of the last block
    backend_.embedding(embed_tokens_, batch.token_ids, residual);
    tap("embedding", -1, residual);

    for (size_t il = 0; il < config_.layers.size(); ++il) {
        const LayerSpec& spec = config_.layers[il];
        const LayerWeights& w = layers_[il];
        const int layer = int(il);
        const int64_t n_q = spec.n_q_heads, n_kv = spec.n_kv_heads, dk = spec.head_dim_k, dv = spec.head_dim_v;
        backend_.set_layer(layer);  // tags every op of this layer (profiler, errors, fault injection)

        // ---- attention ----
        if (il == 0) {
            backend_.rmsnorm(residual, w.input_norm, eps, normed);
        } else {
            // The previous layer's FFN output is added to the residual stream here (fused with
            // this layer's norm), so that is where the previous layer's output becomes visible.
            backend_.add_rmsnorm(residual, block_out, w.input_norm, eps, normed);
            tap("residual", layer - 1, residual);
        }
        tap("attn_input", layer, normed);

        Tensor q = scratch.make(act, {n_tokens, n_q, dk});
        Tensor k = scratch.make(act, {n_tokens, n_kv, dk});
        Tensor v = scratch.make(act, {n_tokens, n_kv, dv});
        backend_.matmul(normed, w.q_proj, q.reshape({n_tokens, n_q * dk}));
        backend_.matmul(normed, w.k_proj, k.reshape({n_tokens, n_kv * dk}));
        backend_.matmul(normed, w.v_proj, v.reshape({n_tokens, n_kv * dv}));
        if (config_.qk_norm) {
            backend_.rmsnorm(q.reshape({n_tokens * n_q, dk}), w.q_norm, eps, q.reshape({n_tokens * n_q, dk}));
            backend_.rmsnorm(k.reshape({n_tokens * n_kv, dk}), w.k_norm, eps, k.reshape({n_tokens * n_kv, dk}));
        }
        const RopeParams rope{spec.rotary_dim, spec.rope_theta};
        backend_.rope(q, batch.positions, rope);
        backend_.rope(k, batch.positions, rope);
        if (config_.value_scale != 1.f) backend_.scale(v, config_.value_scale);
        tap("q", layer, q);
        tap("k", layer, k);
        tap("v", layer, v);

        const AttentionBatch& group = batch.groups[size_t(batch.layer_group[il])];
        const LayerCache& cache = batch.caches[il];
        backend_.kv_store(k, v, cache.k, cache.v, group);
        AttentionParams params;
        params.n_q_heads = spec.n_q_heads;
        params.n_kv_heads = spec.n_kv_heads;
        params.head_dim_k = spec.head_dim_k;
        params.head_dim_v = spec.head_dim_v;
        params.softmax_scale = float(1.0 / std::sqrt(double(dk)));
        params.window = spec.window;
        params.causal = true;
        params.page_size = int(cache.k.dim(1));
        Tensor attn = scratch.make(act, {n_tokens, n_q, dv});
        backend_.attention(q, cache.k, cache.v, w.sinks, group, params, attn);
        tap("attn_output", layer, attn);
        backend_.matmul(attn.reshape({n_tokens, n_q * dv}), w.o_proj, block_out);
        tap("attn_proj", layer, block_out);

        // ---- feed-forward ----
        backend_.add_rmsnorm(residual, block_out, w.post_attn_norm, eps, normed);
        tap("ffn_input", layer, normed);
        if (spec.ffn == FfnKind::dense) {
            const int64_t inter = config_.intermediate_size;
            Tensor gate_up = scratch.make(act, {n_tokens, 2 * inter});
            Tensor activated = scratch.make(act, {n_tokens, inter});
            backend_.matmul(normed, w.gate_up, gate_up);
            backend_.swiglu(gate_up, activated);
            backend_.matmul(activated, w.down, block_out);
        } else {
            const int64_t top_k = config_.router.top_k;
            Tensor router_logits = scratch.make(DType::f32, {n_tokens, config_.n_experts});
            Tensor expert_ids = scratch.make(DType::i32, {n_tokens, top_k});
            Tensor expert_weights = scratch.make(DType::f32, {n_tokens, top_k});
            backend_.matmul(normed, w.router, router_logits);
            tap("router_logits", layer, router_logits);
            backend_.moe_route(router_logits, w.router_bias, config_.router, expert_ids, expert_weights);
            tap("expert_ids", layer, expert_ids);
            tap("expert_weights", layer, expert_weights);
            backend_.moe_experts(normed, expert_ids, expert_weights, w.experts_gate_up, w.experts_down, block_out);
        }
        tap("ffn_output", layer, block_out);
    }

    // Final norm (after the last block's residual add), then logits for the requested rows.
    // The final add is still tagged with the last layer: it completes that layer's residual.
    backend_.add_rmsnorm(residual, block_out, final_norm_, eps, normed);
    tap("residual", int(config_.layers.size()) - 1, residual);
    backend_.set_layer(-1);
    tap("final_norm", -1, normed);
    const int64_t n_out = batch.logit_rows.numel();
    Tensor selected = scratch.make(act, {n_out, hidden});
    backend_.embedding(normed, batch.logit_rows, selected);  // row gather: same op as a table lookup
    backend_.matmul(selected, lm_head_, logits);
    tap("logits", -1, logits);
}

}  // namespace xinfer
