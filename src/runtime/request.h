// A request as the scheduler sees it: prompt, sampling, progress and outcome.
#pragma once

#include "sample/sampler.h"
#include "tokenizer/detokenizer.h"
#include "xinfer/engine.h"
#include "xinfer/sampling_params.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace xinfer {

enum class FinishReason { none, stop, length, abort };
const char* finish_reason_name(FinishReason reason);

struct Request {
    Request(uint64_t id_, std::vector<int32_t> prompt, const SamplingParams& sampling_, int max_tokens_)
        : id(id_), tokens(std::move(prompt)), prompt_len(int64_t(tokens.size())), sampling(sampling_),
          max_tokens(max_tokens_), sampler(sampling_), arrival(std::chrono::steady_clock::now()) {}

    uint64_t id;
    std::vector<int32_t> tokens;  // prompt, then every generated token
    int64_t prompt_len;
    SamplingParams sampling;
    int max_tokens;
    std::vector<int32_t> stop_ids;
    const Detokenizer* detokenizer = nullptr;  // the model's, when it has one
    std::string text;  // generated text so far (bytes; special tokens left out), cut at a stop string
    size_t text_taken = 0;  // bytes of `text` handed out by take_text()

    int64_t computed = 0;         // tokens whose K/V are in the cache
    int64_t reserved = 0;         // slots a step queued on the device writes (overlapped decode): kept
    int64_t cached_prompt = 0;    // prompt tokens reused from the prefix cache at first admission
    int n_preemptions = 0;
    SpecCounters spec;  // speculative decoding totals
    FinishReason finish = FinishReason::none;
    Sampler sampler;

    StreamCallback callback;  // may be empty

    std::chrono::steady_clock::time_point arrival, first_token, last_token;

    // Appends a generated token and decides whether it ends the request: a stop id, a stop
    // string, max_tokens, or max_model_len (0: no limit). Returns false once the request is finished.
    bool append_generated(int32_t token, int64_t max_model_len) {
        tokens.push_back(token);
        if (std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end()) finish = FinishReason::stop;
        else if (append_text(token)) finish = FinishReason::stop;
        else if (n_generated() >= max_tokens) finish = FinishReason::length;
        else if (max_model_len > 0 && n_tokens() >= max_model_len) finish = FinishReason::length;
        return !finished();
    }

    // Adds the token's text; true when that completes a stop string, and then `text` ends where
    // the earliest stop string starts. Only matches that use the new bytes are looked for: earlier
    // ones would have ended the request already.
    bool append_text(int32_t token) {
        if (!detokenizer) return false;
        const size_t before = text.size();
        text += detokenizer->token_bytes(token);
        size_t cut = std::string::npos;
        for (const std::string& s : sampling.stop) {
            const size_t from = before >= s.size() ? before - s.size() + 1 : 0;
            cut = std::min(cut, text.find(s, from));
        }
        if (cut == std::string::npos) return false;
        text.resize(cut);
        return true;
    }

    // The text not handed out yet that is final: whole characters only, and, while the request
    // runs, nothing a stop string could still begin in (it would have to be taken back). A
    // finished request hands out the rest, an incomplete last character as U+FFFD.
    std::string take_text() {
        size_t end = text.size();
        if (!finished()) {
            size_t hold = 0;
            for (const std::string& s : sampling.stop) hold = std::max(hold, s.size() - 1);
            end = end > hold ? end - hold : 0;
            end = whole_characters_end(text, end);
        }
        if (end <= text_taken) return {};
        std::string delta = to_valid_utf8(text.substr(text_taken, end - text_taken));
        text_taken = end;
        return delta;
    }

    int64_t n_tokens() const { return int64_t(tokens.size()); }
    int64_t n_generated() const { return n_tokens() - prompt_len; }
    bool finished() const { return finish != FinishReason::none; }
};

}  // namespace xinfer
