// `xinfer bench --concurrency ...`: offline serving benchmark through the Engine.
#pragma once

#include "commands.h"
#include "models/model.h"

#include <string>

namespace xinfer::cli {

struct ServingBenchOptions {
    std::string concurrency;  // "1,8,32,64"
    int64_t input_len = 512;
    int64_t output_len = 256;
    int64_t max_num_batched_tokens = 2048;
    std::string kv_cache_dtype = "auto";
    uint64_t seed = 0;
    std::string speculative_config;  // JSON or empty
    std::string profile;             // Chrome trace of decode steps at the highest concurrency, or empty
    bool overlap_decode = true;      // EngineOptions::overlap_decode (--no-overlap turns it off)
};

void run_serving_bench(const ModelOptions& model, const ServingBenchOptions& options);

// Bytes of K and V one sequence's decode step reads at context `context` from a cache of
// `kv_dtype` (fp8: with its per-row scales): each layer reads what its window allows.
double kv_bytes_read(const ModelConfig& config, int64_t context, DType kv_dtype);

}  // namespace xinfer::cli
