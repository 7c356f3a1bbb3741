// The built-in chat templates against prompts written out by hand from the templates' text
// (tokenizer/chat_template.h says which text each follows), and Python's json.dumps / str() as the
// templates' tojson / string filters produce them.
#include "tokenizer/chat_template.h"
#include "tokenizer/python_json.h"

#include <gtest/gtest.h>

namespace xinfer::test {
namespace {

using ojson = nlohmann::ordered_json;

ChatMessage msg(const std::string& role, const std::string& content) { return {role, {content}, {}, {}, {}}; }

ChatMessage assistant_calls(std::optional<std::string> reasoning, std::vector<ChatToolCall> calls,
                            std::vector<std::string> parts = {}) {
    return {"assistant", std::move(parts), std::move(reasoning), std::move(calls), {}};
}

ChatToolCall call(const std::string& name, const std::string& arguments_json) {
    return {"call_1", name, ojson::parse(arguments_json)};
}

ojson weather_tool() {
    return ojson::parse(R"({"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City, e.g. Zürich"}},
        "required": ["city"]}}})");
}

std::string render(const std::string& name, const ChatTemplateInput& input) {
    const std::unique_ptr<ChatTemplate> t = make_chat_template(name);
    EXPECT_TRUE(t);
    return t->render(input);
}

TEST(PythonJson, DumpsAsJsonDumps) {
    const ojson v = ojson::parse(R"({"b": 1.0, "a": [true, null, 1e-05, 0.1, 100.0], "c": "x\"y\\\n\u0001é/", "d": 1e16,
        "e": 123456789012345678, "f": -2, "g": {}, "h": []})");
    EXPECT_EQ(python_json_dumps(v),
              R"({"b": 1.0, "a": [true, null, 1e-05, 0.1, 100.0], "c": "x\"y\\\n\u0001é/", "d": 1e+16, )"
              R"("e": 123456789012345678, "f": -2, "g": {}, "h": []})");
    EXPECT_EQ(python_float_repr(1e15), "1000000000000000.0");
    EXPECT_EQ(python_float_repr(1.5e-7), "1.5e-07");
    EXPECT_EQ(python_float_repr(0.0001), "0.0001");
    EXPECT_EQ(python_float_repr(-0.0), "-0.0");
    EXPECT_EQ(python_float_repr(3.14159), "3.14159");
    EXPECT_EQ(python_float_repr(1e100), "1e+100");
    EXPECT_EQ(python_float_repr(123.456), "123.456");
}

