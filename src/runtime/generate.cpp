#include "runtime/generate.h"

#include "core/status.h"
#include "runtime/engine_impl.h"
#include "sample/sampler.h"

#include <algorithm>
#include <chrono>
#include <span>

namespace xinfer {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

GenerateResult generate(Runner& runner, const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options) {
    const size_t n = prompts.size();
    GenerateResult result;
    result.tokens.resize(n);
    result.spec_steps.resize(n);
    result.finish_reasons.resize(n);
    result.texts.resize(n);
    if (n == 0 || options.max_tokens <= 0) return result;
    // One engine over the caller's runner: every prompt is admitted at once (max_num_seqs = n);
    // prefill_chunk bounds the tokens of a step (0: all prompts in one step).
    SchedulerOptions scheduler;
    scheduler.max_num_seqs = int(n);
    int64_t all_prompts = 0;
    for (const std::vector<int32_t>& p : prompts) all_prompts += int64_t(p.size());
    // Room for every sequence's verify chain too when speculating.
    const int64_t chains = int64_t(n) * (1 + (options.drafter ? options.drafter->num_speculative_tokens() : 0));
    scheduler.max_num_batched_tokens =
        options.prefill_chunk > 0 ? options.prefill_chunk : std::max<int64_t>({all_prompts, chains, 1});
    std::unique_ptr<Engine> engine = make_engine(runner, scheduler, options.drafter, options.detokenizer);
    std::vector<uint64_t> ids;
    for (size_t i = 0; i < n; ++i) {
        XINFER_CHECK(!prompts[i].empty(), "prompt {} is empty", i);
        SamplingParams params = options.sampling;
        params.seed += i;
        ids.push_back(engine->submit(prompts[i], params, options.max_tokens, options.stop_ids));
    }
    // Prefill ends with the step that samples a sequence's first token; decode steps follow.
    auto start = std::chrono::steady_clock::now();
    bool decoding = false;
    size_t first_tokens = 0;
    while (engine->has_work()) {
        for (const RequestOutput& out : engine->step()) {
            const size_t i = size_t(std::find(ids.begin(), ids.end(), out.id) - ids.begin());
            if (out.generated_tokens == int64_t(out.new_tokens.size())) ++first_tokens;
            result.tokens[i].insert(result.tokens[i].end(), out.new_tokens.begin(), out.new_tokens.end());
            if (out.accepted >= 0) result.spec_steps[i].push_back({out.proposed, out.accepted});
            result.texts[i] += out.text;
            if (out.finished) result.finish_reasons[i] = out.finish_reason;
        }
        if (decoding) ++result.decode_steps;
        if (!decoding && first_tokens == n) {
            result.prefill_seconds = seconds_since(start);
            start = std::chrono::steady_clock::now();
            decoding = true;
        }
    }
    result.decode_seconds = decoding ? seconds_since(start) : 0;
    result.spec = engine->stats().spec;
    return result;
}

std::vector<float> prompt_logits(Runner& runner, const std::vector<int32_t>& prompt, int64_t prefill_chunk) {
    std::vector<float> all;
    const int64_t step = prefill_chunk > 0 ? prefill_chunk : int64_t(prompt.size());
    for (int64_t done = 0; done < int64_t(prompt.size()); done += step) {
        const int64_t take = std::min(step, int64_t(prompt.size()) - done);
        SequenceChunk chunk{0, done, std::span(prompt).subspan(size_t(done), size_t(take)), true};
        std::vector<float> logits = runner.step(std::span(&chunk, 1));
        all.insert(all.end(), logits.begin(), logits.end());
    }
    runner.release(0);
    return all;
}

}  // namespace xinfer
