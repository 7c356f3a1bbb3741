// Verification of a draft chain: the target scored [anchor, d1 … dk] in one forward, giving
// logits rows 0..k (row i predicts the token after d_i, row 0 the token after the anchor).
// The result is how many drafts are accepted and the one token the target adds after them
// (the correction at the first rejection, or the bonus when all k are accepted), so every
// step emits accepted + 1 tokens.
//
// Greedy (temperature 0): accept while d_{i+1} == argmax(row i) — the output is exactly what
// non-speculative greedy decoding produces. Sampling: rejection sampling (Leviathan et al.
// 2023) with the drafter's distribution taken as one-hot on its proposal (every drafter here
// proposes deterministically): accept d with probability p(d); on rejection draw from the
// residual max(p - onehot(d), 0) renormalised, i.e. p without d. Each emitted token is then
// distributed exactly as non-speculative sampling from p (temperature, top-k, top-p applied).
// Pure functions of their inputs and the sampler's random stream.
#pragma once

#include "sample/sampler.h"

#include <cstdint>
#include <span>

namespace xinfer {

struct Verdict {
    int accepted = 0;        // drafts accepted, 0..k
    int32_t next_token = 0;  // the token emitted after them
};

// logits: [k + 1, vocab] row-major f32; drafts: k tokens.
Verdict verify_greedy(std::span<const float> logits, int64_t vocab, std::span<const int32_t> drafts);
// The same from each row's argmax (target_ids: k + 1 ids), as a device argmax produces them.
Verdict verify_greedy_ids(std::span<const int32_t> target_ids, std::span<const int32_t> drafts);
// Dispatches on the sampler: greedy when its temperature is 0, else rejection sampling drawing
// from its random stream.
Verdict verify_drafts(std::span<const float> logits, int64_t vocab, std::span<const int32_t> drafts, Sampler& sampler);

}  // namespace xinfer
