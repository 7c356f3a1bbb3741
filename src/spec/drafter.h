// A drafter proposes tokens the target then verifies in one forward (src/spec/verify.h). The
// engine drives every method through this interface (DESIGN.md §7):
//
//   each step:  propose(decoding requests) → target forward over [anchor, d1 … dk] → verify
//               → observe(committed rows' hidden states) → release(finished/preempted)
//
// The anchor is a request's last token: sampled, not yet in the target's KV cache. A drafter
// sees committed tokens only; rejected drafts never reach it. Proposals must be a deterministic
// function of the committed tokens (and the target's hidden states), so greedy speculation is
// token-identical to no speculation and traces are reproducible.
//
// Not thread-safe: the engine loop owns it.
#pragma once

#include "backend/backend.h"
#include "models/model.h"
#include "spec/speculative_config.h"

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace xinfer {

// feature_layers() entry meaning "the final-normed hidden state" (what the lm_head reads)
// rather than a decoder layer's output.
constexpr int kFinalNormFeature = -1;

// The target's hidden states after one forward, for drafters that condition on them.
struct TargetHidden {
    // [n_rows, n_features * hidden] in the target's activation dtype, on the target backend:
    // for each token row of the forward (ForwardBatch order), the outputs of the drafter's
    // feature_layers() concatenated in that order. Layer id L means the residual stream after
    // decoder layer L (z-lab convention = HF hidden_states[L + 1]; vLLM, SGLang and llama.cpp
    // capture the *input* of layer L + 1, which is the same tensor under a +1-shifted id).
    // Valid until the next target forward.
    Tensor features;
    struct Sequence {
        int seq = 0;
        int64_t first_row = 0;       // row of `features` holding position start_position
        int64_t start_position = 0;  // absolute position of that row
        int64_t n_committed = 0;     // rows [first_row, first_row + n_committed) are committed tokens
        // The request's tokens after this step: prompt + generated, including tokens sampled in
        // this step (so tokens[p + 1] exists for every committed position p).
        std::span<const int32_t> tokens;
    };
    std::vector<Sequence> sequences;
};

// One decoding request asking for drafts.
struct DraftRequest {
    int seq = 0;
    std::span<const int32_t> tokens;  // committed tokens; tokens.back() is the anchor at position tokens.size() - 1
    int max_drafts = 0;               // propose at most this many (≥ 1)
};

class Drafter {
public:
    virtual ~Drafter() = default;
    virtual const char* method() const = 0;
    virtual int num_speculative_tokens() const = 0;
    // Target layers whose outputs observe() needs, in order (kFinalNormFeature allowed). Empty:
    // the drafter works from tokens alone and TargetHidden::features is empty.
    virtual std::vector<int> feature_layers() const { return {}; }
    // After every target forward, for every sequence that committed tokens in it (prefill chunks
    // and verify steps alike). Called before release() of a sequence that finished in the step.
    virtual void observe(const TargetHidden& hidden) { (void)hidden; }
    // Drafts for each request, in order: up to max_drafts tokens each (fewer or none is fine).
    virtual std::vector<std::vector<int32_t>> propose(std::span<const DraftRequest> requests) = 0;
    // A sequence finished, was aborted or preempted (it will be re-observed from its prompt if
    // it resumes): drop its state. Unknown sequences are ignored.
    virtual void release(int seq) { (void)seq; }
    // How much of a sequence's target context the drafter must have observed before an anchor:
    // 0 = none (token-only drafters), W > 0 = the last W positions (sliding-window drafters: a
    // sequence may start being observed mid-context, e.g. after a prefix-cache hit, and drafts
    // once W positions are in), -1 = all of it (a sequence first observed mid-context gets no
    // drafts). The scheduler keeps that many prompt tokens out of prefix-cache hits so the
    // drafter observes them.
    virtual int64_t context_window() const { return 0; }
    // A drafter that needs all of a sequence's context (context_window() = -1) may keep its own
    // prefix cache of that context, restorable in blocks of this many tokens: the scheduler then
    // makes the target's prefix-cache hits multiples of it, so the drafter finds the positions
    // the target skipped in its own cache. 1: no such cache.
    virtual int64_t prefix_cache_block() const { return 1; }
};

// What a drafter may borrow from the running target.
struct DrafterContext {
    Model& target;                  // config, token_embedding(), lm_head()
    Backend& backend;               // the target's backend; drafters run there too
    std::string target_dir;         // the target checkpoint's directory (MTP heads live there)
    bool dummy_weights = false;     // --load-format dummy: make random drafter weights of the right shapes
    int max_num_seqs = 1;           // sequences the drafter's own KV must hold at once
    int64_t max_model_len = 0;      // tokens per sequence
    // Most target tokens one step commits (the scheduler's token budget); bounds what sliding-window
    // drafter caches hold at once. 0: unknown (caches then hold max_model_len per sequence).
    int64_t max_num_batched_tokens = 0;
};

// The drafter for config.method ("ngram", "dflash", "mtp"); throws naming what is wrong.
std::unique_ptr<Drafter> make_drafter(const SpeculativeConfig& config, const DrafterContext& context);

// Per method (each in its own file).
std::unique_ptr<Drafter> make_ngram_drafter(const SpeculativeConfig& config);
std::unique_ptr<Drafter> make_dflash_drafter(const SpeculativeConfig& config, const DrafterContext& context);
std::unique_ptr<Drafter> make_mtp_drafter(const SpeculativeConfig& config, const DrafterContext& context);

}  // namespace xinfer
