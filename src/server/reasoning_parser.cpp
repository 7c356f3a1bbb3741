#include "server/reasoning_parser.h"

namespace xinfer {
namespace {
constexpr std::string_view kThinkStart = "<think>";
constexpr std::string_view kThinkEnd = "</think>";
}  // namespace

ReasoningSplit ReasoningParser::feed(std::string_view text) {
    ReasoningSplit out;
    pending_ += text;
    if (state_ == State::start) {
        if (pending_.size() < kThinkStart.size() && kThinkStart.substr(0, pending_.size()) == pending_)
            return out;  // still could be "<think>"
        if (pending_.rfind(kThinkStart, 0) == 0) pending_.erase(0, kThinkStart.size());
        state_ = State::reasoning;
    }
    if (state_ == State::reasoning) {
        const size_t end = pending_.find(kThinkEnd);
        if (end == std::string::npos) {
            const size_t keep = marker_prefix_suffix(pending_, kThinkEnd);
            out.reasoning = pending_.substr(0, pending_.size() - keep);
            pending_.erase(0, pending_.size() - keep);
            return out;
        }
        out.reasoning = pending_.substr(0, end);
        pending_.erase(0, end + kThinkEnd.size());
        state_ = State::content;
    }
    out.content += pending_;
    pending_.clear();
    return out;
}

ReasoningSplit ReasoningParser::finish() {
    ReasoningSplit out;
    // Held back at the start ("<thi") or a "</thi" cut short: with thinking on, that is reasoning.
    if (state_ == State::content) out.content = std::move(pending_);
    else out.reasoning = std::move(pending_);
    pending_.clear();
    return out;
}

}  // namespace xinfer
