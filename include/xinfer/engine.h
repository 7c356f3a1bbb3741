// The serving engine's public C++ API: submit token-id requests with sampling parameters,
// step the engine, receive streamed tokens. Used by the CLI, the benchmarks and (later) the
// server. The path of a request (DESIGN.md): submit → Scheduler (continuous batching, chunked
// prefill, FCFS, preemption by recompute) → KV pages → one forward per step → sampler → callback.
//
// Threading: submit() and abort() may be called from any thread. step() is called by one
// thread at a time (the engine loop); callbacks run on the thread that calls step() (or
// abort(), for the abort event) while the engine holds its lock: they must not call back into
// the engine. Memory: create() plans memory from config.json first (as `xinfer plan`) and
// refuses to start, before loading any weight, when the plan does not fit.
#pragma once

#include "xinfer/sampling_params.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace xinfer {

struct EngineOptions {
    std::string model_dir;
    std::string device = "cpu";
    std::string load_format = "safetensors";  // or "dummy"
    std::string dtype = "auto";               // activations on accelerators: auto, float32, bfloat16
    std::string fp8_weights = "auto";         // FP8 checkpoints: auto (keep e4m3 + scales where supported, bf16 activations), keep, dequantize
    int max_num_seqs = 64;
    int64_t max_num_batched_tokens = 2048;
    int64_t max_model_len = 0;  // 0: config's max_position_embeddings
    std::string kv_cache_dtype = "auto";
    double gpu_memory_utilization = 0.9;
    uint64_t device_memory = 0;    // bytes; 0: the backend's total memory
    int64_t kv_cache_memory = 0;   // bytes of KV pool; 0: whatever the plan leaves (host-memory backends: ≤ 4 GiB)
    int64_t kv_cache_tokens = 0;   // > 0: pool holds this many tokens per layer group (overrides kv_cache_memory)
    int min_tokens_per_page = 16;
    bool enable_prefix_caching = false;
    // vLLM's --speculative-config JSON: {"method": "dflash"|"mtp"|"ngram", "model": DIR,
    // "num_speculative_tokens": k, "prompt_lookup_min"/"prompt_lookup_max"}. Empty: none.
    std::string speculative_config;
    // Run every step eagerly instead of replaying captured decode graphs (vLLM's --enforce-eager;
    // XINFER_CUDA_GRAPHS=0 does the same).
    bool enforce_eager = false;
    // Overlapped decode (vLLM's async scheduling): when the next step is certain to be the same
    // sequences decoding one more token each, it is queued on the device, fed with this step's
    // sampled ids there, before the host waits for those ids; the device then never idles while
    // the host hands out a step's tokens. Needs a backend with asynchronous downloads (CUDA).
    // On by default since the argmax moved into the decode graph and small downloads became a
    // kernel: H200, batch-1 MiMo decode, the time a step spends outside its graph went from 50-92
    // µs step by step to 10-30 µs (docs/perf/2026-12-02-h200-session23.md). The price: a request
    // that stops keeps its row in the queued step, computed and thrown away.
    bool overlap_decode = true;
};

// Speculative decoding counters (vLLM's spec_decode_* metrics): a draft is one verified chain.
struct SpecCounters {
    int64_t num_drafts = 0;
    int64_t num_draft_tokens = 0;
    int64_t num_accepted_tokens = 0;
    std::vector<int64_t> accepted_per_position;  // [k]: drafts whose token at position i was accepted
    // Mean tokens emitted per verify step (accepted drafts + the target's token).
    double mean_acceptance_length() const {
        return num_drafts ? 1.0 + double(num_accepted_tokens) / double(num_drafts) : 0.0;
    }
    void add(const std::vector<int32_t>& proposed, int accepted) {
        ++num_drafts;
        num_draft_tokens += int64_t(proposed.size());
        num_accepted_tokens += accepted;
        if (accepted_per_position.size() < proposed.size()) accepted_per_position.resize(proposed.size(), 0);
        for (int i = 0; i < accepted; ++i) ++accepted_per_position[size_t(i)];
    }
};

