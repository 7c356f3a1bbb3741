// Helpers for the streaming output parsers (reasoning_parser.h, tool_call_parser.h): finding
// literal markers such as "</think>" in text that arrives in arbitrary pieces.
#pragma once

#include <algorithm>
#include <string_view>

namespace xinfer {

// The length of the longest suffix of `text` that is a proper prefix of `marker`: the bytes a
// streaming parser must hold back because the next delta could complete the marker.
inline size_t marker_prefix_suffix(std::string_view text, std::string_view marker) {
    for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
        if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
    return 0;
}

}  // namespace xinfer
