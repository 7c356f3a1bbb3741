// --speculative-config, as vLLM spells it: a JSON object
//   {"method": "dflash"|"mtp"|"ngram", "model": DIR, "num_speculative_tokens": k,
//    "prompt_lookup_min": 1, "prompt_lookup_max": 4}
// Parsed in one place for the memory plan, the engine and the CLI.
#pragma once

#include <string>

namespace xinfer {

struct SpeculativeConfig {
    std::string method;              // empty: no speculation
    std::string model;               // dflash: the drafter's directory
    int num_speculative_tokens = 0;  // 0 in the JSON: the method's default (dflash: block_size - 1, mtp: 3, ngram: 4)
    int prompt_lookup_min = 1;       // ngram: shortest suffix to match
    int prompt_lookup_max = 4;       // ngram: longest suffix to match
    bool enabled() const { return !method.empty(); }
};

// Throws with the reason for malformed JSON, unknown methods or fields, and out-of-range values
// (num_speculative_tokens ≤ 31 so a verify chain of anchor + drafts fits 32 query tokens).
SpeculativeConfig parse_speculative_config(const std::string& json);

}  // namespace xinfer
