// Tool calls out of a chat completion's content, incrementally.
//
// Two formats, both between <tool_call> and </tool_call> (several calls one after another):
//  - "hermes" (Qwen3, Hermes; vLLM's hermes parser): a JSON object
//      <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
//  - "mimo_xml" (MiMo-V2, Qwen3-Coder; SGLang's mimo detector):
//      <tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</tool_call>
//    Parameter values are raw text, converted by the JSON-schema type the request's tools
//    declare for that parameter (integer, number, boolean, object, array, null; string, or an
//    undeclared parameter, stays text). One newline at each end of a value is the format's, not
//    the value's.
// A call's arguments come out as a JSON string, written as vLLM writes them (json.dumps).
//
// Text outside the calls is content. A call is only given out whole, once its </tool_call> has
// arrived (or at finish(), a call cut short that still parses whole, e.g. ended by a stop
// string): so no client ever sees empty or partial arguments that later change, and a call
// whose marker is split across deltas is not lost. Malformed call text (not JSON, no name, no
// <function=...>) is given back as content, tags included, never an error.
//
// Joined over feed() calls and finish(), content and calls are the same for every way of
// cutting the same text.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace xinfer {

enum class ToolCallFormat { hermes, mimo_xml };

struct ParsedToolCall {
    std::string name;
    std::string arguments;  // a JSON object, as text

    bool operator==(const ParsedToolCall&) const = default;
};

struct ToolCallSplit {
    std::string content;
    std::vector<ParsedToolCall> calls;
};

// One call's text between the tags: the call, or false when it is malformed. `tools` is the
// request's tools (OpenAI form: {"type": "function", "function": {"name", "parameters"}}), for
// the parameter types of the XML format.
bool parse_tool_call_body(ToolCallFormat format, std::string_view body, const std::vector<nlohmann::ordered_json>& tools,
                          ParsedToolCall& call);

class ToolCallParser {
public:
    // `tools` must outlive the parser.
    ToolCallParser(ToolCallFormat format, const std::vector<nlohmann::ordered_json>& tools)
        : format_(format), tools_(tools) {}
    ToolCallSplit feed(std::string_view text);
    ToolCallSplit finish();

private:
    ToolCallFormat format_;
    const std::vector<nlohmann::ordered_json>& tools_;
    bool inside_call_ = false;
    std::string pending_;  // outside: a "<tool_call>" cut short; inside: the call so far
};

}  // namespace xinfer
