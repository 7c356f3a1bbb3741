// xinfer bench: prefill and decode speed of one sequence, each next to the limit it is measured
// against in the same run (decode: weight + KV bytes per token over the measured copy
// bandwidth; prefill: achieved matmul FLOP/s).
#include "bench_serving.h"
#include "bench_spec.h"
#include "commands.h"
#include "core/status.h"
#include "device_limits.h"
#include "runtime/profiler.h"

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <random>

namespace xinfer::cli {
namespace {

// The middle value (the mean of the two middle ones for an even count); 0 when empty.
double median(std::vector<double> values) {
    if (values.empty()) return 0;
    std::sort(values.begin(), values.end());
    const size_t mid = values.size() / 2;
    return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

}  // namespace

void add_bench_command(CLI::App& app) {
    struct Options {
        ModelOptions model;
        int64_t prompt_len = 128;
        int64_t gen_len = 32;
        uint64_t seed = 0;
        std::string profile;
        ServingBenchOptions serving;
        int verify_iterations = 20;
    };
    auto options = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand("bench", "Measure prefill and decode speed against the device's limits");
    options->model.add_to(*cmd);
    cmd->add_option("--prompt-len", options->prompt_len, "Prompt tokens (prefill)")->default_val(128);
    cmd->add_option("--gen-len", options->gen_len, "Decode steps")->default_val(32);
    cmd->add_option("--seed", options->seed, "Seed of the random prompt")->default_val(0);
    cmd->add_option("--profile", options->profile,
                    "Write a Chrome trace (Perfetto) of every op to this .json file and print a per-op summary");
    cmd->add_option("--concurrency", options->serving.concurrency,
                    "Serving mode through the Engine: comma-separated concurrencies, e.g. 1,8,32,64");
    cmd->add_option("--input-len", options->serving.input_len, "Serving mode: prompt tokens")->default_val(512);
    cmd->add_option("--output-len", options->serving.output_len, "Serving mode: generated tokens")->default_val(256);
    cmd->add_option("--max-num-batched-tokens", options->serving.max_num_batched_tokens, "Serving mode: step budget")
        ->default_val(2048);
    cmd->add_option("--kv-cache-dtype", options->serving.kv_cache_dtype, "auto (the activation dtype), float32, bfloat16, fp8 (e4m3 + per-row scales)")
        ->default_val("auto");
    cmd->add_option("--speculative-config", options->serving.speculative_config,
                    "Speculative decoding (vLLM's JSON). Serving mode: acceptance metrics per concurrency; otherwise: "
                    "cost of a verify step and of the drafter next to a decode step, and the speedup model");
    cmd->add_option("--spec-iterations", options->verify_iterations, "Timed repetitions per speculative measurement")
        ->default_val(20);
    cmd->add_flag("--overlap,!--no-overlap", options->serving.overlap_decode,
                  "Overlapped decode (EngineOptions::overlap_decode, the default): queue each step before the previous "
                  "step's token reaches the host; --no-overlap decodes step by step");
    cmd->callback([options] {
        if (options->serving.concurrency.empty() && !options->serving.speculative_config.empty()) {
            if (!options->profile.empty())
                fail("--profile is not available for the speculative step benchmark (without --concurrency); profile "
                     "speculative steps with `xinfer generate --speculative-config ... --profile FILE` or "
                     "`xinfer bench --concurrency ... --speculative-config ... --profile FILE`");
            run_spec_bench(options->model, {options->serving.speculative_config, options->prompt_len,
                                            options->verify_iterations, options->seed});
            return;
        }
        if (!options->serving.concurrency.empty()) {
            options->serving.seed = options->seed;
            options->serving.profile = options->profile;
            run_serving_bench(options->model, options->serving);
            return;
        }
        LoadedModel loaded = load(options->model);
        const ModelConfig& config = loaded.model->config();
        Backend& backend = *loaded.backend;

        const double bandwidth_gbps = backend.measure_copy_bandwidth_gbps();

        std::mt19937 rng(uint32_t(options->seed));
        std::uniform_int_distribution<int32_t> token(0, int32_t(config.vocab_size - 1));
        std::vector<int32_t> prompt(size_t(options->prompt_len));
        for (int32_t& t : prompt) t = token(rng);

        RunnerOptions runner_options;
        runner_options.kv_cache_dtype = options->serving.kv_cache_dtype;
        runner_options.max_cached_tokens = options->prompt_len + options->gen_len + 16;
        runner_options.enforce_eager = options->model.enforce_eager || !options->profile.empty();
        runner_options.max_graph_batch = 1;
        Runner runner(*loaded.model, backend, runner_options);
        // Captured before the timed steps, as an engine does at startup.
        const double capture_start = now_seconds();
        const int captured = runner.capture_graphs();
        const double capture_seconds = now_seconds() - capture_start;

        // A first prefill, of another prompt of the same length, pays the process's one-time costs
        // (lazy kernel loading, cuBLASLt's algorithm choice for each new shape: on the H200 the
        // first 4,096-token MiMo prefill takes ~0.1 s longer). The timed prefill is the second, as in
        // a server that has been up a while; the first is reported beside it.
        std::vector<int32_t> first_prompt(prompt.size());
        for (int32_t& t : first_prompt) t = token(rng);
        double start = now_seconds();
        const SequenceChunk first_prefill{1, 0, first_prompt, false};
        runner.step(std::span(&first_prefill, 1));
        const double first_prefill_seconds = now_seconds() - start;
        runner.release(1);  // its pages go back before the timed prefill

        std::unique_ptr<Profiler> profiler;
        if (!options->profile.empty()) profiler = std::make_unique<Profiler>(backend);

        // Prefill the whole prompt in one step.
        if (profiler) profiler->begin_region("prefill");
        start = now_seconds();
        SequenceChunk prefill{0, 0, prompt, false};
        std::vector<float> logits = runner.step(std::span(&prefill, 1));
        const double prefill_seconds = now_seconds() - start;
        if (profiler) profiler->end_region();

        // Decode: greedy, one token per step.
        std::vector<int32_t> generated;
        generated.push_back(int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
        // Host memory is shared with the machine's neighbours, whose load moves the copy bandwidth
        // by up to 1.6x within minutes (docs/perf/2026-11-30-cpu.md). There the decode runs in
        // windows of kWindowSteps steps, each right after its own copy probe, and every window's
        // fraction is reported against that probe (the probes are not timed).
        constexpr int64_t kWindowSteps = 8;
        const bool windows = backend.props().host_memory != 0 && !profiler;
        std::vector<double> window_gbps, window_seconds;
        double decode_seconds = 0;
        std::vector<double> step_times;  // step by step: each step's time (seconds)
        // Overlapped unless --no-overlap, as the engine decodes (EngineOptions::overlap_decode):
        // step i + 1 is queued, reading step i's id on the device, before the host waits for that id.
        const bool overlapped = options->serving.overlap_decode && backend.has_async_downloads() && !profiler && !windows;
        if (overlapped) {
            int32_t pending = 0;  // the newest step's id, landing at wait_downloads
            Tensor ids;           // [1] on the device: the newest step's id
            start = now_seconds();
            for (int64_t i = 0; i < options->gen_len; ++i) {
                const int64_t position = options->prompt_len + i;
                SequenceChunk chunk{0, position, std::span(generated).last(1), false};  // i > 0: a placeholder
                const Tensor logits = runner.step_on_device(std::span(&chunk, 1), {}, ids);
                if (i > 0) {
                    backend.wait_downloads();
                    generated.push_back(pending);
                    runner.set_token(0, position, pending);
                }
                ids = runner.argmax_rows_on_device(logits);
                backend.download_async(ids, &pending);
            }
            backend.wait_downloads();
            generated.push_back(pending);
            decode_seconds = now_seconds() - start;
        }
        for (int64_t i = 0; i < options->gen_len && !overlapped; ++i) {
            if (windows && i % kWindowSteps == 0) {
                window_gbps.push_back(backend.measure_copy_bandwidth_gbps());
                window_seconds.push_back(0);
            }
            SequenceChunk chunk{0, options->prompt_len + i, std::span(generated).last(1), false};
            if (profiler) profiler->begin_region(fmt::format("decode step {}", i));
            start = now_seconds();
            // Greedy on the device, as the engine picks tokens: only the id comes back.
            generated.push_back(runner.argmax_rows(runner.step_on_device(std::span(&chunk, 1)))[0]);
            const double step_seconds = now_seconds() - start;  // the forward and picking its token
            decode_seconds += step_seconds;
            step_times.push_back(step_seconds);
            if (windows) window_seconds.back() += step_seconds;
            if (profiler) profiler->end_region();
        }

        // The last step's graph again, back to back: the device's own time per step, so that the
        // rest of a timed step (metadata, launch, the id's download and wait) shows.
        const DecodeGraphs::ReplayTimes replay =
            profiler ? DecodeGraphs::ReplayTimes{} : runner.time_last_decode_replay(16);
        const double replay_seconds = replay.graph;

        const ParameterCounts params = count_parameters(config);
        const double prefill_tps = double(options->prompt_len) / prefill_seconds;
        const double decode_tps = double(options->gen_len) / decode_seconds;
        const double weight_bytes = double(loaded.model->weight_bytes_per_decode_token());
        const double kv_bytes =
            kv_bytes_read(config, options->prompt_len + options->gen_len / 2, runner.kv().layout().dtype);
        const double bytes_per_token = weight_bytes + kv_bytes;
        const double achieved_gbps = bytes_per_token * decode_tps / 1e9;
        const double roofline_tps = bandwidth_gbps * 1e9 / bytes_per_token;
        // Matmul FLOPs of prefill: 2 per active weight per token (attention scores excluded), against
        // the rate of one large matmul measured now (ops-test --perf's peak) on accelerators. On the
        // CPU, whose limit here is decode bandwidth, a 1024³ matmul is no ceiling for the prefill's
        // shapes, so no fraction is printed.
        const double prefill_gflops = 2.0 * double(params.active) * prefill_tps / 1e9;
        const MatmulPeak peak = backend.props().host_memory ? MatmulPeak{} : measure_matmul_peak(backend);

        fmt::print("model: {} ({:.3f} B params, {:.3f} B active), device {}\n", config.architecture,
                   params.total / 1e9, params.active / 1e9, backend.name());
        fmt::print("measured copy bandwidth: {:.2f} GB/s\n", bandwidth_gbps);
        fmt::print("prefill: {} tokens in {:.3f} s = {:.1f} tokens/s ({:.1f} GFLOP/s matmul; the process's first prefill, "
                   "another prompt: {:.3f} s)\n",
                   options->prompt_len, prefill_seconds, prefill_tps, prefill_gflops, first_prefill_seconds);
        if (peak.tflops > 0)
            fmt::print("prefill achieved {:.3g} TFLOP/s = {:.1f}% of the matmul rate measured now ({:.3g} TFLOP/s, {})\n",
                       prefill_gflops / 1e3, 100.0 * prefill_gflops / 1e3 / peak.tflops, peak.tflops, peak.what);
        fmt::print("decode:  {} tokens in {:.3f} s = {:.2f} tokens/s ({})\n", options->gen_len, decode_seconds, decode_tps,
                   (runner.graphs_enabled()
                        ? fmt::format("graphs: {} captured in {:.2f} s, {} replays", captured, capture_seconds,
                                      runner.graph_stats().replays)
                        : std::string("eager")) +
                       (overlapped ? ", overlapped" : ""));
        fmt::print("decode bytes/token: {:.1f} MB weights + {:.2f} MB KV = {:.1f} MB\n", weight_bytes / 1e6,
                   kv_bytes / 1e6, bytes_per_token / 1e6);
        fmt::print("decode achieved {:.2f} GB/s = {:.1f}% of measured bandwidth (roofline {:.2f} tokens/s)\n",
                   achieved_gbps, 100.0 * achieved_gbps / bandwidth_gbps, roofline_tps);
        const double step_seconds = decode_seconds / double(options->gen_len);
        if (replay_seconds > 0)
            fmt::print("decode step {:.3f} ms; its graph alone, replayed 16 times back to back, {:.3f} ms "
                       "({:.1f}% of the roofline): {:.1f} us a step are outside the graph (metadata, launch, the id's download and wait)\n",
                       step_seconds * 1e3, replay_seconds * 1e3,
                       100.0 * bytes_per_token / replay_seconds / (bandwidth_gbps * 1e9),
                       (step_seconds - replay_seconds) * 1e6);
        if (step_times.size() > 1)  // one slow step (a graph's first replay, a page allocation) moves the mean only
            fmt::print("decode steps: first {:.3f} ms, median {:.3f} ms, mean {:.3f} ms\n", step_times.front() * 1e3,
                       median(step_times) * 1e3, step_seconds * 1e3);
        if (replay_seconds > 0)
            fmt::print("decode step on the device, 16 back to back: graph {:.3f} ms (its inputs' copy and argmax "
                       "included); + an overlapped step's stream operations ({}) {:+.1f} us\n",
                       replay.graph * 1e3,
                       runner.decode_inputs_mapped() ? "the ids' wait; inputs and ids in mapped host memory"
                                                     : "the inputs' upload, the ids' download",
                       (replay.step - replay.graph) * 1e6);
        // Per window: steps · bytes / time over the copy bandwidth probed right before it.
        std::vector<double> window_fractions;
        for (size_t w = 0; w < window_seconds.size(); ++w) {
            const int64_t steps = std::min(kWindowSteps, options->gen_len - int64_t(w) * kWindowSteps);
            window_fractions.push_back(double(steps) * bytes_per_token / window_seconds[w] / (window_gbps[w] * 1e9));
        }
        const double median_fraction = median(window_fractions);
        if (!window_fractions.empty()) {
            std::string list;
            for (size_t w = 0; w < window_fractions.size(); ++w)
                list += fmt::format("{}{:.1f}% ({:.1f} GB/s)", w ? ", " : "", 100 * window_fractions[w], window_gbps[w]);
            fmt::print("decode windows of {} steps vs the copy bandwidth probed right before each: {}; median {:.1f}%\n",
                       kWindowSteps, list, 100 * median_fraction);
        }
        nlohmann::json line = {{"prefill_tokens_per_s", prefill_tps},
                               {"prefill_first_s", first_prefill_seconds},
                               {"matmul_peak_tflops", peak.tflops},
                               {"prefill_matmul_fraction", peak.tflops > 0 ? prefill_gflops / 1e3 / peak.tflops : 0.0},
                               {"decode_tokens_per_s", decode_tps},
                               {"decode_bytes_per_token", bytes_per_token},
                               {"copy_bandwidth_gbps", bandwidth_gbps},
                               {"decode_bandwidth_fraction", achieved_gbps / bandwidth_gbps},
                               {"decode_graphs", runner.graphs_enabled()},
                               {"decode_graph_replay_s", replay_seconds},
                               {"decode_window_fractions", window_fractions},
                               {"decode_window_median_fraction", median_fraction},
                               {"prefill_gflops", prefill_gflops}};
        fmt::print("{}\n", line.dump());
        if (profiler) {
            profiler->stop();
            profiler->write_chrome_trace(options->profile);
            fmt::print("\nper-op time (prefill + decode; with --profile, timings include profiling overhead):\n{}",
                       profiler->summary());
            fmt::print("wrote {}\n", options->profile);
        }
    });
}

}  // namespace xinfer::cli