// One request's news from a step: tokens sampled this step and, when finished, why.
struct RequestOutput {
    uint64_t id = 0;
    std::vector<int32_t> new_tokens;
    bool finished = false;
    std::string finish_reason;  // "stop", "length", "abort" when finished
    // With a tokenizer: the text this step made final (special tokens left out; joined over a
    // request's outputs it is the whole completion, cut before a stop string, invalid UTF-8 as
    // U+FFFD). A running request holds back an unfinished character, and with stop strings the
    // bytes a stop string could still begin in, until later tokens settle them. Empty otherwise.
    std::string text;
    int64_t prompt_tokens = 0;
    int64_t cached_prompt_tokens = 0;  // prompt tokens served by the prefix cache at first admission
    int64_t generated_tokens = 0;      // so far
    int preemptions = 0;
    double time_to_first_token_s = -1;  // since submit; -1 before the first token
    double elapsed_s = 0;               // since submit
    // Speculative decoding in this step: the drafts verified and how many were accepted
    // (proposed empty and accepted -1 when this step verified none); totals so far.
    std::vector<int32_t> proposed;
    int accepted = -1;
    SpecCounters spec;
};

using StreamCallback = std::function<void(const RequestOutput&)>;

struct EngineStats {
    int64_t steps = 0;
    int64_t preemptions = 0;
    int64_t prefix_query_tokens = 0;
    int64_t prefix_hit_tokens = 0;
    int64_t running = 0;
    int64_t waiting = 0;
    int64_t kv_pages_total = 0;
    int64_t kv_pages_free = 0;  // free or evictable
    int64_t max_model_len = 0;
    std::string spec_method;  // empty without speculation
    SpecCounters spec;
    // Expert census (set_expert_census): MoE layer-steps counted, and the distinct experts they
    // touched in total (each layer of each step counts the experts any of its tokens chose).
    int64_t census_moe_layer_steps = 0;
    int64_t census_distinct_experts = 0;
    // Overlapped decode: steps queued on the device before the host had the previous step's
    // tokens, and rows of them thrown away because their request had finished meanwhile.
    int64_t overlapped_steps = 0;
    int64_t overlap_wasted_rows = 0;
};

// What the loaded weights cost to read in a decode step, as held on the device (FP8-resident
// matrices count their e4m3 bytes and scales): the benchmarks' rooflines.
struct DecodeWeightBytes {
    uint64_t batch1 = 0;      // a batch-1 step: every dense weight, top_k experts per MoE layer, one embedding row
    uint64_t per_expert = 0;  // one expert of one MoE layer (0 without experts)
};

class Engine {
public:
    // Plans memory, loads the model, allocates the KV pool. Throws with the plan's verdict when
    // the configuration does not fit.
    static std::unique_ptr<Engine> create(const EngineOptions& options);
    ~Engine();

    // Queues a request; returns its id (> 0). Throws for an empty prompt, or one that leaves no
    // room for a generated token within max_model_len, and for stop strings (sampling.stop) when
    // the model has no tokenizer. stop_ids end generation after emitting one.
    uint64_t submit(std::vector<int32_t> prompt, const SamplingParams& sampling, int max_tokens,
                    std::vector<int32_t> stop_ids = {}, StreamCallback callback = {});
    // Ends a request wherever it is and frees all its KV pages at once. False if unknown/finished.
    bool abort(uint64_t id);
    // One scheduler step: schedule → one forward → sample → complete. Returns every request's
    // news (also passed to its callback); empty when there was nothing to do.
    std::vector<RequestOutput> step();
    bool has_work() const;
    EngineStats stats() const;
    // The memory plan the engine started from (`xinfer plan`'s text).
    const std::string& plan_report() const;
    DecodeWeightBytes decode_weight_bytes() const;
    // Whether the model came with a tokenizer.json: stop strings and RequestOutput::text need it.
    bool has_tokenizer() const;
    // Text → prompt ids with the model's tokenizer.json. Throws with the reason when there is
    // none, or it cannot encode (tokenizer/bpe_encoder.h).
    std::vector<int32_t> encode(const std::string& text) const;

    // Op-level profile (src/runtime/profiler.h) of every step from start_profile() to
    // stop_profile(), each step a region of the trace. Profiled steps run eagerly (a replayed
    // graph would hide its ops), so they are slower than unprofiled ones. stop_profile() writes
    // the Chrome trace to trace_path and returns the per-op summary table.
    void start_profile();
    std::string stop_profile(const std::string& trace_path);
    // While on, every step downloads each MoE layer's routing and counts the distinct experts
    // it touched (EngineStats::census_*): what a step's expert weights really cost to read,
    // where benchmarks would otherwise assume uniform routing. Counted steps run eagerly.
    void set_expert_census(bool on);
    // EngineOptions::overlap_decode, switched at run time (tests compare the two).
    void set_overlap_decode(bool on);

    struct Impl;
    explicit Engine(std::unique_ptr<Impl> impl);

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace xinfer
