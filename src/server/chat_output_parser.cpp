#include "server/chat_output_parser.h"

namespace xinfer {

ChatOutputParser::ChatOutputParser(ChatOutputOptions options) : options_(std::move(options)), reasoning_(options_.thinking) {
    if (options_.tool_calls) tools_.emplace(*options_.tool_calls, options_.tools);
}

void ChatOutputParser::add_content(ChatOutputDelta& out, const ToolCallSplit& split) {
    if (!content_started_) {
        held_whitespace_ += split.content;
        if (held_whitespace_.find_first_not_of(" \t\n\r\f\v") != std::string::npos) {
            out.content += held_whitespace_;
            held_whitespace_.clear();
            content_started_ = true;
        }
    } else {
        out.content += split.content;
    }
    for (const ParsedToolCall& call : split.calls) {
        if (!options_.parallel_tool_calls && calls_ > 0) continue;
        out.tool_calls.push_back(call);
        ++calls_;
    }
}

void ChatOutputParser::add(ChatOutputDelta& out, const ReasoningSplit& split) {
    out.reasoning += split.reasoning;
    if (tools_) add_content(out, tools_->feed(split.content));
    else add_content(out, {split.content, {}});
}

ChatOutputDelta ChatOutputParser::feed(std::string_view text) {
    ChatOutputDelta out;
    add(out, reasoning_.feed(text));
    return out;
}

ChatOutputDelta ChatOutputParser::finish() {
    ChatOutputDelta out;
    add(out, reasoning_.finish());
    if (tools_) add_content(out, tools_->finish());
    held_whitespace_.clear();  // only whitespace ever: no content
    return out;
}

ChatOutputDelta ChatOutputParser::parse(ChatOutputOptions options, std::string_view text) {
    ChatOutputParser parser(std::move(options));
    ChatOutputDelta out = parser.feed(text);
    ChatOutputDelta last = parser.finish();
    out.reasoning += last.reasoning;
    out.content += last.content;
    out.tool_calls.insert(out.tool_calls.end(), last.tool_calls.begin(), last.tool_calls.end());
    return out;
}

}  // namespace xinfer
