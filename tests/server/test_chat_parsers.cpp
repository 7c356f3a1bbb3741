// The reasoning and tool-call parsers: what they make of whole outputs, malformed ones included,
// and that streamed in pieces (cut at every byte, one byte at a time, randomly) they give exactly
// what the one-shot parse gives: the property speculative decoding (many tokens a step) needs.
#include "server/chat_output_parser.h"

#include <gtest/gtest.h>

#include <random>

namespace xinfer::test {
namespace {

using ojson = nlohmann::ordered_json;

ChatOutputOptions options(bool thinking, std::optional<ToolCallFormat> format, bool parallel = true) {
    ChatOutputOptions o;
    o.thinking = thinking;
    o.tool_calls = format;
    o.parallel_tool_calls = parallel;
    o.tools = {ojson::parse(R"({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "tags": {"type": "array"}, "extra": {"type": "object"},
        "limit": {"type": ["integer", "null"]}, "note": {"type": "string"}}}}})")};
    return o;
}

ChatOutputDelta join(ChatOutputDelta a, const ChatOutputDelta& b) {
    a.reasoning += b.reasoning;
    a.content += b.content;
    a.tool_calls.insert(a.tool_calls.end(), b.tool_calls.begin(), b.tool_calls.end());
    return a;
}

// The text fed in the given pieces, joined.
ChatOutputDelta streamed(const ChatOutputOptions& o, const std::vector<std::string>& pieces) {
    ChatOutputParser parser(o);
    ChatOutputDelta out;
    for (const std::string& p : pieces) out = join(out, parser.feed(p));
    return join(out, parser.finish());
}

void expect_same(const ChatOutputDelta& got, const ChatOutputDelta& want, const std::string& how) {
    EXPECT_EQ(got.reasoning, want.reasoning) << how;
    EXPECT_EQ(got.content, want.content) << how;
    EXPECT_EQ(got.tool_calls, want.tool_calls) << how;
}

// Every cut point, byte by byte, and random chunkings all equal the one-shot parse.
void expect_split_invariant(const ChatOutputOptions& o, const std::string& text) {
    const ChatOutputDelta whole = ChatOutputParser::parse(o, text);
    for (size_t cut = 0; cut <= text.size(); ++cut)
        expect_same(streamed(o, {text.substr(0, cut), text.substr(cut)}), whole, "cut at " + std::to_string(cut));
    std::vector<std::string> bytes;
    for (char c : text) bytes.emplace_back(1, c);
    expect_same(streamed(o, bytes), whole, "byte by byte");
    std::mt19937 rng(7);
    for (int trial = 0; trial < 100; ++trial) {
        std::vector<std::string> pieces;
        for (size_t at = 0; at < text.size();) {
            const size_t n = std::uniform_int_distribution<size_t>(0, 12)(rng);  // empty pieces too
            pieces.push_back(text.substr(at, n));
            at += n;
        }
        expect_same(streamed(o, pieces), whole, "random chunking " + std::to_string(trial));
    }
}

TEST(ReasoningParser, SplitsThinkingFromContent) {
    auto r = ChatOutputParser::parse(options(true, std::nullopt), "<think>\nhm\n</think>\n\nHello");
    EXPECT_EQ(r.reasoning, "\nhm\n");
    EXPECT_EQ(r.content, "\n\nHello");
    // The template may have opened <think> already: the output starts inside it.
    r = ChatOutputParser::parse(options(true, std::nullopt), "hm</think>ok");
    EXPECT_EQ(r.reasoning, "hm");
    EXPECT_EQ(r.content, "ok");
    // No </think> (cut by max_tokens): all reasoning, a marker cut short included.
    r = ChatOutputParser::parse(options(true, std::nullopt), "<think>abc</thi");
    EXPECT_EQ(r.reasoning, "abc</thi");
    EXPECT_EQ(r.content, "");
    EXPECT_EQ(ChatOutputParser::parse(options(true, std::nullopt), "<thi").reasoning, "<thi");
    // Thinking off: everything is content.
    r = ChatOutputParser::parse(options(false, std::nullopt), "<think>x</think>y");
    EXPECT_EQ(r.reasoning, "");
    EXPECT_EQ(r.content, "<think>x</think>y");
}

