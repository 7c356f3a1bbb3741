// The OpenAI chat completions protocol: request validation, and the response / stream chunk
// bodies, as pure functions (tested without sockets; server.cpp does the HTTP, the template
// renders the prompt, chat_output_parser.h splits what the model writes).
//
// Messages: roles system (or "developer", OpenAI's newer name for it), user, assistant, tool;
// content a string or an array of text parts (image, audio and file parts are refused: the
// served models read text). Assistant turns may carry tool_calls (arguments as a JSON string or
// object) and reasoning_content (or vLLM's "reasoning"). Tools: `tools`, `tool_choice` "auto"
// or "none" ("required" and a named function are refused with a 400 saying so),
// `parallel_tool_calls`. Thinking: chat_template_kwargs.enable_thinking, or MiMo's API form
// thinking: {"type": "enabled" | "disabled"}. The sampling fields are the completions route's
// (openai_protocol.h), plus max_completion_tokens; without a max, generation may fill the
// context. Everything malformed is a 400 with the reason.
//
// Responses carry reasoning twice, as `reasoning_content` (DeepSeek's and MiMo's name) and
// `reasoning` (vLLM ≥ 0.11's), since clients read one or the other.
#pragma once

#include "server/chat_output_parser.h"
#include "server/openai_protocol.h"
#include "tokenizer/chat_template.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace xinfer {

struct ChatRequest {
    // The fields chat shares with completions (prompts / text_prompts unused); max_tokens 0
    // when the request set none (the server then allows the rest of the context).
    CompletionRequest sampling;
    ChatTemplateInput conversation;
    bool tools_enabled = false;  // tools given and tool_choice is not "none": parse tool calls
    bool parallel_tool_calls = true;
};

struct ParsedChat {
    ChatRequest request;
    std::string error;  // the 400's reason; empty when the request is valid
};
ParsedChat parse_chat_request(const std::string& body);

struct ChatChoiceResult {
    ChatOutputDelta message;               // joined over the whole completion
    std::vector<std::string> tool_call_ids;  // [message.tool_calls.size()]
    std::string finish_reason;             // "stop", "length", "abort", "tool_calls"
    int64_t completion_tokens = 0;
};

// "tool_calls" when the model ended its turn (stop) after calling tools; else the engine's reason.
std::string chat_finish_reason(const std::string& engine_reason, int tool_calls);

nlohmann::json chat_completion_body(const std::string& id, int64_t created, const std::string& model,
                                    int64_t prompt_tokens, const std::vector<ChatChoiceResult>& choices);

// Stream chunks: one choice's delta (an object: {"role"}, {"content"}, {"reasoning_content",
// "reasoning"}, {"tool_calls": [...]}, or {} with the finish reason).
nlohmann::json chat_chunk(const std::string& id, int64_t created, const std::string& model, int index,
                          const nlohmann::json& delta, const std::string& finish_reason = "");
// The deltas one parser step gives, in order: reasoning, content, then for each new call a delta
// naming it (index, id, type, name, empty arguments) and one with its arguments. The calls are
// numbered from `first_call_index` with ids from `call_ids`.
std::vector<nlohmann::json> chat_deltas(const ChatOutputDelta& step, int first_call_index,
                                        const std::vector<std::string>& call_ids);
nlohmann::json chat_usage_chunk(const std::string& id, int64_t created, const std::string& model, int64_t prompt_tokens,
                                int64_t completion_tokens);

}  // namespace xinfer
