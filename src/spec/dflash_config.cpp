// DFlash drafter config.json (both dialects) and the mask-embedding sidecar; see dflash.h.
#include "core/status.h"
#include "loader/safetensors_file.h"
#include "models/architectures.h"
#include "spec/dflash.h"

#include <fmt/ranges.h>

#include <cmath>
#include <fstream>
#include <optional>

namespace xinfer {
namespace {

// z-lab's build_target_layer_ids: one tapped layer per draft layer, evenly spread over
// [1, L - 3] (the middle layer for a single draft layer).
std::vector<int> default_target_layer_ids(int num_target_layers, int num_draft_layers) {
    if (num_draft_layers == 1) return {num_target_layers / 2};
    const int start = 1, end = num_target_layers - 3;
    std::vector<int> ids;
    for (int i = 0; i < num_draft_layers; ++i)
        ids.push_back(int(std::lround(start + double(i) * (end - start) / double(num_draft_layers - 1))));
    return ids;
}

}  // namespace

std::vector<float> read_mask_embedding_sidecar(const std::filesystem::path& dir, int64_t hidden,
                                               std::filesystem::path* found) {
    const std::filesystem::path st = dir / "mask_embedding.safetensors", raw = dir / "mask_embedding.bin",
                                pt = dir / "mask_embedding.pt";
    std::vector<float> values;
    if (std::filesystem::exists(st)) {
        auto file = SafetensorsFile::open(st);
        if (file->tensors().size() != 1)
            fail("{}: expected exactly one tensor (the mask embedding), found {}", st.string(), file->tensors().size());
        const TensorInfo& t = file->tensors().front();
        const bool shape_ok = (t.shape.size() == 1 && t.shape[0] == hidden) ||
                              (t.shape.size() == 2 && t.shape[0] == 1 && t.shape[1] == hidden);
        if (!shape_ok)
            fail("{}: tensor {}: expected shape [{}] (hidden_size), found {}", st.string(), t.name, hidden,
                 t.shape_string());
        if (t.dtype != DType::f32 && t.dtype != DType::bf16 && t.dtype != DType::f16)
            fail("{}: tensor {}: expected dtype F32, BF16 or F16, found {}", st.string(), t.name, dtype_name(t.dtype));
        values.resize(size_t(hidden));
        convert_to_f32(t.dtype, t.data, values.data(), hidden);
        if (found) *found = st;
    } else if (std::filesystem::exists(raw)) {
        const uintmax_t bytes = std::filesystem::file_size(raw);
        if (bytes != uintmax_t(hidden) * sizeof(float))
            fail("{}: expected {} bytes (hidden_size {} little-endian float32 values), found {} bytes", raw.string(),
                 hidden * int64_t(sizeof(float)), hidden, bytes);
        values.resize(size_t(hidden));
        std::ifstream in(raw, std::ios::binary);
        if (!in.read(reinterpret_cast<char*>(values.data()), std::streamsize(bytes)))
            fail("{}: read failed", raw.string());
        if (found) *found = raw;
    } else if (std::filesystem::exists(pt)) {
        fail("{}: a PyTorch pickle, which xinfer cannot read (no torch). Convert it once, next to it:\n"
             "  python3 -c \"import torch; t = torch.load('mask_embedding.pt', weights_only=True); "
             "t = t['embedding'] if isinstance(t, dict) else t; "
             "t.reshape(-1).float().numpy().tofile('mask_embedding.bin')\"\n"
             "(mask_embedding.bin: {} little-endian float32 values; mask_embedding.safetensors with one [{}] tensor "
             "works too)",
             pt.string(), hidden, hidden);
    }
    for (float v : values)
        if (!std::isfinite(v)) fail("{}: the mask embedding holds a non-finite value", (found ? *found : raw).string());
    return values;
}

DFlashConfig read_dflash_config(const Checkpoint& checkpoint, const ModelConfig& target, bool load_sidecar) {
    ConfigReader cfg(checkpoint.config(), checkpoint.config_path());
    const std::string path = cfg.path().string();
    DFlashConfig c;
    c.config_path = cfg.path();

    const std::vector<std::string> architectures = cfg.get_string_list("architectures");
    if (architectures.empty() || architectures[0].find("DFlash") == std::string::npos)
        fail("{}: field 'architectures': expected [\"DFlashDraftModel\"] (a DFlash drafter), found [{}]", path,
             fmt::join(architectures, ", "));

    const bool has_dflash = cfg.has("dflash_config");
    if (has_dflash && !cfg.json()["dflash_config"].is_object()) cfg.type_error("dflash_config", "an object");
    const nlohmann::json empty = nlohmann::json::object();
    ConfigReader dflash = has_dflash ? cfg.object("dflash_config") : ConfigReader(empty, cfg.path(), "dflash_config.");

    c.vocab_size = target.vocab_size;
    c.hidden_size = cfg.get_int("hidden_size");
    c.intermediate_size = cfg.get_int("intermediate_size");
    const int n_layers = int(cfg.get_int("num_hidden_layers"));
    if (n_layers < 1) fail("{}: field 'num_hidden_layers': expected ≥ 1, found {}", path, n_layers);
    c.n_q_heads = int(cfg.get_int("num_attention_heads"));
    c.n_kv_heads = int(cfg.get_int("num_key_value_heads", c.n_q_heads));
    if (c.n_q_heads <= 0 || c.n_kv_heads <= 0 || c.n_q_heads % c.n_kv_heads != 0)
        fail("{}: field 'num_key_value_heads': expected a divisor of num_attention_heads {}, found {}", path,
             c.n_q_heads, c.n_kv_heads);
    c.head_dim = int(cfg.get_int("head_dim", c.hidden_size / c.n_q_heads));
    c.rms_norm_eps = float(cfg.get_float("rms_norm_eps", 1e-6));
    if (cfg.get_bool("attention_bias", false))
        fail("{}: field 'attention_bias': expected false (biased projections are not supported), found true", path);
    const std::string act = cfg.get_string("hidden_act", "silu");
    if (act != "silu") fail("{}: field 'hidden_act': expected \"silu\", found \"{}\"", path, act);
    if (!cfg.get_bool("is_neox_style", true))
        fail("{}: field 'is_neox_style': expected true (only NeoX rotate-half RoPE is implemented), found false", path);
    if (!dflash.get_bool("use_aux_hidden_state", cfg.get_bool("use_aux_hidden_state", true)))
        fail("{}: field 'dflash_config.use_aux_hidden_state': expected true (drafters without fc are not supported)",
             path);
    check_rope_scaling_is_default(cfg);
    double theta = cfg.get_float("rope_theta", 1000000.0);
    if (cfg.has("rope_parameters")) theta = cfg.object("rope_parameters").get_float("rope_theta", theta);
    c.rope_theta = float(theta);
    c.rotary_dim = rotary_dim_for(c.head_dim, cfg.get_float("partial_rotary_factor", 1.0));
    if (c.rotary_dim % 2 != 0 || c.rotary_dim <= 0 || c.rotary_dim > c.head_dim)
        fail("{}: rotary dim {} (head_dim {} × partial_rotary_factor) must be even and in 2..head_dim", path,
             c.rotary_dim, c.head_dim);

    // Block.
    if (cfg.has("block_size")) c.block_size = int(cfg.get_int("block_size"));
    else if (dflash.has("block_size")) c.block_size = int(dflash.get_int("block_size"));
    else fail("{}: missing required field 'block_size' (top level, or dflash_config.block_size)", path);
    if (c.block_size < 2 || c.block_size > 32)
        fail("{}: field 'block_size': expected 2..32 (anchor + up to 31 drafts), found {}", path, c.block_size);

    // Compatibility with the target.
    const int target_layers = int(target.layers.size());
    const int num_target_layers = int(cfg.get_int("num_target_layers", target_layers));
    if (num_target_layers != target_layers)
        fail("{}: field 'num_target_layers': the drafter was built for a {}-layer target, this target has {} layers",
             path, num_target_layers, target_layers);
    if (dflash.has("target_layer_ids")) {
        for (int64_t id : dflash.get_int_list("target_layer_ids")) c.target_layer_ids.push_back(int(id));
        if (c.target_layer_ids.empty())
            fail("{}: field 'dflash_config.target_layer_ids': expected at least one layer id, found []", path);
    } else {
        c.target_layer_ids = default_target_layer_ids(target_layers, n_layers);
    }
    for (int id : c.target_layer_ids)
        if (id < 0 || id >= target_layers)
            fail("{}: field 'dflash_config.target_layer_ids': layer id {} is outside the target's layers 0..{}", path,
                 id, target_layers - 1);
    c.target_hidden_size = cfg.get_int("target_hidden_size", target.hidden_size);
    if (c.target_hidden_size != target.hidden_size)
        fail("{}: field 'target_hidden_size': expected the target's hidden_size {}, found {}", path,
             target.hidden_size, c.target_hidden_size);
    if (cfg.has("vocab_size") && cfg.get_int("vocab_size") != target.vocab_size)
        fail("{}: field 'vocab_size': expected the target's vocab_size {}, found {}", path, target.vocab_size,
             cfg.get_int("vocab_size"));
    if (cfg.has("draft_vocab_size") && cfg.get_int("draft_vocab_size") != target.vocab_size)
        fail("{}: field 'draft_vocab_size': reduced draft vocabularies (d2t) are not supported; expected {}, found {}",
             path, target.vocab_size, cfg.get_int("draft_vocab_size"));
    // Embedding rows and lm_head rows are hidden-wide; the target's are target.hidden_size wide.
    if (c.hidden_size != target.hidden_size && !checkpoint.has("lm_head.weight"))
        fail("{}: field 'hidden_size': expected the target's hidden_size {} (the drafter borrows its embedding and "
             "lm_head), found {}",
             path, target.hidden_size, c.hidden_size);

    if (dflash.has("mask_token_id")) c.mask_token_id = int32_t(dflash.get_int("mask_token_id"));
    else if (cfg.has("mask_token_id")) c.mask_token_id = int32_t(cfg.get_int("mask_token_id"));
    if (c.mask_token_id != -1 && (c.mask_token_id < 0 || c.mask_token_id >= target.vocab_size))
        fail("{}: field 'dflash_config.mask_token_id': expected an id below the target's vocab_size {}, found {}",
             path, target.vocab_size, c.mask_token_id);

    // Attention per layer (vLLM's _resolve_layer_attention).
    const bool use_swa = dflash.get_bool("use_swa", false);
    std::vector<bool> listed_sliding(size_t(n_layers), false);
    bool any_listed_sliding = false;
    const bool has_layer_types = cfg.has("layer_types");
    if (has_layer_types) {
        const std::vector<std::string> types = cfg.get_string_list("layer_types");
        if (types.size() != size_t(n_layers))
            fail("{}: field 'layer_types': expected {} entries (num_hidden_layers), found {}", path, n_layers,
                 types.size());
        for (size_t i = 0; i < types.size(); ++i) {
            if (types[i] == "sliding_attention") listed_sliding[i] = any_listed_sliding = true;
            else if (types[i] != "full_attention")
                fail("{}: field 'layer_types': entry {} is \"{}\", expected full_attention or sliding_attention", path,
                     i, types[i]);
        }
    }
    std::optional<bool> causal_override;
    if (cfg.has("is_causal")) causal_override = cfg.get_bool("is_causal", false);
    else if (dflash.has("causal")) causal_override = dflash.get_bool("causal", false);
    int window = 0;
    for (int i = 0; i < n_layers; ++i) {
        const bool sliding = (!has_layer_types || (use_swa && !any_listed_sliding)) ? use_swa : listed_sliding[size_t(i)];
        DFlashLayerAttention layer;
        if (sliding) {
            if (window == 0) {
                if (dflash.has("swa_window_size")) window = int(dflash.get_int("swa_window_size"));
                else if (cfg.has("sliding_window")) window = int(cfg.get_int("sliding_window"));
                else
                    fail("{}: layer {} is sliding but no window is set: expected dflash_config.swa_window_size or "
                         "sliding_window",
                         path, i);
                if (window < 1)
                    fail("{}: field '{}': expected a window ≥ 1, found {}", path,
                         dflash.has("swa_window_size") ? "dflash_config.swa_window_size" : "sliding_window", window);
            }
            layer.window = window;
        }
        layer.causal = causal_override ? *causal_override : listed_sliding[size_t(i)];
        c.layers.push_back(layer);
    }
    c.sinks = dflash.get_bool("attention_sink_bias", cfg.get_bool("add_swa_attention_sink_bias", false));
    c.value_scale = float(dflash.get_float("attention_value_scale", cfg.get_float("attention_value_scale", 1.0)));

    if (load_sidecar) c.mask_embedding = read_mask_embedding_sidecar(checkpoint.dir(), c.hidden_size, &c.mask_embedding_file);
    if (c.mask_token_id == -1 && c.mask_embedding.empty())
        fail("{}: missing required field 'dflash_config.mask_token_id' (and no mask_embedding sidecar in {})", path,
             checkpoint.dir().string());
    return c;
}

}  // namespace xinfer
