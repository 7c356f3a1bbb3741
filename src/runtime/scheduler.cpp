#include "runtime/scheduler.h"

#include "core/status.h"

#include <algorithm>

namespace xinfer {

const char* finish_reason_name(FinishReason reason) {
    switch (reason) {
        case FinishReason::none: return "none";
        case FinishReason::stop: return "stop";
        case FinishReason::length: return "length";
        case FinishReason::abort: return "abort";
    }
    return "?";
}

Scheduler::Scheduler(SchedulerOptions options, KvCacheManager& kv) : options_(options), kv_(kv) {
    XINFER_CHECK(options_.max_num_seqs > 0 && options_.max_num_batched_tokens > 0,
                 "max_num_seqs {} and max_num_batched_tokens {} must be positive", options_.max_num_seqs,
                 options_.max_num_batched_tokens);
}

void Scheduler::add(std::unique_ptr<Request> request) {
    if (request->tokens.empty()) fail("request {}: empty prompt", request->id);
    if (options_.max_model_len > 0 && request->prompt_len >= options_.max_model_len)
        fail("request {}: prompt of {} tokens does not fit max_model_len {} (it needs room for one generated token)",
             request->id, request->prompt_len, options_.max_model_len);
    waiting_.push_back(std::move(request));
}

std::unique_ptr<Request> Scheduler::abort(uint64_t id) {
    auto matches = [id](const std::unique_ptr<Request>& r) { return r->id == id; };
    std::unique_ptr<Request> found;
    if (auto it = std::find_if(running_.begin(), running_.end(), matches); it != running_.end()) {
        found = std::move(*it);
        running_.erase(it);
    } else if (auto wit = std::find_if(waiting_.begin(), waiting_.end(), matches); wit != waiting_.end()) {
        found = std::move(*wit);
        waiting_.erase(wit);
    }
    if (found) {
        if (kv_.has_sequence(int(found->id))) kv_.free_sequence(int(found->id));
        found->finish = FinishReason::abort;
    }
    return found;
}

void Scheduler::preempt(size_t running_index) {
    std::unique_ptr<Request> victim = std::move(running_[running_index]);
    running_.erase(running_.begin() + long(running_index));
    kv_.free_sequence(int(victim->id));
    victim->computed = 0;
    victim->reserved = 0;
    ++victim->n_preemptions;
    ++n_preemptions_;
    preempted_.push_back(victim->id);
    waiting_.push_front(std::move(victim));
}

std::vector<ScheduledChunk> Scheduler::schedule() {
    std::vector<ScheduledChunk> plan;
    int64_t budget = options_.max_num_batched_tokens;

    // 1. Running requests, oldest first. Growing one may preempt the newest ones.
    for (size_t i = 0; i < running_.size() && budget > 0;) {
        Request& r = *running_[i];
        const int64_t count = std::min(r.n_tokens() - r.computed, budget);
        // A decode may also verify drafts: reserve their slots when budget, length and pages allow.
        int lookahead = 0;
        if (count == 1 && r.n_generated() > 0 && options_.num_lookahead_tokens > 0) {
            int64_t room = std::min<int64_t>(options_.num_lookahead_tokens, budget - 1);
            if (options_.max_model_len > 0) room = std::min(room, options_.max_model_len - r.n_tokens() - 1);
            room = std::min<int64_t>(room, r.max_tokens - r.n_generated() - 1);
            if (room > 0 && kv_.allocate(int(r.id), r.computed + count + room)) lookahead = int(room);
        }
        bool preempted_self = false;
        while (!kv_.allocate(int(r.id), r.computed + count)) {
            if (i + 1 == running_.size()) {  // r is the newest: it yields
                preempt(i);
                preempted_self = true;
                break;
            }
            preempt(running_.size() - 1);
        }
        if (preempted_self) break;
        plan.push_back({&r, r.computed, count, r.computed + count == r.n_tokens(), lookahead});
        budget -= count + lookahead;
        ++i;
    }

    // 2. Waiting requests in arrival order, while sequences, budget and pages allow.
    while (!waiting_.empty() && budget > 0 && int(running_.size()) < options_.max_num_seqs) {
        Request& r = *waiting_.front();
        if (!kv_.has_sequence(int(r.id))) {
            const int64_t lookup = std::max<int64_t>(0, r.n_tokens() - options_.prefix_cache_holdback);
            r.computed = kv_.add_sequence(int(r.id), std::span<const int32_t>(r.tokens).first(size_t(lookup)),
                                          options_.prefix_cache_alignment);
            if (r.n_preemptions == 0 && r.n_generated() == 0) r.cached_prompt = r.computed;
        }
        const int64_t count = std::min(r.n_tokens() - r.computed, budget);
        if (!kv_.allocate(int(r.id), r.computed + count)) {
            kv_.free_sequence(int(r.id));  // drop shared prefix references while it waits
            r.computed = 0;
            if (running_.empty() && plan.empty())
                fail("request {} needs {} KV pages for {} tokens but the cache has {} pages in total", r.id,
                     kv_.pages_needed(int(r.id), r.n_tokens()), r.n_tokens(), kv_.n_pages());
            break;
        }
        plan.push_back({&r, r.computed, count, r.computed + count == r.n_tokens()});
        budget -= count;
        running_.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
    }
    return plan;
}

std::vector<std::unique_ptr<Request>> Scheduler::complete(const std::vector<ScheduledChunk>& step) {
    for (const ScheduledChunk& chunk : step) {
        Request& r = *chunk.request;
        r.computed = chunk.start + chunk.count;
        kv_.commit(int(r.id), r.tokens, r.computed);
        // Rejected drafts' slots: speculative rollback to the committed length (or to the slots
        // of a step already queued behind this one).
        const int64_t keep = std::max(r.computed, r.reserved);
        if (kv_.allocated_tokens(int(r.id)) > keep) kv_.truncate(int(r.id), keep);
        if (r.reserved <= r.computed) r.reserved = 0;  // the queued step was this one
    }
    std::vector<std::unique_ptr<Request>> finished;
    for (size_t i = 0; i < running_.size();) {
        if (running_[i]->finished()) {
            kv_.free_sequence(int(running_[i]->id));
            finished.push_back(std::move(running_[i]));
            running_.erase(running_.begin() + long(i));
        } else {
            ++i;
        }
    }
    return finished;
}

}  // namespace xinfer
