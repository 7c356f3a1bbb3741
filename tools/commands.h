// The `xinfer` CLI: one file per subcommand, each registering itself on the CLI11 app.
#pragma once

#include "models/model.h"
#include "runtime/runner.h"

#include <CLI/CLI.hpp>

#include <memory>
#include <string>
#include <vector>

namespace xinfer::cli {

// Options every model-running subcommand shares.
struct ModelOptions {
    std::string model_dir;
    std::string device = "cpu";
    std::string load_format = "safetensors";  // or "dummy"
    int64_t max_cached_tokens = 0;            // 0: enough for the request at hand
    std::string dtype = "auto";               // activations on accelerators
    std::string fp8_weights = "auto";         // FP8 matrices: auto (keep e4m3 where supported) or dequantize
    bool enforce_eager = false;               // no decode graphs (RunnerOptions::enforce_eager)
    void add_to(CLI::App& app);
};

// A loaded model and the backend it lives on (backend outlives the model).
struct LoadedModel {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Checkpoint> checkpoint;
    std::unique_ptr<Model> model;
};
LoadedModel load(const ModelOptions& options);

// "1,2,3" → {1, 2, 3}; errors name the bad entry.
std::vector<int32_t> parse_ids(const std::string& text);

void add_generate_command(CLI::App& app);
void add_logits_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_ops_test_command(CLI::App& app);
void add_dump_command(CLI::App& app);
void add_xray_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_serve_command(CLI::App& app);

}  // namespace xinfer::cli
