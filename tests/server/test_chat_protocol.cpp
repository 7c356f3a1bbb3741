// The chat completions protocol without sockets: what a request may ask (messages, tools,
// thinking, the sampling fields completions shares), the reasons a client gets for what it may
// not, and the response and stream chunk bodies.
#include "server/chat_protocol.h"

#include <gtest/gtest.h>

namespace xinfer::test {
namespace {

using json = nlohmann::json;

ChatRequest ok(const std::string& body) {
    ParsedChat p = parse_chat_request(body);
    EXPECT_EQ(p.error, "") << body;
    return p.request;
}

void refused(const std::string& body, const std::string& expected) {
    const ParsedChat p = parse_chat_request(body);
    EXPECT_NE(p.error.find(expected), std::string::npos) << body << " → \"" << p.error << "\"";
}

TEST(ChatProtocol, MessagesToolsAndSampling) {
    const ChatRequest r = ok(R"({"model": "m", "messages": [
        {"role": "developer", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": null, "reasoning_content": "r",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [2]}"}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"z": {}}}}}],
        "tool_choice": "auto", "parallel_tool_calls": false, "max_completion_tokens": 7, "temperature": 0, "n": 2,
        "seed": 3, "stop": "END", "stream": true, "stream_options": {"include_usage": true}, "logprobs": false,
        "chat_template_kwargs": {"enable_thinking": false}, "user": "ignored"})");
    const std::vector<ChatMessage>& m = r.conversation.messages;
    ASSERT_EQ(m.size(), 4u);
    EXPECT_EQ(m[0].role, "system");
    EXPECT_EQ(m[1].parts, (std::vector<std::string>{"a", "b"}));
    EXPECT_TRUE(m[2].parts.empty());
    EXPECT_EQ(m[2].reasoning_content, "r");
    ASSERT_EQ(m[2].tool_calls.size(), 2u);
    EXPECT_EQ(m[2].tool_calls[0].arguments.dump(), R"({"z":1,"a":[2]})");  // key order kept
    EXPECT_EQ(m[2].tool_calls[1].arguments.dump(), "{}");                   // "" is {}, as vLLM
    EXPECT_EQ(m[3].tool_call_id, "c1");
    ASSERT_EQ(r.conversation.tools.size(), 1u);
    EXPECT_TRUE(r.tools_enabled);
    EXPECT_FALSE(r.parallel_tool_calls);
    EXPECT_EQ(r.conversation.enable_thinking, false);
    EXPECT_EQ(r.sampling.max_tokens, 7);
    EXPECT_EQ(r.sampling.n, 2);
    EXPECT_EQ(r.sampling.sampling.stop, (std::vector<std::string>{"END"}));
    EXPECT_TRUE(r.sampling.stream);
    EXPECT_TRUE(r.sampling.include_usage);
    // Defaults: no max (the server fills the context), thinking left to the template, tools off.
    const ChatRequest d = ok(R"({"messages": [{"role": "user", "content": "hi"}]})");
    EXPECT_EQ(d.sampling.max_tokens, 0);
    EXPECT_FALSE(d.conversation.enable_thinking.has_value());
    EXPECT_FALSE(d.tools_enabled);
    EXPECT_TRUE(d.conversation.add_generation_prompt);
    // MiMo's thinking switch; tool_choice none drops the tools.
    EXPECT_EQ(ok(R"({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}})")
                  .conversation.enable_thinking,
              false);
    const ChatRequest none = ok(R"({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "f"}}]})");
    EXPECT_FALSE(none.tools_enabled);
    EXPECT_TRUE(none.conversation.tools.empty());
}

