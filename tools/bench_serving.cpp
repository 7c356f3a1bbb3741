// Offline serving benchmark: for each concurrency c, c random prompts (fixed seed) of input_len
// tokens are submitted at once and decoded for output_len tokens through the Engine. Prints
// output tokens/s, TTFT and inter-token latency percentiles, and the achieved fraction of the
// bytes-moved roofline over the decode steps:
//   bytes(step) = non-expert weights (attention, dense FFN, norms, routers, lm_head, one embedding row)
//               + distinct experts per MoE layer × expert bytes
//               + KV each sequence reads (its context, windowed per layer)
//   fraction    = Σ bytes(step) / Σ time(step) / measured copy bandwidth.
// Distinct experts are measured: for MoE models each level's prompts first run once untimed with
// the engine's expert census on (Engine::set_expert_census), which gives the mean distinct experts
// per MoE layer of the decode steps at each batch size (the scheduler is deterministic, so the
// timed run has the same steps). Uniform routing, E·(1 − (1 − k/E)^b), is printed next to it:
// random dummy weights route a batch to fewer experts than that.
#include "bench_serving.h"

#include "core/status.h"
#include "kv/kv_layout.h"
#include "runtime/runner.h"
#include "xinfer/engine.h"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <sstream>

namespace xinfer::cli {
namespace {

using Clock = std::chrono::steady_clock;

double percentile(std::vector<double> values, double p) {
    if (values.empty()) return 0;
    std::sort(values.begin(), values.end());
    const size_t index = size_t(std::ceil(p / 100.0 * double(values.size()))) - (p > 0 ? 1 : 0);
    return values[std::min(index, values.size() - 1)];
}

std::vector<int> parse_list(const std::string& text) {
    std::vector<int> values;
    std::stringstream stream(text);
    std::string item;
    while (std::getline(stream, item, ',')) {
        const int value = std::atoi(item.c_str());
        if (value < 1) fail("--concurrency \"{}\": \"{}\" is not a positive integer", text, item);
        values.push_back(value);
    }
    return values;
}

// Bytes one decode step must read (see the file comment): weights as the engine holds them,
// KV from the config.
struct StepBytes {
    double dense = 0;        // every weight a step reads regardless of routing
    double expert = 0;       // one expert of one layer
    int moe_layers = 0, n_experts = 0, top_k = 0;
    const ModelConfig* config = nullptr;
    DType kv_dtype = DType::bf16;

    std::map<int, double> measured_distinct;  // decode batch → mean distinct experts per MoE layer

