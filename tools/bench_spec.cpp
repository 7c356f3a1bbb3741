#include "bench_spec.h"

#include "core/status.h"
#include "spec/drafter.h"

#include "device_limits.h"

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <random>

namespace xinfer::cli {
namespace {

template <typename Fn>
double median_seconds(int iterations, Backend& backend, Fn&& fn) {
    std::vector<double> times;
    fn();  // warm-up (workspace growth, lazy allocations)
    backend.synchronize();
    for (int i = 0; i < iterations; ++i) {
        const double start = now_seconds();
        fn();
        backend.synchronize();
        times.push_back(now_seconds() - start);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}

}  // namespace

void run_spec_bench(const ModelOptions& model_options, const SpecBenchOptions& options) {
    const SpeculativeConfig config = parse_speculative_config(options.speculative_config);
    LoadedModel loaded = load(model_options);
    Model& model = *loaded.model;
    Backend& backend = *loaded.backend;
    const int64_t vocab = model.config().vocab_size;
    const int64_t context = options.context;

    // Room for the timed steps: each moves the sequence on by up to 32 tokens.
    const DrafterContext drafter_context{model, backend, model_options.model_dir, model_options.load_format == "dummy",
                                         1, context + 32 * int64_t(options.iterations + 2) + 64};
    std::unique_ptr<Drafter> drafter = make_drafter(config, drafter_context);
    const int k = drafter->num_speculative_tokens();

    RunnerOptions runner_options;
    runner_options.max_cached_tokens = context + k + 64;
    runner_options.feature_layers = drafter->feature_layers();
    Runner runner(model, backend, runner_options);

    // A random context, prefilled and handed to the drafter as a real run would.
    std::mt19937 rng(uint32_t(options.seed));
    std::uniform_int_distribution<int32_t> token(0, int32_t(vocab - 1));
    std::vector<int32_t> tokens(static_cast<size_t>(context));
    for (int32_t& t : tokens) t = token(rng);
    const int seq = 0;
    SequenceChunk prefill{seq, 0, tokens, false};
    runner.step(std::span(&prefill, 1));
    tokens.push_back(token(rng));  // the anchor
    TargetHidden prefill_hidden{runner.features(), {{seq, 0, 0, context, tokens}}};
    drafter->observe(prefill_hidden);
    backend.synchronize();

    // Plain decode step and verify step at the same context: forward over the anchor alone and
    // over [anchor, d1 … dk]. Nothing is committed, so every repetition sees the same cache.
    std::vector<int32_t> chain(tokens.end() - 1, tokens.end());
    for (int i = 0; i < k; ++i) chain.push_back(token(rng));
    XINFER_CHECK(runner.kv().allocate(seq, context + 1 + k), "KV pool too small for the verify chain");
    const SequenceChunk decode_chunk{seq, context, std::span(chain).first(1), false};
    const SequenceChunk verify_chunk{seq, context, chain, true};
    const double decode_s = median_seconds(options.iterations, backend, [&] { runner.forward(std::span(&decode_chunk, 1)); });
    const double verify_s = median_seconds(options.iterations, backend, [&] { runner.forward(std::span(&verify_chunk, 1)); });

    // The drafter's share of a step, as the engine drives it: observe the rows a step commits
    // (the anchor + all k drafts, the most a step commits), then propose for the next anchor.
    // Each repetition moves the sequence on by k + 1 tokens, so no work is ever cached.
    runner.forward(std::span(&verify_chunk, 1));  // features of k + 1 rows
    const int reps = options.iterations + 1;     // the first is a warm-up
    for (int i = 0; i < reps * (k + 1) + 1; ++i) tokens.push_back(token(rng));
    std::vector<double> observe_times, propose_times;
    int proposed = 0;
    int64_t anchor = context;
    for (int i = 0; i < reps; ++i) {
        const TargetHidden committed{runner.features(), {{seq, 0, anchor, 1 + k, tokens}}};
        double start = now_seconds();
        drafter->observe(committed);
        backend.synchronize();
        const double observed = now_seconds() - start;
        anchor += 1 + k;
        const DraftRequest request{seq, std::span(tokens).first(size_t(anchor + 1)), k};
        start = now_seconds();
        proposed = int(drafter->propose(std::span(&request, 1)).at(0).size());
        if (i == 0) continue;
        observe_times.push_back(observed);
        propose_times.push_back(now_seconds() - start);
    }
    std::sort(observe_times.begin(), observe_times.end());
    std::sort(propose_times.begin(), propose_times.end());
    const double observe_s = observe_times[observe_times.size() / 2];
    const double propose_s = propose_times[propose_times.size() / 2];
    const double draft_s = propose_s + observe_s;

    fmt::print("model: {} on {}, context {} tokens, method {} (k = {}, {} proposed)\n", model.config().architecture,
               backend.name(), context, drafter->method(), k, proposed);
    fmt::print("decode step (1 token):        {:8.3f} ms\n", decode_s * 1e3);
    fmt::print("verify step ({} tokens):       {:8.3f} ms = {:.2f}x a decode step (target <= 1.3x)\n", k + 1,
               verify_s * 1e3, verify_s / decode_s);
    fmt::print("drafter propose + observe:    {:8.3f} ms ({:.3f} + {:.3f}) = {:.1f}% of a decode step\n", draft_s * 1e3,
               propose_s * 1e3, observe_s * 1e3, 100.0 * draft_s / decode_s);
    fmt::print("\nspeedup model: tokens/s = tau / (verify + draft) against 1 / decode = {:.2f} tokens/s\n", 1.0 / decode_s);
    fmt::print("| tau (tokens/step) | tokens/s | speedup |\n|---:|---:|---:|\n");
    nlohmann::json model_rows = nlohmann::json::array();
    for (int tau = 1; tau <= k + 1; ++tau) {
        const double tps = double(tau) / (verify_s + draft_s);
        fmt::print("| {} | {:.2f} | {:.2f}x |\n", tau, tps, tps * decode_s);
        model_rows.push_back({{"tau", tau}, {"tokens_per_s", tps}});
    }
    nlohmann::json line = {{"method", drafter->method()},     {"k", k},
                           {"decode_step_s", decode_s},       {"verify_step_s", verify_s},
                           {"verify_over_decode", verify_s / decode_s},
                           {"draft_s", draft_s},              {"draft_over_decode", draft_s / decode_s},
                           {"speedup_model", model_rows}};
    fmt::print("{}\n", line.dump());
}

}  // namespace xinfer::cli
