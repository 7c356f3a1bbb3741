#include "runtime/generate.h"

#include "core/status.h"
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
    const int64_t vocab = runner.model().config().vocab_size;
    GenerateResult result;
    result.tokens.resize(n);
    std::vector<Sampler> samplers;
    for (size_t i = 0; i < n; ++i) {
        XINFER_CHECK(!prompts[i].empty(), "prompt {} is empty", i);
        SamplingParams params = options.sampling;
        params.seed += i;
        samplers.emplace_back(params);
    }

    // Prefill: every prompt advances by up to prefill_chunk tokens per step; a prompt's first
    // token is sampled from the step that consumes its last prompt token.
    auto start = std::chrono::steady_clock::now();
    std::vector<int64_t> done(n, 0);
    std::vector<int32_t> next(n, -1);
    while (true) {
        std::vector<SequenceChunk> chunks;
        std::vector<size_t> owners;
        for (size_t i = 0; i < n; ++i) {
            const int64_t left = int64_t(prompts[i].size()) - done[i];
            if (left == 0) continue;
            const int64_t take = options.prefill_chunk > 0 ? std::min(left, options.prefill_chunk) : left;
            chunks.push_back({int(i), done[i], std::span(prompts[i]).subspan(size_t(done[i]), size_t(take)), false});
            owners.push_back(i);
        }
        if (chunks.empty()) break;
        std::vector<float> logits = runner.step(chunks);
        for (size_t c = 0; c < chunks.size(); ++c) {
            const size_t i = owners[c];
            done[i] += int64_t(chunks[c].tokens.size());
            if (done[i] == int64_t(prompts[i].size()))
                next[i] = samplers[i].sample(std::span(logits).subspan(c * size_t(vocab), size_t(vocab)));
        }
    }
    result.prefill_seconds = seconds_since(start);

    // Decode: feed each unfinished sequence its last sampled token.
    start = std::chrono::steady_clock::now();
    std::vector<bool> finished(n, options.max_tokens <= 0);
    auto accept = [&](size_t i, int32_t token) {
        result.tokens[i].push_back(token);
        const bool stop = std::find(options.stop_ids.begin(), options.stop_ids.end(), token) != options.stop_ids.end();
        if (stop || int(result.tokens[i].size()) >= options.max_tokens) finished[i] = true;
    };
    for (size_t i = 0; i < n; ++i)
        if (!finished[i]) accept(i, next[i]);
    while (true) {
        std::vector<SequenceChunk> chunks;
        std::vector<size_t> owners;
        for (size_t i = 0; i < n; ++i) {
            if (finished[i]) continue;
            const int64_t position = int64_t(prompts[i].size() + result.tokens[i].size()) - 1;
            chunks.push_back({int(i), position, std::span(result.tokens[i]).last(1), false});
            owners.push_back(i);
        }
        if (chunks.empty()) break;
        std::vector<float> logits = runner.step(chunks);
        ++result.decode_steps;
        for (size_t c = 0; c < chunks.size(); ++c)
            accept(owners[c], samplers[owners[c]].sample(std::span(logits).subspan(c * size_t(vocab), size_t(vocab))));
    }
    result.decode_seconds = seconds_since(start);
    for (size_t i = 0; i < n; ++i) runner.release(int(i));
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