    double uniform_distinct(int batch) const { return n_experts * (1 - std::pow(1 - double(top_k) / n_experts, batch)); }
    double distinct(int batch) const {
        auto it = measured_distinct.find(batch);
        return it != measured_distinct.end() ? it->second : uniform_distinct(batch);
    }
    double weights(int batch) const { return moe_layers == 0 ? dense : dense + moe_layers * distinct(batch) * expert; }
    double kv(int64_t context) const { return kv_bytes_read(*config, context, kv_dtype); }
};

}  // namespace

double kv_bytes_read(const ModelConfig& config, int64_t context, DType kv_dtype) {
    double bytes = 0;
    for (const LayerSpec& l : config.layers) {
        const int64_t keys = l.window > 0 ? std::min<int64_t>(context, l.window) : context;
        bytes += double(keys) * double(kv_bytes_per_token_per_layer(kv_dtype, l.n_kv_heads, l.head_dim_k, l.head_dim_v));
    }
    return bytes;
}

namespace {

// The engine's own count (Engine::decode_weight_bytes: FP8-resident matrices at their e4m3 bytes
// plus scales, f32 norms and routers), split into the routing-independent part and one expert.
StepBytes step_bytes(const ModelConfig& config, const DecodeWeightBytes& weights, DType kv_dtype) {
    StepBytes s;
    s.config = &config;
    s.n_experts = config.n_experts;
    s.top_k = config.router.top_k;
    s.expert = double(weights.per_expert);
    for (const LayerSpec& l : config.layers) s.moe_layers += l.ffn == FfnKind::moe;
    s.dense = double(weights.batch1) - s.moe_layers * s.top_k * s.expert;
    s.kv_dtype = kv_dtype;
    return s;
}

// A step that only decodes: every request that got tokens had its first one before, and nothing
// waits to be admitted (the roofline counts these steps only).
bool decode_only_step(const std::vector<RequestOutput>& outputs, const EngineStats& stats) {
    bool decode_only = !outputs.empty() && stats.waiting == 0;
    for (const RequestOutput& out : outputs)
        if (!out.new_tokens.empty()) decode_only = decode_only && out.generated_tokens > 1;
    return decode_only;
}

// The untimed census pass of one level (see the file comment): mean distinct experts per MoE
// layer of its decode steps, by batch size.
std::map<int, double> census_distinct_experts(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                              int64_t output_len) {
    engine.set_expert_census(true);
    for (const std::vector<int32_t>& prompt : prompts) engine.submit(prompt, {}, int(output_len));
    std::map<int, std::pair<double, int64_t>> sums;  // batch → (Σ per-step mean, steps)
    while (engine.has_work()) {
        const EngineStats before = engine.stats();
        const std::vector<RequestOutput> outputs = engine.step();
        const EngineStats after = engine.stats();
        const int64_t layer_steps = after.census_moe_layer_steps - before.census_moe_layer_steps;
        if (!decode_only_step(outputs, after) || layer_steps == 0) continue;
        auto& [sum, steps] = sums[int(outputs.size())];
        sum += double(after.census_distinct_experts - before.census_distinct_experts) / double(layer_steps);
        ++steps;
    }
    engine.set_expert_census(false);
    std::map<int, double> mean;
    for (const auto& [batch, entry] : sums) mean[batch] = entry.first / double(entry.second);
    return mean;
}

}  // namespace

void run_serving_bench(const ModelOptions& model, const ServingBenchOptions& options) {
    const std::vector<int> levels = parse_list(options.concurrency);
    const int max_concurrency = *std::max_element(levels.begin(), levels.end());
    EngineOptions engine_options;
    engine_options.model_dir = model.model_dir;
    engine_options.device = model.device;
    engine_options.load_format = model.load_format;
    engine_options.dtype = model.dtype;
    engine_options.fp8_weights = model.fp8_weights;
    engine_options.max_num_seqs = max_concurrency;
    engine_options.max_num_batched_tokens = options.max_num_batched_tokens;
    engine_options.max_model_len = options.input_len + options.output_len;
    engine_options.kv_cache_dtype = options.kv_cache_dtype;
    engine_options.enforce_eager = model.enforce_eager;
    engine_options.overlap_decode = options.overlap_decode;
    engine_options.speculative_config = options.speculative_config;
    if (model.max_cached_tokens > 0) engine_options.kv_cache_tokens = model.max_cached_tokens;
    std::unique_ptr<Engine> engine = Engine::create(engine_options);

    // The config (read again: only config.json) and the bandwidth measured on a second context.
    const ModelConfig config = read_model_config(*Checkpoint::open(model.model_dir, false));
    auto backend = make_backend(model.device);
    const bool host = backend->props().host_memory != 0;
    const DType act = host ? DType::f32 : (config.dtype == DType::f32 ? DType::f32 : DType::bf16);
    const DecodeWeightBytes weights = engine->decode_weight_bytes();
    StepBytes bytes = step_bytes(config, weights, resolve_kv_cache_dtype(options.kv_cache_dtype, act));
    const double bandwidth_gbps = backend->measure_copy_bandwidth_gbps();
    backend.reset();

    fmt::print("model: {} on {}, weights read by a batch-1 step {:.1f} MB (one expert {:.2f} MB), input {} / "
               "output {} tokens, max_num_batched_tokens {}\n",
               config.architecture, model.device, double(weights.batch1) / 1e6, double(weights.per_expert) / 1e6,
               options.input_len, options.output_len, options.max_num_batched_tokens);
    fmt::print("measured copy bandwidth: {:.2f} GB/s\n\n", bandwidth_gbps);
    const bool moe = bytes.moe_layers > 0;
    fmt::print("| concurrency | output tok/s | TTFT p50 / p90 / p99 (s) | ITL p50 / p90 / p99 (ms) | decode batch | "
               "bytes/decode step | roofline fraction | preemptions |{}\n",
               moe ? " experts per MoE layer, measured (uniform routing) |" : "");
    fmt::print("|---:|---:|---|---|---:|---:|---:|---:|{}\n", moe ? "---|" : "");

    std::mt19937 rng(uint32_t(options.seed));
    std::uniform_int_distribution<int32_t> token(0, int32_t(config.vocab_size - 1));
    std::vector<std::string> spec_rows;
    for (int concurrency : levels) {
        std::map<uint64_t, std::vector<Clock::time_point>> arrivals;  // id → token times
        std::map<uint64_t, int64_t> context;                         // id → tokens so far
        std::vector<double> ttft;
        std::vector<std::vector<int32_t>> prompts(size_t(concurrency), std::vector<int32_t>(size_t(options.input_len)));
        for (std::vector<int32_t>& prompt : prompts)
            for (int32_t& t : prompt) t = token(rng);
        if (moe) bytes.measured_distinct = census_distinct_experts(*engine, prompts, options.output_len);
        const int64_t preemptions_before = engine->stats().preemptions;
        const SpecCounters spec_before = engine->stats().spec;
        const Clock::time_point start = Clock::now();
        for (const std::vector<int32_t>& prompt : prompts) {
            const uint64_t id = engine->submit(prompt, {}, int(options.output_len));
            arrivals[id] = {};
            context[id] = options.input_len;
        }
        double decode_bytes = 0, decode_seconds = 0, distinct_sum = 0, uniform_sum = 0;
        int64_t decode_steps = 0, decode_rows = 0, generated = 0;
        while (engine->has_work()) {
            const Clock::time_point step_start = Clock::now();
            const std::vector<RequestOutput> outputs = engine->step();
            const Clock::time_point step_end = Clock::now();
            double kv = 0;
            for (const RequestOutput& out : outputs) {
                if (out.new_tokens.empty()) continue;
                kv += bytes.kv(context[out.id]);
                context[out.id] += int64_t(out.new_tokens.size());
                arrivals[out.id].push_back(step_end);
                generated += int64_t(out.new_tokens.size());
                if (out.generated_tokens == 1) ttft.push_back(out.time_to_first_token_s);
            }
            if (decode_only_step(outputs, engine->stats())) {
                const int batch = int(outputs.size());
                decode_bytes += bytes.weights(batch) + kv;
                distinct_sum += bytes.distinct(batch);
                uniform_sum += bytes.uniform_distinct(batch);
                decode_seconds += std::chrono::duration<double>(step_end - step_start).count();
                decode_rows += batch;
                ++decode_steps;
            }
        }
        const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
        std::vector<double> itl;
        for (const auto& [id, times] : arrivals)
            for (size_t i = 1; i < times.size(); ++i)
                itl.push_back(1e3 * std::chrono::duration<double>(times[i] - times[i - 1]).count());
        const double fraction = decode_seconds > 0 ? decode_bytes / decode_seconds / (bandwidth_gbps * 1e9) : 0;
        const double steps = double(std::max<int64_t>(decode_steps, 1));
        fmt::print("| {} | {:.2f} | {:.3f} / {:.3f} / {:.3f} | {:.1f} / {:.1f} / {:.1f} | {:.1f} | {:.1f} MB | {:.1f}% | {} "
                   "|{}\n",
                   concurrency, double(generated) / seconds, percentile(ttft, 50), percentile(ttft, 90),
                   percentile(ttft, 99), percentile(itl, 50), percentile(itl, 90), percentile(itl, 99),
                   double(decode_rows) / steps, decode_bytes / steps / 1e6, 100 * fraction,
                   engine->stats().preemptions - preemptions_before,
                   moe ? fmt::format(" {:.1f} ({:.1f}) |", distinct_sum / steps, uniform_sum / steps) : "");
        std::fflush(stdout);
        const EngineStats stats = engine->stats();
        if (!stats.spec_method.empty()) {
            // This level's share of the cumulative counters (vLLM's spec_decode_* metrics).
            SpecCounters level = stats.spec;
            level.num_drafts -= spec_before.num_drafts;
            level.num_draft_tokens -= spec_before.num_draft_tokens;
            level.num_accepted_tokens -= spec_before.num_accepted_tokens;
            std::string per_position;
            for (size_t i = 0; i < level.accepted_per_position.size(); ++i) {
                const int64_t before =
                    i < spec_before.accepted_per_position.size() ? spec_before.accepted_per_position[i] : 0;
                per_position += fmt::format("{}{:.2f}", i ? " " : "",
                                            level.num_drafts ? double(level.accepted_per_position[i] - before) /
                                                                   double(level.num_drafts)
                                                             : 0.0);
            }
            spec_rows.push_back(fmt::format(
                "| {} | {} | {} | {} | {} | {:.3f} | {:.1f}% | {} |", concurrency, stats.spec_method, level.num_drafts,
                level.num_draft_tokens, level.num_accepted_tokens, level.mean_acceptance_length(),
                level.num_draft_tokens ? 100.0 * double(level.num_accepted_tokens) / double(level.num_draft_tokens) : 0.0,
                per_position));
        }
    }
    if (!options.profile.empty()) {
        // A separate pass after the timed levels, since profiled steps run eagerly: the highest
        // concurrency's requests, profiled over decode-only steps once every prompt is in.
        constexpr int kProfiledSteps = 8;
        std::vector<uint64_t> ids;
        for (int i = 0; i < max_concurrency; ++i) {
            std::vector<int32_t> prompt(size_t(options.input_len));
            for (int32_t& t : prompt) t = token(rng);
            ids.push_back(engine->submit(std::move(prompt), {}, int(options.output_len)));
        }
        int profiled = 0;
        size_t emitting = 0;  // requests that got a token in the last step: all of them once every prefill is done
        while (engine->has_work() && profiled < kProfiledSteps) {
            const bool decoding = emitting == ids.size();
            if (decoding && profiled == 0) engine->start_profile();
            const std::vector<RequestOutput> outputs = engine->step();
            profiled += decoding;
            emitting = size_t(std::count_if(outputs.begin(), outputs.end(),
                                            [](const RequestOutput& o) { return !o.new_tokens.empty(); }));
        }
        if (profiled == 0) fail("--profile: the requests finished before a decode step (raise --output-len)");
        const std::string summary = engine->stop_profile(options.profile);
        for (uint64_t id : ids) engine->abort(id);
        while (engine->has_work()) engine->step();
        fmt::print("\nprofile of {} decode steps at concurrency {} (eager; timings include profiling overhead):\n{}"
                   "wrote {}\n",
                   profiled, max_concurrency, summary, options.profile);
    }
    if (!spec_rows.empty()) {
        fmt::print("\nspeculative decoding (drafts = verify chains; acceptance length = tokens per verify step):\n");
        fmt::print("| concurrency | method | drafts | draft tokens | accepted | mean acceptance length | acceptance rate "
                   "| accepted per position |\n|---:|---|---:|---:|---:|---:|---:|---|\n");
        for (const std::string& row : spec_rows) fmt::print("{}\n", row);
    }
}

}  // namespace xinfer::cli
