// xinfer info: what a checkpoint is, layer by layer, and what it weighs.
#include "commands.h"
#include "core/status.h"

#include <fmt/core.h>

namespace xinfer::cli {
namespace {

std::string human_bytes(double bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int unit = 0;
    while (bytes >= 1024 && unit < 4) {
        bytes /= 1024;
        ++unit;
    }
    return fmt::format("{:.2f} {}", bytes, units[unit]);
}

}  // namespace

void add_info_command(CLI::App& app) {
    auto model_dir = std::make_shared<std::string>();
    CLI::App* cmd = app.add_subcommand("info", "Describe a checkpoint: architecture, per-layer table, parameters, bytes");
    cmd->add_option("--model", *model_dir, "Model directory (config.json; safetensors optional)")->required();
    cmd->callback([model_dir] {
        const bool has_weights = std::filesystem::exists(std::filesystem::path(*model_dir) / "model.safetensors") ||
                                 std::filesystem::exists(std::filesystem::path(*model_dir) / "model.safetensors.index.json");
        std::unique_ptr<Checkpoint> checkpoint = Checkpoint::open(*model_dir, has_weights);
        const ModelConfig config = read_model_config(*checkpoint);
        fmt::print("architecture: {}\n", config.architecture);
        fmt::print("hidden {}  vocab {}  layers {}  rms_eps {}  tied embeddings {}  value scale {}\n", config.hidden_size,
                   config.vocab_size, config.layers.size(), config.rms_norm_eps, config.tie_word_embeddings,
                   config.value_scale);
        if (config.n_experts > 0)
            fmt::print("experts {}  top-k {}  expert width {}  router {}{}  groups {}/{}  norm_topk {}  scale {}\n",
                       config.n_experts, config.router.top_k, config.moe_intermediate_size,
                       config.router.scoring == RouterParams::Scoring::sigmoid ? "sigmoid" : "softmax",
                       config.router_bias ? "+bias" : "", config.router.topk_group, config.router.n_group,
                       config.router.norm_topk_prob, config.router.routed_scaling_factor);
        fmt::print("\n{:>5} {:>8} {:>5} {:>5} {:>6} {:>6} {:>6} {:>5} {:>10} {:>6} {:>6}\n", "layer", "attn", "q", "kv",
                   "qk_dim", "v_dim", "window", "sink", "rope_base", "rotary", "ffn");
        for (size_t i = 0; i < config.layers.size(); ++i) {
            const LayerSpec& l = config.layers[i];
            const std::string ffn = l.ffn == FfnKind::dense ? fmt::format("dense {}", config.intermediate_size)
                                                            : fmt::format("moe {}x{}", config.n_experts, config.moe_intermediate_size);
            fmt::print("{:>5} {:>8} {:>5} {:>5} {:>6} {:>6} {:>6} {:>5} {:>10g} {:>6} {}\n", i,
                       l.attention == AttentionKind::full ? "full" : "sliding", l.n_q_heads, l.n_kv_heads, l.head_dim_k,
                       l.head_dim_v, l.window ? std::to_string(l.window) : "-", l.has_sinks ? "yes" : "no", l.rope_theta,
                       l.rotary_dim, ffn);
        }
        const ParameterCounts counts = count_parameters(config);
        fmt::print("\nparameters: {:.3f} B total, {:.3f} B active per token (from config)\n", counts.total / 1e9,
                   counts.active / 1e9);
        if (has_weights) {
            uint64_t total = 0;
            for (const auto& [dtype, bytes] : checkpoint->bytes_by_dtype()) {
                fmt::print("  {:>9}: {}\n", dtype_name(dtype), human_bytes(double(bytes)));
                total += bytes;
            }
            fmt::print("  {:>9}: {} in {} tensors\n", "total", human_bytes(double(total)), checkpoint->names().size());
        } else {
            fmt::print("(no safetensors in {}: config only)\n", *model_dir);
        }
    });
}

}  // namespace xinfer::cli
