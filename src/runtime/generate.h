// Batch generation over a Runner: a thin wrapper that runs every prompt through an Engine (the
// scheduler's continuous batching, chunked prefill and paged KV) until all finish; the golden
// tests use it as the equivalence oracle. prompt_logits() drives the Runner directly.
#pragma once

#include "runtime/runner.h"
#include "xinfer/engine.h"
#include "xinfer/sampling_params.h"

#include <string>
#include <vector>

namespace xinfer {

class Detokenizer;

struct GenerateOptions {
    int max_tokens = 16;
    SamplingParams sampling;          // sequence i uses seed sampling.seed + i
    int64_t prefill_chunk = 0;        // 0: each prompt in one piece; else at most this many tokens per step
    std::vector<int32_t> stop_ids;    // generation of a sequence ends after emitting one of these
    Drafter* drafter = nullptr;       // speculative decoding (the runner must export its feature_layers)
    const Detokenizer* detokenizer = nullptr;  // for sampling.stop and GenerateResult::texts
};

// One verify step of one sequence: the drafts and how many the target accepted.
struct SpecStep {
    std::vector<int32_t> proposed;
    int accepted = 0;
};

struct GenerateResult {
    std::vector<std::vector<int32_t>> tokens;  // generated ids per prompt
    std::vector<std::string> finish_reasons;   // per prompt: "stop" or "length"
    std::vector<std::string> texts;            // per prompt, with a detokenizer (RequestOutput::text joined)
    double prefill_seconds = 0;
    double decode_seconds = 0;
    int64_t decode_steps = 0;
    std::vector<std::vector<SpecStep>> spec_steps;  // per prompt, in order
    SpecCounters spec;                              // totals over all prompts
};

GenerateResult generate(Runner& runner, const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options);

// Logits for every position of one prompt ([prompt.size(), vocab], row-major), computed in
// prefill chunks of `prefill_chunk` tokens (0 = one piece).
std::vector<float> prompt_logits(Runner& runner, const std::vector<int32_t>& prompt, int64_t prefill_chunk = 0);

}  // namespace xinfer
