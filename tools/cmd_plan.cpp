// xinfer plan: weights, workspace and KV capacity from config.json alone, before anything loads
// (DESIGN.md decision 8). Exits with status 2 when the configuration does not fit.
#include "commands.h"
#include "core/status.h"
#include "runtime/memory_plan.h"
#include "runtime/runner.h"

#include <fmt/core.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace xinfer::cli {
namespace {

// --config FILE: Checkpoint reads <dir>/config.json, so a file of another name is copied into
// a temporary directory first.
ModelConfig read_config(const std::string& model_dir, const std::string& config_file) {
    namespace fs = std::filesystem;
    if (!model_dir.empty()) return read_model_config(*Checkpoint::open(model_dir, /*load_weights=*/false));
    const fs::path file(config_file);
    if (!fs::is_regular_file(file)) fail("--config {}: no such file", config_file);
    if (file.filename() == "config.json")
        return read_model_config(*Checkpoint::open(file.parent_path().empty() ? "." : file.parent_path(), false));
    const fs::path dir = fs::temp_directory_path() / fmt::format("xinfer-plan-{}", ::getpid());
    fs::create_directories(dir);
    fs::copy_file(file, dir / "config.json", fs::copy_options::overwrite_existing);
    ModelConfig config = read_model_config(*Checkpoint::open(dir, false));
    fs::remove_all(dir);
    return config;
}

}  // namespace

void add_plan_command(CLI::App& app) {
    struct Options {
        std::string model_dir, config_file, device = "cuda", device_memory, kv_cache_dtype = "auto", dtype = "auto";
        std::string speculative_config, fp8_weights = "auto";
        PlanOptions plan;
    };
    auto options = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand("plan", "Plan device memory (weights, workspace, KV capacity) from config.json");
    auto* model = cmd->add_option("--model", options->model_dir, "Model directory (only config.json is read)");
    auto* config = cmd->add_option("--config", options->config_file, "A config.json file");
    model->excludes(config);
    cmd->add_option("--device", options->device, "cpu or an accelerator plugin (cuda)")->default_val("cuda");
    cmd->add_option("--device-memory", options->device_memory,
                    "Memory per device: 141GiB, 80000MiB or bytes (default: query the device)");
    cmd->add_option("--gpu-memory-utilization", options->plan.gpu_memory_utilization)->default_val(0.9);
    cmd->add_option("--max-model-len", options->plan.max_model_len, "0: config's max_position_embeddings")
        ->default_val(0);
    cmd->add_option("--max-num-seqs", options->plan.max_num_seqs)->default_val(64);
    cmd->add_option("--max-num-batched-tokens", options->plan.max_num_batched_tokens)->default_val(2048);
    cmd->add_option("--kv-cache-dtype", options->kv_cache_dtype, "auto, float32, bfloat16, fp8 (e4m3 + per-row scales)")
        ->default_val("auto");
    cmd->add_option("--fp8-weights", options->fp8_weights,
                    "FP8 checkpoints on accelerators: auto (e4m3 + block scales, as CUDA runs them) or dequantize")
        ->check(CLI::IsMember({"auto", "keep", "dequantize"}))
        ->default_val("auto");
    cmd->add_option("--dtype", options->dtype, "Activations on accelerators: auto, float32, bfloat16")
        ->check(CLI::IsMember({"auto", "float32", "bfloat16"}))
        ->default_val("auto");
    cmd->add_option("--tensor-parallel-size", options->plan.tensor_parallel_size)->default_val(1);
    cmd->add_option("--speculative-config", options->speculative_config,
                    R"(JSON, e.g. {"method": "mtp", "num_speculative_tokens": 3})");
    cmd->add_option("--min-tokens-per-page", options->plan.min_tokens_per_page)->default_val(16);
    cmd->callback([options] {
        if (options->model_dir.empty() && options->config_file.empty()) fail("plan: give --model DIR or --config FILE");
        const ModelConfig config = read_config(options->model_dir, options->config_file);
        PlanOptions plan = options->plan;
        const bool host = options->device == "cpu";
        uint64_t free_memory = 0;  // what the device has free now (its own memory only, not a given size)
        if (!options->device_memory.empty()) {
            plan.device_memory = parse_memory_size(options->device_memory);
        } else {
            const xinfer_device_props props = make_backend(options->device)->props();
            plan.device_memory = props.total_memory;
            if (!props.host_memory) free_memory = props.free_memory;
        }
        // The dtypes the decoder will choose on that device (src/models/decoder.cpp).
        plan.activation_dtype = host                                ? DType::f32
                                : options->dtype == "float32"       ? DType::f32
                                : options->dtype == "bfloat16"      ? DType::bf16
                                : config.dtype == DType::f32 ? DType::f32
                                                                    : DType::bf16;
        plan.weight_dtype = host ? config.dtype : plan.activation_dtype;
        // Without a device to ask (keep_fp8_weights), assume an accelerator runs fp8 matrices as CUDA does.
        plan.fp8_weights = !host && options->fp8_weights != "dequantize" && config.fp8.enabled &&
                           (options->fp8_weights == "keep" || plan.activation_dtype != DType::f32);
        plan.kv_dtype = resolve_kv_cache_dtype(options->kv_cache_dtype, plan.activation_dtype);
        plan.speculative_config = options->speculative_config;
        const MemoryPlan result = plan_memory(config, plan);
        fmt::print("model: {} ({} layers, device {})\n", config.architecture, config.layers.size(), options->device);
        fmt::print("{}", result.report());
        if (!result.fits) std::exit(2);
        // The engine's start-up check (Engine::create): the budget must be free now.
        const std::string shortfall = free_memory > 0 ? free_memory_shortfall(result, free_memory) : std::string();
        if (!shortfall.empty()) {
            fmt::print("does NOT fit what is free on {} now: {}\n", options->device, shortfall);
            std::exit(2);
        }
    });
}

}  // namespace xinfer::cli
