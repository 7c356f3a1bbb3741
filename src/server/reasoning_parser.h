// Splits a chat completion's text into reasoning (<think>…</think>) and content, incrementally.
//
// Qwen3 and MiMo write their thinking between <think> and </think>. Whether the model writes the
// opening tag itself depends on the template (Qwen3's generation prompt leaves it to the model;
// other templates put it in the prompt), so with thinking on the output is reasoning from its
// start, a leading "<think>" dropped, up to the first "</think>"; content after it. Output with
// no "</think>" (cut by max_tokens, or a stop string) is all reasoning. With thinking off the
// whole output is content. The text between the tags is kept as the model wrote it (vLLM does
// the same: the newlines around it are the model's).
//
// Text arrives in deltas cut anywhere (a speculative step can add many tokens, a marker can be
// split at any byte). feed() holds back a suffix that could still become a marker, so joined
// over feed() calls and finish(), reasoning and content are the same for every way of cutting
// the same text (the tests check every cut).
#pragma once

#include "server/text_markers.h"

#include <string>
#include <string_view>

namespace xinfer {

struct ReasoningSplit {
    std::string reasoning;
    std::string content;
};

class ReasoningParser {
public:
    explicit ReasoningParser(bool thinking) : state_(thinking ? State::start : State::content) {}
    // The reasoning and content `text` settles (possibly none yet).
    ReasoningSplit feed(std::string_view text);
    // The end of output: whatever was held back.
    ReasoningSplit finish();

private:
    enum class State { start, reasoning, content };
    State state_;
    std::string pending_;  // held back: a possible "<think>" at the start or a "</think>" cut short
};

}  // namespace xinfer
