// The scheduler decides, each step, which requests advance by how many tokens, under a token
// budget (max_num_batched_tokens) and a sequence limit (max_num_seqs), FCFS:
//  1. running requests first: each decodes one token (its last sampled token) — or finishes
//     the chunk of prompt it is prefilling — so decodes are never starved by new prefills;
//  2. then waiting requests are admitted in arrival order, each with a prefill chunk of
//     min(remaining prompt, remaining budget) tokens (chunked prefill, mixed with decodes).
// When the KV pool cannot grow a running request, the most recently admitted running
// request is preempted by recompute: its pages are freed and it goes back to the front of the
// waiting queue; when readmitted it recomputes prompt + generated tokens (prefix caching
// usually makes that cheap). Nothing is dropped and nothing crashes for lack of memory; a
// request that cannot fit even alone fails with an error.
#pragma once

#include "kv/kv_cache_manager.h"
#include "runtime/request.h"

#include <deque>
#include <memory>
#include <utility>
#include <vector>

namespace xinfer {

struct SchedulerOptions {
    int max_num_seqs = 64;
    int64_t max_num_batched_tokens = 2048;
    int64_t max_model_len = 0;  // prompt + generated limit per request
    // Speculative decoding: KV slots and token budget reserved per decoding request for drafts
    // (verified in the same forward as the decode token). 0: no speculation.
    int num_lookahead_tokens = 0;
    // Tokens at the end of a prompt that a prefix-cache hit leaves to compute, so a drafter sees
    // their hidden states (Drafter::context_window(); 0: the longest hit).
    int64_t prefix_cache_holdback = 0;
    // Prefix-cache hits are multiples of this many tokens (Drafter::prefix_cache_block()).
    int64_t prefix_cache_alignment = 1;
};

// One request's part of a step: tokens [start, start + count) of request->all tokens.
struct ScheduledChunk {
    Request* request = nullptr;
    int64_t start = 0;
    int64_t count = 0;
    bool samples = false;  // the chunk reaches the end of the known tokens: sample the next one
    int lookahead = 0;     // a decode with room (KV slots and budget) for this many drafts after count
};

class Scheduler {
public:
    Scheduler(SchedulerOptions options, KvCacheManager& kv);

    void add(std::unique_ptr<Request> request);
    // Removes a request wherever it is and frees its pages; returns it (nullptr if unknown).
    std::unique_ptr<Request> abort(uint64_t id);

    // Plans the next step. Empty when there is nothing to do.
    std::vector<ScheduledChunk> schedule();
    // After the step ran, with each chunk's count set to the tokens whose K/V are now final
    // (a verify chunk: the anchor plus the accepted drafts): commits them, rolls back KV slots
    // reserved beyond them, and moves finished requests out (returned to the caller).
    std::vector<std::unique_ptr<Request>> complete(const std::vector<ScheduledChunk>& step);
    // Ids of requests preempted since the last call (their drafter state is stale).
    std::vector<uint64_t> take_preempted() { return std::exchange(preempted_, {}); }

    bool idle() const { return waiting_.empty() && running_.empty(); }
    size_t n_waiting() const { return waiting_.size(); }
    size_t n_running() const { return running_.size(); }
    int64_t n_preemptions() const { return n_preemptions_; }

private:
    void preempt(size_t running_index);

    SchedulerOptions options_;
    KvCacheManager& kv_;
    std::deque<std::unique_ptr<Request>> waiting_;
    std::vector<std::unique_ptr<Request>> running_;  // in admission order
    int64_t n_preemptions_ = 0;
    std::vector<uint64_t> preempted_;
};

}  // namespace xinfer
