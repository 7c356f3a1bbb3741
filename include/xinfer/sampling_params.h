// Public sampling parameters (OpenAI/vLLM semantics).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace xinfer {

struct SamplingParams {
    float temperature = 0.f;  // 0 → greedy (argmax)
    float top_p = 1.f;        // nucleus: smallest set of tokens whose probability reaches top_p
    int top_k = 0;            // 0 → no top-k limit
    uint64_t seed = 0;        // per-request RNG seed, so sampled outputs are reproducible
    // Generation ends once the generated text contains one of these (not included in the text;
    // the token that completed it is the last one). Needs the model's tokenizer.json.
    std::vector<std::string> stop;
};

}  // namespace xinfer