TEST(ChatProtocol, RefusalsSayWhy) {
    const std::string user = R"("messages": [{"role": "user", "content": "hi"}])";
    refused("not json", "not valid JSON");
    refused("[]", "JSON object");
    refused("{}", "'messages' is required");
    refused(R"({"messages": []})", "'messages' is required");
    refused(R"({"messages": [{"role": "robot", "content": "x"}]})", "messages[0].role is 'robot'");
    refused(R"({"messages": [{"content": "x"}]})", "messages[0].role must be a string");
    refused(R"({"messages": [{"role": "user"}]})", "messages[0].content is required");
    refused(R"({"messages": [{"role": "user", "content": 5}]})", "string or an array of text parts");
    refused(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})",
            "image input is not supported");
    refused(R"({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})", "only text parts");
    refused(R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})", "content[0].text must be a string");
    refused(R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]})",
            "messages[0].tool_calls[0].function.arguments is not valid JSON");
    refused(R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]})", "function.name");
    refused(R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})", "only allowed on assistant");
    refused("{" + user + R"(, "tools": [{"type": "retrieval"}]})", "tools[0].type");
    refused("{" + user + R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]})",
            "JSON-schema object");
    refused("{" + user + R"(, "tool_choice": "required"})", "\"required\" is not supported");
    refused("{" + user + R"(, "tool_choice": {"type": "function", "function": {"name": "f"}}})", "naming a function");
    refused("{" + user + R"(, "tool_choice": "sometimes"})", "must be \"auto\" or \"none\"");
    refused("{" + user + R"(, "functions": []})", "use those");
    refused("{" + user + R"(, "logprobs": true})", "'logprobs' is not supported");
    refused("{" + user + R"(, "top_logprobs": 2})", "'top_logprobs' is not supported");
    refused("{" + user + R"(, "max_completion_tokens": 0})", "'max_completion_tokens' must be in");
    refused("{" + user + R"(, "max_tokens": "many"})", "'max_tokens' must be an integer");
    refused("{" + user + R"(, "n": 0})", "'n' must be in");
    refused("{" + user + R"(, "stop": [1]})", "'stop' must be a string or an array of strings");
    refused("{" + user + R"(, "stream_options": {"include_usage": true}})", "only allowed with 'stream': true");
    refused("{" + user + R"(, "presence_penalty": 1})", "penalties are not supported");
    refused("{" + user + R"(, "chat_template_kwargs": {"enable_thinking": "yes"}})", "enable_thinking' must be a boolean");
    refused("{" + user + R"(, "thinking": {"type": "maybe"}})", "'thinking' must be");
    refused("{" + user + R"(, "response_format": {"type": "json_object"}})", "'response_format'");
    refused("{" + user + R"(, "parallel_tool_calls": 1})", "'parallel_tool_calls' must be a boolean");
}

TEST(ChatProtocol, ResponseAndChunks) {
    ChatChoiceResult choice;
    choice.message.reasoning = "r";
    choice.message.tool_calls = {{"f", R"({"a": 1})"}};
    choice.tool_call_ids = {"call_1_0_0"};
    choice.finish_reason = chat_finish_reason("stop", 1);
    choice.completion_tokens = 5;
    const json body = chat_completion_body("chatcmpl-1", 100, "m", 7, {choice});
    EXPECT_EQ(body["object"], "chat.completion");
    const json& message = body["choices"][0]["message"];
    EXPECT_EQ(message["role"], "assistant");
    EXPECT_TRUE(message["content"].is_null());
    EXPECT_EQ(message["reasoning_content"], "r");
    EXPECT_EQ(message["reasoning"], "r");
    EXPECT_EQ(message["tool_calls"][0]["id"], "call_1_0_0");
    EXPECT_EQ(message["tool_calls"][0]["type"], "function");
    EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "f");
    EXPECT_EQ(message["tool_calls"][0]["function"]["arguments"], R"({"a": 1})");
    EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
    EXPECT_EQ(body["usage"]["total_tokens"], 12);
    EXPECT_EQ(chat_finish_reason("length", 1), "length");
    EXPECT_EQ(chat_finish_reason("stop", 0), "stop");

    ChatOutputDelta step;
    step.reasoning = "r";
    step.content = "c";
    step.tool_calls = {{"f", "{}"}};
    const std::vector<json> deltas = chat_deltas(step, 1, {"id0", "id1"});
    ASSERT_EQ(deltas.size(), 4u);
    EXPECT_EQ(deltas[0], json({{"reasoning_content", "r"}, {"reasoning", "r"}}));
    EXPECT_EQ(deltas[1], json({{"content", "c"}}));
    EXPECT_EQ(deltas[2]["tool_calls"][0]["index"], 1);
    EXPECT_EQ(deltas[2]["tool_calls"][0]["id"], "id1");
    EXPECT_EQ(deltas[2]["tool_calls"][0]["function"]["name"], "f");
    EXPECT_EQ(deltas[3]["tool_calls"][0]["function"]["arguments"], "{}");
    const json chunk = chat_chunk("chatcmpl-1", 100, "m", 0, deltas[1]);
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
    EXPECT_EQ(chat_usage_chunk("chatcmpl-1", 100, "m", 3, 4)["usage"]["total_tokens"], 7);
}

}  // namespace
}  // namespace xinfer::test