TEST(PythonJson, StrAsPythonStr) {
    EXPECT_EQ(python_str(ojson::parse(R"({"a": true, "b": ["x", "it's"], "c": null, "d": 2.5})")),
              R"({'a': True, 'b': ['x', "it's"], 'c': None, 'd': 2.5})");
    EXPECT_EQ(python_str(ojson("plain")), "plain");
    EXPECT_EQ(python_str(ojson(false)), "False");
}

TEST(ChatTemplate, BuiltinsByArchitecture) {
    EXPECT_EQ(builtin_chat_template_for("Qwen3ForCausalLM"), "qwen3");
    EXPECT_EQ(builtin_chat_template_for("Qwen3MoeForCausalLM"), "qwen3");
    EXPECT_EQ(builtin_chat_template_for("MiMoV2FlashForCausalLM"), "mimo");
    EXPECT_EQ(builtin_chat_template_for("LlamaForCausalLM"), "");
    EXPECT_EQ(make_chat_template("jinja"), nullptr);
}

TEST(Qwen3Template, SystemUserAndGenerationPrompt) {
    ChatTemplateInput input;
    input.messages = {msg("system", "You are helpful."), msg("user", "Hi")};
    EXPECT_EQ(render("qwen3", input),
              "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    input.enable_thinking = false;
    EXPECT_EQ(render("qwen3", input),
              "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
              "<think>\n\n</think>\n\n");
    input.add_generation_prompt = false;
    EXPECT_EQ(render("qwen3", input), "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    // Text parts are joined with newlines (vLLM's string content format).
    input.messages = {{"user", {"a", "b"}, {}, {}, {}}};
    EXPECT_EQ(render("qwen3", input), "<|im_start|>user\na\nb<|im_end|>\n");
}

// The last assistant turn after the query gets an (empty) think block: transformers' own
// rendering of [user "Hi", assistant "Hello"] is "...<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n".
TEST(Qwen3Template, FinalAssistantTurnGetsAThinkBlock) {
    ChatTemplateInput input;
    input.add_generation_prompt = false;
    input.messages = {msg("user", "Hi"), msg("assistant", "Hello")};
    EXPECT_EQ(render("qwen3", input),
              "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n");
}

TEST(Qwen3Template, ToolsPreamble) {
    ChatTemplateInput input;
    input.tools = {weather_tool()};
    input.messages = {msg("user", "Weather in Paris?")};
    EXPECT_EQ(render("qwen3", input),
              "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
              R"({"type": "function", "function": {"name": "get_weather", "description": "Get the weather", )"
              R"("parameters": {"type": "object", "properties": {"city": {"type": "string", "description": )"
              R"("City, e.g. Zürich"}}, "required": ["city"]}}})"
              "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
              "<|im_start|>assistant\n");
    // With a system message, its text comes first in the same system turn.
    input.messages.insert(input.messages.begin(), msg("system", "S"));
    EXPECT_EQ(render("qwen3", input).substr(0, 35), "<|im_start|>system\nS\n\n# Tools\n\nYou ");
}

TEST(Qwen3Template, MultiTurnToolUse) {
    ChatTemplateInput input;
    input.tools = {weather_tool()};
    input.messages = {
        msg("system", "S"),
        msg("user", "Weather in Paris and Rome?"),
        assistant_calls("Need both.", {call("get_weather", R"({"city": "Paris"})"), call("get_weather", R"({"city": "Rome"})")}),
        msg("tool", "18C"),
        msg("tool", "21C"),
    };
    const std::string rendered = render("qwen3", input);
    const std::string after_tools = rendered.substr(rendered.find("</tool_call><|im_end|>\n") + 23);
    EXPECT_EQ(after_tools,
              "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
              "<|im_start|>assistant\n<think>\nNeed both.\n</think>\n\n"
              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>\n"
              "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n");
    // Arguments the client sent as a string that is not a JSON object are written as they are;
    // content before the calls takes a newline before the first call.
    input.messages[2] = assistant_calls(std::nullopt, {{"c", "f", ojson("raw text")}}, {"Let me check."});
    const std::string raw = render("qwen3", input);
    EXPECT_NE(raw.find("<|im_start|>assistant\nLet me check.\n<tool_call>\n{\"name\": \"f\", \"arguments\": raw text}\n"
                       "</tool_call><|im_end|>\n"),
              std::string::npos)
        << raw;
}

TEST(Qwen3Template, ReasoningOfEarlierTurnsIsDropped) {
    ChatTemplateInput input;
    input.messages = {msg("user", "Q1"), msg("assistant", "<think>\nold thoughts\n</think>\n\nA1"), msg("user", "Q2")};
    EXPECT_EQ(render("qwen3", input),
              "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
              "<|im_start|>assistant\n");
}

// A user turn that only wraps a tool response is not a query: assistant turns after the real
// query keep their reasoning (empty blocks only on the last turn).
TEST(Qwen3Template, ToolResponseTurnsAreNotQueries) {
    ChatTemplateInput input;
    input.add_generation_prompt = false;
    input.messages = {msg("user", "Q"), assistant_calls(std::nullopt, {call("f", "{}")}),
                      msg("user", "<tool_response>\nX\n</tool_response>"), assistant_calls("r2", {}, {"done"})};
    EXPECT_EQ(render("qwen3", input),
              "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n"
              "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nX\n</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n<think>\nr2\n</think>\n\ndone<|im_end|>\n");
}

// MiMo-V2-Flash's thinking-off prompt as a third-party reference test writes it (ids checked
// against the real tokenizer there): default system prompt, no newline between turns.
TEST(MiMoTemplate, MatchesTheFlashReferencePrompt) {
    ChatTemplateInput input;
    input.messages = {msg("user", "Hello")};
    input.enable_thinking = false;
    EXPECT_EQ(render("mimo", input),
              "<|im_start|>system\nYou are MiMo, a helpful AI assistant engineered by Xiaomi.<|im_end|><|im_start|>user\n"
              "Hello<|im_end|><|im_start|>assistant\n<think></think>");
    input.enable_thinking.reset();  // thinking on by default: the model opens <think> itself
    EXPECT_EQ(render("mimo", input).substr(render("mimo", input).size() - 22), "<|im_start|>assistant\n");
    input.messages = {msg("system", "Be brief."), {"user", {"a", "b"}, {}, {}, {}}};
    EXPECT_EQ(render("mimo", input),
              "<|im_start|>system\nBe brief.<|im_end|><|im_start|>user\nab<|im_end|><|im_start|>assistant\n");
}

TEST(MiMoTemplate, XmlToolsAndMultiTurnToolUse) {
    ChatTemplateInput input;
    input.tools = {ojson::parse(R"({"type": "function", "function": {"name": "get_weather", "description": " Get the weather ",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}})")};
    input.messages = {msg("user", "Q"),
                      assistant_calls("r", {call("get_weather", R"({"city": "Paris", "days": 2, "opts": {"x": true}})")}),
                      msg("tool", "18C"), msg("tool", "19C"), msg("assistant", "Warm."), msg("user", "Thanks")};
    EXPECT_EQ(render("mimo", input),
              "<|im_start|>system\nYou are MiMo, a helpful AI assistant engineered by Xiaomi.\n\n# Tools\n\nYou may call "
              "one or more functions to assist with the user query.\n\nYou have access to the following functions:\n\n"
              "<tools>\n<function>\n<name>get_weather</name>\n<description>Get the weather</description>\n<parameters>\n"
              "<parameter>\n<name>city</name>\n<type>string</type>\n<description>City name</description>\n</parameter>\n"
              "<parameter>\n<name>unit</name>\n<type>string</type>\n<enum>[\"c\", \"f\"]</enum>\n</parameter>\n"
              "<required>[\"city\"]</required>\n</parameters>\n</function>\n</tools>\n\nFor each function call, output "
              "the function name and arguments in the following format:\n<tool_call>\n<function=example_function_name>\n"
              "<parameter=example_parameter_1>value_1</parameter>\n<parameter=example_parameter_2>This is the value for "
              "the second parameter\nthat can span\nmultiple lines</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
              "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
              "nested within <tool_call></tool_call> XML tags\n- DO NOT use function calls inside <think></think> tags.\n"
              "- The value enclosed between parameter tags is preserved exactly as-is, including newlines and spaces.\n"
              "</IMPORTANT><|im_end|>"
              "<|im_start|>user\nQ<|im_end|>"
              "<|im_start|>assistant\n<think>r</think><tool_call>\n<function=get_weather>\n<parameter=city>Paris"
              "</parameter>\n<parameter=days>2</parameter>\n<parameter=opts>{\"x\": true}</parameter>\n</function>\n"
              "</tool_call><|im_end|>"
              "<|im_start|>tool\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n19C\n</tool_response>\n<|im_end|>"
              "<|im_start|>assistant\n<think></think>Warm.<|im_end|>"
              "<|im_start|>user\nThanks<|im_end|><|im_start|>assistant\n");
}

TEST(MiMoTemplate, ReasoningInContentAndArgumentsThatAreNotAnObject) {
    ChatTemplateInput input;
    input.add_generation_prompt = false;
    input.messages = {msg("user", "Q"), msg("assistant", "<think>t</think>A")};
    const std::string rendered = render("mimo", input);
    EXPECT_EQ(rendered.substr(rendered.find("<|im_start|>user")),
              "<|im_start|>user\nQ<|im_end|><|im_start|>assistant\n<think>t</think>A<|im_end|>");
    input.messages[1] = assistant_calls(std::nullopt, {{"c", "f", ojson("not an object")}});
    EXPECT_THROW(render("mimo", input), std::invalid_argument);
}

}  // namespace
}  // namespace xinfer::test
