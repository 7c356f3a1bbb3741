// Public sampling parameters (OpenAI/vLLM semantics).
#pragma once

#include <cstdint>

namespace xinfer {

struct SamplingParams {
    float temperature = 0.f;  // 0 → greedy (argmax)
    float top_p = 1.f;        // nucleus: smallest set of tokens whose probability reaches top_p
    int top_k = 0;            // 0 → no top-k limit
    uint64_t seed = 0;        // per-request RNG seed, so sampled outputs are reproducible
};

}  // namespace xinfer
