// Memory planning (DESIGN.md decision 8): weights, workspace and KV capacity computed from
// config.json alone, before anything loads. `xinfer plan` prints it; Engine startup runs the
// same arithmetic and refuses to start with its verdict instead of failing mid-load.
//
// Budget per device (rank): device_memory × gpu_memory_utilization
//     = weights (per rank) + workspace peak + speculative reserve + KV pool.
// The KV pool is whole pages of make_kv_layout(model groups, kv dtype). A configuration fits
// when the weights and workspace leave room for one max_model_len sequence plus the sliding-
// window pages of the other max_num_seqs - 1 sequences (every running sequence keeps its window).
#pragma once

#include "kv/kv_layout.h"
#include "spec/speculative_config.h"
#include "models/model.h"

#include <cstdint>
#include <string>
#include <vector>

namespace xinfer {

struct PlanOptions {
    uint64_t device_memory = 0;           // bytes per device
    double gpu_memory_utilization = 0.9;  // fraction of device_memory xinfer may use
    int64_t max_model_len = 0;            // 0: config's max_position_embeddings
    int max_num_seqs = 64;
    int64_t max_num_batched_tokens = 2048;
    DType weight_dtype = DType::bf16;      // matrices as loaded (norms, routers, sinks stay f32)
    // Block-scaled FP8 matrices (config.fp8.quantizes) stay e4m3 + f32 scales instead of
    // weight_dtype (LoadOptions::fp8_weights "auto" on a backend that runs them).
    bool fp8_weights = false;
    DType activation_dtype = DType::bf16;  // activations and workspace
    DType kv_dtype = DType::bf16;
    int tensor_parallel_size = 1;
    std::string speculative_config;  // JSON or empty
    int min_tokens_per_page = 16;
    int64_t kv_cache_memory = 0;  // > 0: the KV pool is exactly this many bytes (override)
};


struct WeightLine {
    DType dtype;
    uint64_t sharded = 0;     // per rank (already divided by tensor_parallel_size)
    uint64_t replicated = 0;  // every rank holds all of it
};

struct KvGroupPlan {
    bool sliding = false;
    int window = 0;
    int n_layers = 0;
    int n_kv_heads_per_rank = 0;
    int64_t bytes_per_token = 0;  // all layers of the group, per rank
    int64_t tokens_per_page = 0;
    int64_t window_bytes = 0;  // sliding: window × bytes_per_token (exact)
    int64_t window_pages = 0;  // sliding: pages a decoding sequence holds at most (page-rounded)
};

struct MemoryPlan {
    PlanOptions options;
    int64_t max_model_len = 0;
    std::vector<WeightLine> weights;
    uint64_t weight_bytes = 0;      // per rank
    uint64_t decode_weight_bytes = 0;  // per rank, read by a batch-1 decode step: top_k experts, one embedding row
    uint64_t workspace_bytes = 0;   // activation peak of one step
    std::string workspace_formula;  // how workspace_bytes was computed, with its terms
    uint64_t speculative_bytes = 0;
    std::string speculative_note;
    KvLayout layout;
    std::vector<KvGroupPlan> groups;
    int64_t full_bytes_per_token = 0;      // growing part: every full group, per token
    int64_t sliding_bytes_per_seq = 0;     // fixed part, exact (window tokens)
    int64_t sliding_pages_per_seq = 0;     // fixed part, page-rounded
    uint64_t budget_bytes = 0;             // device_memory × utilization
    int64_t kv_bytes = 0;                  // pool (whole pages); negative when weights+workspace exceed the budget
    int64_t n_pages = 0;
    int64_t pages_per_full_sequence = 0;   // one max_model_len sequence, every group
    int64_t capacity_tokens = 0;           // tokens the pool holds with max_num_seqs windows reserved
    int64_t full_length_sequences = 0;     // max_model_len sequences that fit at once
    bool fits = false;
    std::string verdict;  // one paragraph: why it does (not) fit and what would

    std::string report() const;  // the text `xinfer plan` prints
};

MemoryPlan plan_memory(const ModelConfig& config, const PlanOptions& options);

// Bytes the plan takes from the device once loaded: weights, workspace, speculative reserve and
// the KV pool (the whole budget when the pool is sized from it).
uint64_t planned_device_bytes(const MemoryPlan& plan);
// Empty when the plan's bytes fit in `free_bytes` (what the device has free before loading: other
// processes, or another engine, may hold part of it); else why not and what would fit, in the
// terms of vLLM's startup check (gpu_memory_utilization is a fraction of the total, not the free).
std::string free_memory_shortfall(const MemoryPlan& plan, uint64_t free_bytes);

// Pages one sequence of n_tokens holds at most, every group together, when it is prefilled in
// chunks of at most `chunk` tokens (sliding groups: the window plus the chunk, page-rounded).
int64_t max_pages_per_sequence(const KvLayout& layout, int64_t n_tokens, int64_t chunk);
// Longest sequence a pool of n_pages can hold alone.
int64_t max_sequence_tokens(const KvLayout& layout, int64_t n_pages, int64_t chunk);

// "141GiB", "512MiB", "2.5GB", "1000000" → bytes (GiB/MiB/KiB binary, GB/MB/KB decimal).
uint64_t parse_memory_size(const std::string& text);

}  // namespace xinfer
