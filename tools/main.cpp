// xinfer: inference engine for hybrid-attention MoE models. `xinfer --help` lists the subcommands.
#include "commands.h"
#include "core/status.h"
#include "loader/checkpoint.h"

#include <fmt/core.h>

#include <charconv>

namespace xinfer::cli {

void ModelOptions::add_to(CLI::App& app) {
    app.add_option("--model", model_dir, "Model directory (config.json + safetensors)")->required();
    app.add_option("--device", device, "Device to run on")->default_val("cpu");
    app.add_option("--load-format", load_format, "safetensors, or dummy (random weights of the configured shapes)")
        ->check(CLI::IsMember({"safetensors", "dummy"}))
        ->default_val("safetensors");
    app.add_option("--max-cached-tokens", max_cached_tokens, "KV cache capacity in tokens per layer group (0: auto)");
    app.add_option("--dtype", dtype, "Activation dtype on accelerators: auto (the checkpoint's), float32, bfloat16")
        ->check(CLI::IsMember({"auto", "float32", "bfloat16"}))
        ->default_val("auto");
    app.add_option("--fp8-weights", fp8_weights,
                   "Block-scaled FP8 matrices on accelerators: auto (keep e4m3 + scales where the backend runs them, "
                   "with bf16 activations), keep (also with float32 activations) or dequantize (expand at load)")
        ->check(CLI::IsMember({"auto", "keep", "dequantize"}))
        ->default_val("auto");
    app.add_flag("--enforce-eager", enforce_eager,
                 "Run decode steps eagerly instead of replaying captured graphs (also XINFER_CUDA_GRAPHS=0)");
}

LoadedModel load(const ModelOptions& options) {
    LoadedModel loaded;
    loaded.backend = make_backend(options.device);
    const bool dummy = options.load_format == "dummy";
    loaded.checkpoint = Checkpoint::open(options.model_dir, /*load_weights=*/!dummy);
    LoadOptions load_options;
    load_options.dummy = dummy;
    load_options.dtype = options.dtype;
    load_options.fp8_weights = options.fp8_weights;
    loaded.model = load_model(*loaded.checkpoint, *loaded.backend, load_options);
    return loaded;
}

std::vector<int32_t> parse_ids(const std::string& text) {
    std::vector<int32_t> ids;
    size_t begin = 0;
    while (begin <= text.size()) {
        size_t end = text.find(',', begin);
        if (end == std::string::npos) end = text.size();
        std::string_view item(text.data() + begin, end - begin);
        while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
        while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
        int32_t value = 0;
        auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
        if (item.empty() || ec != std::errc() || ptr != item.data() + item.size() || value < 0)
            fail("invalid token id \"{}\" in \"{}\" (expected comma-separated non-negative integers)", item, text);
        ids.push_back(value);
        begin = end + 1;
    }
    return ids;
}

}  // namespace xinfer::cli

int main(int argc, char** argv) {
    CLI::App app{"xinfer: an inference engine for hybrid-attention Mixture-of-Experts models"};
    app.require_subcommand(1);
    xinfer::cli::add_generate_command(app);
    xinfer::cli::add_logits_command(app);
    xinfer::cli::add_info_command(app);
    xinfer::cli::add_bench_command(app);
    xinfer::cli::add_ops_test_command(app);
    xinfer::cli::add_dump_command(app);
    xinfer::cli::add_xray_command(app);
    xinfer::cli::add_plan_command(app);
    xinfer::cli::add_serve_command(app);
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    } catch (const std::exception& e) {
        fmt::print(stderr, "error: {}\n", e.what());
        return 1;
    }
    return 0;
}
