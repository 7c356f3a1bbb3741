// xinfer generate: greedy or sampled continuation of a prompt given as token ids.
#include "commands.h"
#include "runtime/generate.h"
#include "runtime/profiler.h"
#include "spec/drafter.h"
#include "core/status.h"
#include "tokenizer/bpe_encoder.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer_json.h"

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace xinfer::cli {

void add_generate_command(CLI::App& app) {
    struct Options {
        ModelOptions model;
        std::string prompt_ids;
        std::string prompt_text;
        GenerateOptions generate;
        std::string profile;
        std::string speculative_config;
        std::string spec_trace;
        std::string kv_cache_dtype = "auto";
    };
    auto options = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand(
        "generate", "Generate tokens from a prompt (ids, or text with the model's tokenizer.json); prints {\"ids\": [...], "
                    "\"finish_reason\": ...} as one JSON line "
                    "(with \"text\" when the model directory has a tokenizer.json)");
    options->model.add_to(*cmd);
    CLI::Option* ids = cmd->add_option("--prompt-ids", options->prompt_ids, "Prompt token ids, comma-separated");
    CLI::Option* text = cmd->add_option("--prompt", options->prompt_text,
                                        "Prompt text, encoded with the model's tokenizer.json (instead of --prompt-ids)");
    ids->excludes(text);
    text->excludes(ids);
    cmd->add_option("--max-tokens", options->generate.max_tokens, "Tokens to generate")->default_val(16);
    cmd->add_option("--temperature", options->generate.sampling.temperature, "0 = greedy")->default_val(0.0);
    cmd->add_option("--top-p", options->generate.sampling.top_p)->default_val(1.0);
    cmd->add_option("--top-k", options->generate.sampling.top_k, "0 = off")->default_val(0);
    cmd->add_option("--seed", options->generate.sampling.seed)->default_val(0);
    cmd->add_option("--stop", options->generate.sampling.stop,
                    "Stop string (repeatable): generation ends once the text contains it; needs tokenizer.json");
    cmd->add_option("--prefill-chunk", options->generate.prefill_chunk, "Max prompt tokens per step (0 = all)")
        ->default_val(0);
    cmd->add_option("--kv-cache-dtype", options->kv_cache_dtype,
                    "auto (the activation dtype), float32, bfloat16, fp8 (e4m3 + per-row scales)")
        ->default_val("auto");
    cmd->add_option("--profile", options->profile, "Write a Chrome trace (Perfetto) of every op to this .json file");
    cmd->add_option("--speculative-config", options->speculative_config,
                    R"(Speculative decoding, as vLLM: '{"method":"ngram"|"mtp"|"dflash","model":DIR,"num_speculative_tokens":k}')");
    cmd->add_option("--spec-trace", options->spec_trace,
                    R"(Write one JSON line per speculative step, {"proposed":[...],"accepted":n}, to this file)");
    cmd->callback([options] {
        // The tokenizer is read before the weights, so a missing or broken one fails at once.
        std::unique_ptr<Detokenizer> detokenizer;
        nlohmann::json tokenizer_doc;  // parsed once, for the detokenizer and (with --prompt) the encoder
        const std::filesystem::path tokenizer = std::filesystem::path(options->model.model_dir) / "tokenizer.json";
        const bool has_tokenizer = std::filesystem::exists(tokenizer);
        if (has_tokenizer) {
            tokenizer_doc = read_tokenizer_json(tokenizer);
            detokenizer = std::make_unique<Detokenizer>(Detokenizer::from_json(tokenizer_doc, tokenizer.string()));
        }
        if (!options->generate.sampling.stop.empty() && !has_tokenizer)
            fail("--stop needs the model's tokenizer: {} does not exist", tokenizer.string());
        if (options->prompt_ids.empty() && options->prompt_text.empty()) fail("give --prompt-ids or --prompt");
        std::vector<int32_t> prompt;
        if (!options->prompt_text.empty()) {
            if (!has_tokenizer) fail("--prompt needs the model's tokenizer: {} does not exist", tokenizer.string());
            prompt = BpeEncoder::from_json(tokenizer_doc, tokenizer.string()).encode(options->prompt_text);
            if (prompt.empty()) fail("--prompt encodes to no tokens");
        } else {
            prompt = parse_ids(options->prompt_ids);
        }
        options->generate.detokenizer = detokenizer.get();
        LoadedModel loaded = load(options->model);
        RunnerOptions runner_options;
        runner_options.enforce_eager = options->model.enforce_eager;
        runner_options.kv_cache_dtype = options->kv_cache_dtype;
        runner_options.max_cached_tokens = options->model.max_cached_tokens > 0
                                               ? options->model.max_cached_tokens
                                               : int64_t(prompt.size()) + options->generate.max_tokens + 16;
        const SpeculativeConfig spec_config = parse_speculative_config(options->speculative_config);
        if (!options->spec_trace.empty() && !spec_config.enabled())
            fail("--spec-trace needs --speculative-config");
        std::unique_ptr<Drafter> drafter;
        if (spec_config.enabled()) {
            const DrafterContext context{*loaded.model, *loaded.backend, options->model.model_dir,
                                         options->model.load_format == "dummy", 1, runner_options.max_cached_tokens};
            drafter = make_drafter(spec_config, context);
            runner_options.feature_layers = drafter->feature_layers();
            // Verify chains run past the last token: room for their drafts.
            runner_options.max_cached_tokens += drafter->num_speculative_tokens();
            options->generate.drafter = drafter.get();
        }
        Runner runner(*loaded.model, *loaded.backend, runner_options);
        std::unique_ptr<Profiler> profiler;
        if (!options->profile.empty()) profiler = std::make_unique<Profiler>(*loaded.backend);
        GenerateResult result = generate(runner, {prompt}, options->generate);
        if (profiler) {
            profiler->stop();
            profiler->write_chrome_trace(options->profile);
            fmt::print(stderr, "{}wrote {}\n", profiler->summary(), options->profile);
        }
        nlohmann::json line;
        line["ids"] = result.tokens[0];
        if (detokenizer) line["text"] = result.texts[0];
        line["finish_reason"] = result.finish_reasons[0];
        line["usage"] = {{"prompt_tokens", prompt.size()}, {"completion_tokens", result.tokens[0].size()}};
        if (drafter) {
            const SpecCounters& spec = result.spec;
            line["spec_decode"] = {{"method", drafter->method()},
                                   {"num_drafts", spec.num_drafts},
                                   {"num_draft_tokens", spec.num_draft_tokens},
                                   {"num_accepted_tokens", spec.num_accepted_tokens},
                                   {"accepted_per_position", spec.accepted_per_position},
                                   {"mean_acceptance_length", spec.mean_acceptance_length()}};
        }
        if (!options->spec_trace.empty()) {
            std::ofstream trace(options->spec_trace);
            if (!trace) fail("--spec-trace: cannot write {}", options->spec_trace);
            for (const SpecStep& step : result.spec_steps[0])
                trace << nlohmann::json{{"proposed", step.proposed}, {"accepted", step.accepted}}.dump() << "\n";
        }
        fmt::print("{}\n", line.dump());
    });
}

}  // namespace xinfer::cli
