// The one table mapping config.json's architectures[0] to a config reader, plus the helpers
// every architecture shares.
#include "core/status.h"
#include "models/architectures.h"
#include "models/decoder.h"
#include "models/fp8_weights.h"

#include <fmt/ranges.h>

#include <functional>
#include <map>

namespace xinfer {
namespace {

using ConfigFn = std::function<ModelConfig(const ConfigReader&)>;

const std::map<std::string, ConfigFn>& registry() {
    static const std::map<std::string, ConfigFn> table = {
        {"MiMoV2FlashForCausalLM", read_mimo_v2_flash_config},
        {"Qwen3ForCausalLM", [](const ConfigReader& cfg) { return read_qwen3_config(cfg, /*moe=*/false); }},
        {"Qwen3MoeForCausalLM", [](const ConfigReader& cfg) { return read_qwen3_config(cfg, /*moe=*/true); }},
    };
    return table;
}

}  // namespace

std::vector<std::string> supported_architectures() {
    std::vector<std::string> names;
    for (const auto& [name, fn] : registry()) names.push_back(name);
    return names;
}

int rotary_dim_for(int head_dim, double partial_rotary_factor) {
    return int(double(head_dim) * partial_rotary_factor);
}

void check_rope_scaling_is_default(const ConfigReader& cfg) {
    for (const char* key : {"rope_scaling", "rope_parameters"}) {
        if (!cfg.has(key)) continue;
        ConfigReader rope = cfg.object(key);
        const std::string type = rope.get_string("rope_type", rope.get_string("type", "default"));
        if (type != "default")
            fail("{}: {}.rope_type \"{}\" is not supported yet (only default RoPE)", cfg.path().string(), key, type);
    }
}

ModelConfig read_model_config(const Checkpoint& checkpoint) {
    ConfigReader cfg(checkpoint.config(), checkpoint.config_path());
    std::vector<std::string> architectures = cfg.get_string_list("architectures");
    if (architectures.empty()) fail("{}: field 'architectures' is empty", cfg.path().string());
    auto it = registry().find(architectures[0]);
    if (it == registry().end())
        fail("{}: unknown architecture \"{}\"; supported: {}", cfg.path().string(), architectures[0],
             fmt::join(supported_architectures(), ", "));
    ModelConfig config = it->second(cfg);
    config.architecture = architectures[0];
    // transformers ≥ 5 writes "dtype", older versions "torch_dtype".
    const std::string dtype = cfg.get_string("dtype", cfg.get_string("torch_dtype", "bfloat16"));
    if (dtype == "float32") config.dtype = DType::f32;
    else if (dtype == "bfloat16") config.dtype = DType::bf16;
    else if (dtype == "float16") config.dtype = DType::f16;
    else fail("{}: dtype \"{}\" is not supported (float32, bfloat16, float16)", cfg.path().string(), dtype);
    config.fp8 = read_fp8_weight_config(checkpoint.config(), checkpoint.fp8());
    for (size_t i = 0; i < config.layers.size(); ++i) {
        const LayerSpec& l = config.layers[i];
        if (l.n_kv_heads <= 0 || l.n_q_heads % l.n_kv_heads != 0)
            fail("{}: layer {}: {} query heads are not a multiple of {} KV heads", cfg.path().string(), i, l.n_q_heads,
                 l.n_kv_heads);
        if (l.rotary_dim % 2 != 0 || l.rotary_dim > l.head_dim_k)
            fail("{}: layer {}: rotary dim {} must be even and ≤ head_dim {}", cfg.path().string(), i, l.rotary_dim,
                 l.head_dim_k);
        if (l.ffn == FfnKind::moe && (config.router.top_k <= 0 || config.router.top_k > config.n_experts))
            fail("{}: num_experts_per_tok {} must be in 1..{}", cfg.path().string(), config.router.top_k,
                 config.n_experts);
    }
    if (config.router.n_group < 1 || config.n_experts % config.router.n_group != 0 ||
        config.router.topk_group > config.router.n_group)
        fail("{}: n_group {} / topk_group {} do not divide {} experts", cfg.path().string(), config.router.n_group,
             config.router.topk_group, config.n_experts);
    return config;
}

std::vector<KvGroupSpec> kv_groups_for(const ModelConfig& config) {
    std::vector<KvGroupSpec> groups;
    for (size_t i = 0; i < config.layers.size(); ++i) {
        const LayerSpec& l = config.layers[i];
        auto same = [&](const KvGroupSpec& g) {
            return g.kind == l.attention && g.window == l.window && g.n_kv_heads == l.n_kv_heads &&
                   g.head_dim_k == l.head_dim_k && g.head_dim_v == l.head_dim_v;
        };
        auto it = std::find_if(groups.begin(), groups.end(), same);
        if (it == groups.end()) {
            groups.push_back({l.attention, l.window, l.n_kv_heads, l.head_dim_k, l.head_dim_v, {}});
            it = groups.end() - 1;
        }
        it->layers.push_back(int(i));
    }
    return groups;
}

std::unique_ptr<Model> load_model(Checkpoint& checkpoint, Backend& backend, const LoadOptions& options) {
    return std::make_unique<DecoderModel>(read_model_config(checkpoint), checkpoint, backend, options);
}

}  // namespace xinfer
