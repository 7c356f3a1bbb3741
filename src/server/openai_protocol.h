// The OpenAI completions protocol on token ids: request validation and the response / stream
// chunk bodies, as pure functions (tested without sockets; server.cpp does the HTTP).
//
// Prompts come in all four of the API's forms: a string, strings, token ids, arrays of token ids.
// Strings need the model's tokenizer.json (the server encodes them; text_prompts here), token ids
// do not. Completions come back as token ids in each choice's `token_ids` (vLLM's field for the
// same thing) and, with a tokenizer, as `text` (streamed: each chunk carries the text its tokens
// made final, RequestOutput::text); `stop` strings need the tokenizer too. What is not implemented
// (logprobs, echo, penalties) is refused with a 400 that says so, rather than ignored.
#pragma once

#include "xinfer/sampling_params.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace xinfer {

struct CompletionRequest {
    std::string model;                         // as sent; empty when omitted
    std::vector<std::vector<int32_t>> prompts; // n choices per prompt: choice p·n + j is prompt p's j-th
    std::vector<std::string> text_prompts;     // string prompts, still to be encoded (then prompts is empty)
    int n = 1;
    int max_tokens = 16;                       // OpenAI's default
    SamplingParams sampling;
    bool seeded = false;                       // 'seed' given; else the server draws one per request
    std::vector<int32_t> stop_token_ids;
    bool stream = false;
    bool include_usage = false;                // stream_options.include_usage: a last chunk with usage
};

// The request, or `error` set to the reason a client gets with a 400.
struct ParsedCompletion {
    CompletionRequest request;
    std::string error;
};
ParsedCompletion parse_completion_request(const std::string& body);

// The fields completions and chat completions share, read from a request body `j` (an object)
// into `request`: model, max_tokens (chat: also max_completion_tokens), n, seed, temperature,
// top_p, top_k, stop, stop_token_ids, stream, stream_options; what is not supported (penalties,
// logprobs, logit_bias, best_of, echo, suffix) is refused. False with `error` set to the 400's
// reason. Fields left out keep `request`'s values (the caller's defaults).
bool parse_common_request_fields(const nlohmann::json& j, CompletionRequest& request, std::string& error, bool chat);

// {"error": {"message", "type", "code"}}: OpenAI's error body.
nlohmann::json error_body(const std::string& message, const std::string& type, int code);

struct ChoiceResult {
    std::vector<int32_t> token_ids;
    std::string finish_reason;  // "stop", "length", "abort"
    int64_t prompt_tokens = 0;
    std::string text;           // the decoded completion (empty without a tokenizer)
};
// The non-streaming response: one choice per prompt, and usage summed over them.
nlohmann::json completion_body(const std::string& id, int64_t created, const std::string& model,
                               const std::vector<ChoiceResult>& choices);
// One streamed chunk: choice `index` gained `token_ids` and `text`; finish_reason set on its last
// chunk.
nlohmann::json completion_chunk(const std::string& id, int64_t created, const std::string& model, int index,
                                const std::vector<int32_t>& token_ids, const std::string& finish_reason,
                                const std::string& text = "");
// The last streamed chunk when stream_options.include_usage: no choices, the usage.
nlohmann::json usage_chunk(const std::string& id, int64_t created, const std::string& model,
                           const std::vector<ChoiceResult>& choices);

}  // namespace xinfer