TEST(ToolCallParser, HermesCalls) {
    const std::string text =
        "<think>\nI should call it.\n</think>\n\nSure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        "{\"city\": \"Zürich\", \"days\": 2.0}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        "{\"city\": \"Rome\"}}\n</tool_call>\n";
    const auto r = ChatOutputParser::parse(options(true, ToolCallFormat::hermes), text);
    EXPECT_EQ(r.reasoning, "\nI should call it.\n");
    EXPECT_EQ(r.content, "\n\nSure.\n\n\n");
    ASSERT_EQ(r.tool_calls.size(), 2u);
    EXPECT_EQ(r.tool_calls[0], (ParsedToolCall{"get_weather", R"({"city": "Zürich", "days": 2.0})"}));
    EXPECT_EQ(r.tool_calls[1], (ParsedToolCall{"get_weather", R"({"city": "Rome"})"}));
    // parallel_tool_calls false keeps the first call only.
    EXPECT_EQ(ChatOutputParser::parse(options(true, ToolCallFormat::hermes, false), text).tool_calls.size(), 1u);
    // Only calls and whitespace: no content at all.
    const auto only = ChatOutputParser::parse(options(false, ToolCallFormat::hermes),
                                              "\n<tool_call>{\"name\": \"f\"}</tool_call>\n\n");
    EXPECT_EQ(only.content, "");
    EXPECT_EQ(only.tool_calls, (std::vector<ParsedToolCall>{{"f", "{}"}}));
    // Without tools the same text is content.
    EXPECT_EQ(ChatOutputParser::parse(options(false, std::nullopt), "<tool_call>{}</tool_call>").content,
              "<tool_call>{}</tool_call>");
}

TEST(ToolCallParser, MalformedCallsStayContent) {
    const auto o = options(false, ToolCallFormat::hermes);
    for (const std::string text : {"<tool_call>\nnot json\n</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>",
                                   "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
                                   "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}", "a <tool_call> b"}) {
        const auto r = ChatOutputParser::parse(o, text);
        EXPECT_TRUE(r.tool_calls.empty()) << text;
        EXPECT_EQ(r.content, text);
    }
    // A call cut short that is still whole JSON (a stop string ended it) is a call.
    const auto cut = ChatOutputParser::parse(o, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n");
    EXPECT_EQ(cut.tool_calls, (std::vector<ParsedToolCall>{{"f", R"({"a": 1})"}}));
    // A malformed call between good ones does not cost the good ones.
    const auto mixed =
        ChatOutputParser::parse(o, "<tool_call>{\"name\": \"a\"}</tool_call><tool_call>oops</tool_call><tool_call>"
                                   "{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>");
    EXPECT_EQ(mixed.content, "<tool_call>oops</tool_call>");
    EXPECT_EQ(mixed.tool_calls, (std::vector<ParsedToolCall>{{"a", "{}"}, {"b", R"({"x": 1})"}}));
}

TEST(ToolCallParser, MiMoXmlWithDeclaredTypes) {
    const std::string text =
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>3"
        "</parameter>\n<parameter=metric>True</parameter>\n<parameter=ratio>0.5</parameter>\n<parameter=tags>"
        "[\"a\", \"b\"]</parameter>\n<parameter=extra>{\"k\": 1}</parameter>\n<parameter=limit>null</parameter>\n"
        "<parameter=note>multi\nline </parameter>\n<parameter=undeclared>42</parameter>\n<parameter=days2>x"
        "</parameter>\n</function>\n</tool_call>";
    const auto r = ChatOutputParser::parse(options(true, ToolCallFormat::mimo_xml), "plan</think>" + text);
    EXPECT_EQ(r.reasoning, "plan");
    EXPECT_EQ(r.content, "");
    ASSERT_EQ(r.tool_calls.size(), 1u);
    EXPECT_EQ(r.tool_calls[0].name, "get_weather");
    EXPECT_EQ(r.tool_calls[0].arguments,
              R"({"city": "San Francisco", "days": 3, "metric": true, "ratio": 0.5, "tags": ["a", "b"], )"
              R"("extra": {"k": 1}, "limit": null, "note": "multi\nline ", "undeclared": "42", "days2": "x"})");
    // Text that does not read as the declared type stays text.
    const auto loose = ChatOutputParser::parse(
        options(false, ToolCallFormat::mimo_xml),
        "<tool_call><function=get_weather><parameter=days>three</parameter><parameter=metric>yes</parameter>"
        "</function></tool_call>");
    ASSERT_EQ(loose.tool_calls.size(), 1u);
    EXPECT_EQ(loose.tool_calls[0].arguments, R"({"days": "three", "metric": "yes"})");
    // A value missing </parameter> ends at the next parameter.
    const auto unclosed = ChatOutputParser::parse(
        options(false, ToolCallFormat::mimo_xml),
        "<tool_call>\n<function=f>\n<parameter=a>1\n<parameter=b>2</parameter>\n</function>\n</tool_call>");
    ASSERT_EQ(unclosed.tool_calls.size(), 1u);
    EXPECT_EQ(unclosed.tool_calls[0].arguments, R"({"a": "1", "b": "2"})");
    // Malformed: no function, text after it, no </function>.
    for (const std::string bad : {"<tool_call>{\"name\": \"f\"}</tool_call>",
                                  "<tool_call><function=f></function>junk</tool_call>",
                                  "<tool_call><function=f><parameter=a>1</parameter></tool_call>"}) {
        const auto m = ChatOutputParser::parse(options(false, ToolCallFormat::mimo_xml), bad);
        EXPECT_TRUE(m.tool_calls.empty()) << bad;
        EXPECT_EQ(m.content, bad);
    }
}

TEST(ChatOutputParser, EveryCutGivesTheOneShotResult) {
    const std::string hermes =
        "<think>\nhm, <tool_call> is not for here\n</think>\n\nLet me look.<tool_call>\n{\"name\": \"get_weather\", "
        "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>broken</tool_call><tool_call>\n{\"name\": "
        "\"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>\n<tool_ca";
    const std::string xml =
        "<think>x</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>2</parameter>\n</function>\n</tool_call>\ntrailing <tool_call><function=get_weather>";
    for (bool thinking : {true, false}) {
        for (bool parallel : {true, false}) {
            expect_split_invariant(options(thinking, ToolCallFormat::hermes, parallel), hermes);
            expect_split_invariant(options(thinking, ToolCallFormat::mimo_xml, parallel), xml);
            expect_split_invariant(options(thinking, std::nullopt, parallel), hermes);
        }
    }
    expect_split_invariant(options(true, ToolCallFormat::hermes), "<think>never closed </thin");
    expect_split_invariant(options(true, ToolCallFormat::hermes), "<thin");
    expect_split_invariant(options(true, ToolCallFormat::hermes), "  \n");
    // The cases the split tests must not pass vacuously.
    const auto h = ChatOutputParser::parse(options(true, ToolCallFormat::hermes), hermes);
    EXPECT_EQ(h.tool_calls.size(), 2u);
    EXPECT_EQ(h.content, "\n\nLet me look.\n<tool_call>broken</tool_call>\n<tool_ca");
    EXPECT_EQ(ChatOutputParser::parse(options(true, ToolCallFormat::mimo_xml), xml).tool_calls.size(), 1u);
}

}  // namespace
}  // namespace xinfer::test
