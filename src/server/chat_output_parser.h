// A chat completion's text → reasoning, content and tool calls, incrementally: the reasoning
// parser first (reasoning_parser.h), then tool calls out of what is content (tool_call_parser.h;
// never out of reasoning, where the templates tell the model not to call tools).
//
// Content that is only whitespace (the "\n\n" a model writes between </think> and a call, or
// after the last call) is held back until something else arrives, and dropped if nothing does:
// a message that is only tool calls has no content. With `parallel_tool_calls` false only the
// first call is kept (vLLM: "0-1 tool call").
//
// The same text gives the same result, joined over feed() and finish(), however it is cut; parse()
// is the one-shot form and the reference the streaming tests compare against.
#pragma once

#include "server/reasoning_parser.h"
#include "server/tool_call_parser.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace xinfer {

struct ChatOutputOptions {
    bool thinking = false;                     // the output starts inside <think> (thinking on)
    std::optional<ToolCallFormat> tool_calls;  // unset: no tools (or tool_choice "none"), all content
    std::vector<nlohmann::ordered_json> tools;  // the request's tools (parameter types)
    bool parallel_tool_calls = true;
};

struct ChatOutputDelta {
    std::string reasoning;
    std::string content;
    std::vector<ParsedToolCall> tool_calls;

    bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

class ChatOutputParser {
public:
    explicit ChatOutputParser(ChatOutputOptions options);
    ChatOutputParser(const ChatOutputParser&) = delete;  // the tool parser refers to options_.tools
    ChatOutputParser& operator=(const ChatOutputParser&) = delete;
    ChatOutputDelta feed(std::string_view text);
    ChatOutputDelta finish();
    int tool_calls_so_far() const { return calls_; }

    // The whole text at once (feed + finish).
    static ChatOutputDelta parse(ChatOutputOptions options, std::string_view text);

private:
    void add_content(ChatOutputDelta& out, const ToolCallSplit& split);
    void add(ChatOutputDelta& out, const ReasoningSplit& split);

    ChatOutputOptions options_;
    ReasoningParser reasoning_;
    std::optional<ToolCallParser> tools_;
    std::string held_whitespace_;  // content that is only whitespace so far
    bool content_started_ = false;
    int calls_ = 0;
};

}  // namespace xinfer
