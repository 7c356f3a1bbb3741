#include "server/chat_protocol.h"

#include <fmt/format.h>

#include <stdexcept>

namespace xinfer {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// A 400's reason, thrown inside the parser and caught at its top.
struct BadRequest : std::runtime_error {
    using std::runtime_error::runtime_error;
};
[[noreturn]] void bad(const std::string& message) { throw BadRequest(message); }

// Content: a string, null, or an array of {"type": "text", "text": ...} parts.
void read_content(const ojson& m, const std::string& where, bool may_be_null, ChatMessage& out) {
    if (!m.contains("content") || m["content"].is_null()) {
        if (!may_be_null) bad(fmt::format("{}.content is required for a {} message", where, out.role));
        return;
    }
    const ojson& content = m["content"];
    if (content.is_string()) {
        out.parts.push_back(content.get<std::string>());
        return;
    }
    if (!content.is_array()) bad(fmt::format("{}.content must be a string or an array of text parts", where));
    for (size_t i = 0; i < content.size(); ++i) {
        const ojson& part = content[i];
        const std::string at = fmt::format("{}.content[{}]", where, i);
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
            bad(fmt::format("{} must be an object with a 'type'", at));
        const std::string type = part["type"].get<std::string>();
        if (type == "image_url" || type == "input_image" || type == "image")
            bad(fmt::format("{} is an image: this server serves a text-only model, image input is not supported", at));
        if (type == "input_audio" || type == "audio_url" || type == "video_url" || type == "file")
            bad(fmt::format("{} is of type '{}': only text parts are supported", at, type));
        if (type != "text") bad(fmt::format("{} has type '{}'; the supported content part type is 'text'", at, type));
        if (!part.contains("text") || !part["text"].is_string()) bad(fmt::format("{}.text must be a string", at));
        out.parts.push_back(part["text"].get<std::string>());
    }
}

ChatToolCall read_tool_call(const ojson& c, const std::string& where) {
    if (!c.is_object()) bad(fmt::format("{} must be an object", where));
    if (c.contains("type") && c["type"] != "function") bad(fmt::format("{}.type must be \"function\"", where));
    if (!c.contains("function") || !c["function"].is_object()) bad(fmt::format("{}.function must be an object", where));
    const ojson& f = c["function"];
    if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty())
        bad(fmt::format("{}.function.name must be a non-empty string", where));
    ChatToolCall call;
    call.name = f["name"].get<std::string>();
    if (c.contains("id") && c["id"].is_string()) call.id = c["id"].get<std::string>();
    // As vLLM does before rendering: a JSON string becomes its value; empty or missing is {}.
    const ojson arguments = f.contains("arguments") ? f["arguments"] : ojson();
    if (arguments.is_null() || (arguments.is_string() && arguments.get<std::string>().empty())) {
        call.arguments = ojson::object();
    } else if (arguments.is_string()) {
        call.arguments = ojson::parse(arguments.get<std::string>(), nullptr, false);
        if (call.arguments.is_discarded())
            bad(fmt::format("{}.function.arguments is not valid JSON: {}", where, arguments.get<std::string>()));
    } else if (arguments.is_object()) {
        call.arguments = arguments;
    } else {
        bad(fmt::format("{}.function.arguments must be a JSON string or an object", where));
    }
    return call;
}

ChatMessage read_message(const ojson& m, size_t index) {
    const std::string where = fmt::format("messages[{}]", index);
    if (!m.is_object()) bad(fmt::format("{} must be an object", where));
    if (!m.contains("role") || !m["role"].is_string()) bad(fmt::format("{}.role must be a string", where));
    ChatMessage out;
    out.role = m["role"].get<std::string>();
    if (out.role == "developer") out.role = "system";  // OpenAI's newer name for the system role
    if (out.role != "system" && out.role != "user" && out.role != "assistant" && out.role != "tool")
        bad(fmt::format("{}.role is '{}'; the roles are system (or developer), user, assistant and tool", where, out.role));
    read_content(m, where, out.role == "assistant", out);
    if (out.role == "assistant") {
        for (const char* key : {"reasoning_content", "reasoning"}) {
            if (!m.contains(key) || m[key].is_null() || out.reasoning_content) continue;
            if (!m[key].is_string()) bad(fmt::format("{}.{} must be a string", where, key));
            out.reasoning_content = m[key].get<std::string>();
        }
        if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
            if (!m["tool_calls"].is_array()) bad(fmt::format("{}.tool_calls must be an array", where));
            for (size_t i = 0; i < m["tool_calls"].size(); ++i)
                out.tool_calls.push_back(read_tool_call(m["tool_calls"][i], fmt::format("{}.tool_calls[{}]", where, i)));
        }
    } else if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
        bad(fmt::format("{}.tool_calls is only allowed on assistant messages", where));
    }
    if (out.role == "tool" && m.contains("tool_call_id") && !m["tool_call_id"].is_null()) {
        if (!m["tool_call_id"].is_string()) bad(fmt::format("{}.tool_call_id must be a string", where));
        out.tool_call_id = m["tool_call_id"].get<std::string>();
    }
    return out;
}

ojson read_tool(const ojson& t, size_t index) {
    const std::string where = fmt::format("tools[{}]", index);
    if (!t.is_object()) bad(fmt::format("{} must be an object", where));
    if (!t.contains("type") || t["type"] != "function") bad(fmt::format("{}.type must be \"function\"", where));
    if (!t.contains("function") || !t["function"].is_object()) bad(fmt::format("{}.function must be an object", where));
    const ojson& f = t["function"];
    if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty())
        bad(fmt::format("{}.function.name must be a non-empty string", where));
    if (f.contains("parameters") && !f["parameters"].is_null() && !f["parameters"].is_object())
        bad(fmt::format("{}.function.parameters must be a JSON-schema object", where));
    if (f.contains("description") && !f["description"].is_null() && !f["description"].is_string())
        bad(fmt::format("{}.function.description must be a string", where));
    return t;
}

void read_chat_fields(const std::string& body, ParsedChat& parsed) {
    ChatRequest& r = parsed.request;
    const json j = json::parse(body, nullptr, false);
    if (j.is_discarded()) bad("the request body is not valid JSON");
    if (!j.is_object()) bad("the request body must be a JSON object");
    // Shared sampling fields; max_tokens 0 means "not given" here.
    r.sampling.max_tokens = 0;
    std::string error;
    if (!parse_common_request_fields(j, r.sampling, error, /*chat=*/true)) bad(error);

    // Messages and tools keep their keys' order: templates write tools as JSON text.
    const ojson o = ojson::parse(body);
    if (!o.contains("messages") || !o["messages"].is_array() || o["messages"].empty())
        bad("'messages' is required: a non-empty array of messages");
    for (size_t i = 0; i < o["messages"].size(); ++i) r.conversation.messages.push_back(read_message(o["messages"][i], i));

    if (o.contains("functions") || o.contains("function_call"))
        bad("'functions' and 'function_call' are the deprecated form of 'tools' and 'tool_choice'; use those");
    if (o.contains("tools") && !o["tools"].is_null()) {
        if (!o["tools"].is_array()) bad("'tools' must be an array");
        for (size_t i = 0; i < o["tools"].size(); ++i) r.conversation.tools.push_back(read_tool(o["tools"][i], i));
    }
    std::string tool_choice = "auto";
    if (o.contains("tool_choice") && !o["tool_choice"].is_null()) {
        const ojson& choice = o["tool_choice"];
        if (choice.is_object())
            bad("'tool_choice' naming a function is not supported (only \"auto\" and \"none\"); send the tools "
                "with tool_choice \"auto\"");
        if (!choice.is_string()) bad("'tool_choice' must be \"auto\" or \"none\"");
        tool_choice = choice.get<std::string>();
        if (tool_choice == "required")
            bad("'tool_choice': \"required\" is not supported (only \"auto\" and \"none\"): this server does not "
                "constrain decoding to a tool call");
        if (tool_choice != "auto" && tool_choice != "none")
            bad(fmt::format("'tool_choice' must be \"auto\" or \"none\", got \"{}\"", tool_choice));
    }
    // vLLM (and OpenAI) leave the tools out of the prompt when tool_choice is "none".
    if (tool_choice == "none") r.conversation.tools.clear();
    r.tools_enabled = !r.conversation.tools.empty();
    if (o.contains("parallel_tool_calls") && !o["parallel_tool_calls"].is_null()) {
        if (!o["parallel_tool_calls"].is_boolean()) bad("'parallel_tool_calls' must be a boolean");
        r.parallel_tool_calls = o["parallel_tool_calls"].get<bool>();
    }

    if (o.contains("chat_template_kwargs") && !o["chat_template_kwargs"].is_null()) {
        const ojson& kwargs = o["chat_template_kwargs"];
        if (!kwargs.is_object()) bad("'chat_template_kwargs' must be an object");
        if (kwargs.contains("enable_thinking") && !kwargs["enable_thinking"].is_null()) {
            if (!kwargs["enable_thinking"].is_boolean()) bad("'chat_template_kwargs.enable_thinking' must be a boolean");
            r.conversation.enable_thinking = kwargs["enable_thinking"].get<bool>();
        }
    }
    if (o.contains("thinking") && !o["thinking"].is_null()) {  // MiMo's API: {"type": "enabled" | "disabled"}
        const ojson& thinking = o["thinking"];
        if (!thinking.is_object() || !thinking.contains("type") ||
            (thinking["type"] != "enabled" && thinking["type"] != "disabled"))
            bad("'thinking' must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}");
        r.conversation.enable_thinking = thinking["type"] == "enabled";
    }
    if (o.contains("add_generation_prompt") && !o["add_generation_prompt"].is_null()) {
        if (!o["add_generation_prompt"].is_boolean()) bad("'add_generation_prompt' must be a boolean");
        r.conversation.add_generation_prompt = o["add_generation_prompt"].get<bool>();
    }
    if (o.value("continue_final_message", false) == true) bad("'continue_final_message' is not supported");
    if (o.contains("response_format") && !o["response_format"].is_null()) {
        const ojson& format = o["response_format"];
        if (!format.is_object() || format.value("type", "") != "text")
            bad("'response_format' other than {\"type\": \"text\"} is not supported (no constrained decoding)");
    }
}

}  // namespace

ParsedChat parse_chat_request(const std::string& body) {
    ParsedChat parsed;
    try {
        read_chat_fields(body, parsed);
    } catch (const BadRequest& e) {
        parsed.error = e.what();
    } catch (const nlohmann::json::exception& e) {  // a field of an unexpected type the checks missed
        parsed.error = fmt::format("malformed request: {}", e.what());
    }
    return parsed;
}

std::string chat_finish_reason(const std::string& engine_reason, int tool_calls) {
    return tool_calls > 0 && engine_reason == "stop" ? "tool_calls" : engine_reason;
}

namespace {
json tool_calls_json(const std::vector<ParsedToolCall>& calls, const std::vector<std::string>& ids) {
    json list = json::array();
    for (size_t i = 0; i < calls.size(); ++i)
        list.push_back({{"id", ids.at(i)},
                        {"type", "function"},
                        {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}});
    return list;
}
json optional_text(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }
}  // namespace

json chat_completion_body(const std::string& id, int64_t created, const std::string& model, int64_t prompt_tokens,
                          const std::vector<ChatChoiceResult>& choices) {
    json list = json::array();
    int64_t completion_tokens = 0;
    for (size_t i = 0; i < choices.size(); ++i) {
        const ChatChoiceResult& c = choices[i];
        completion_tokens += c.completion_tokens;
        json message = {{"role", "assistant"},
                        {"content", optional_text(c.message.content)},
                        {"reasoning_content", optional_text(c.message.reasoning)},
                        {"reasoning", optional_text(c.message.reasoning)}};
        if (!c.message.tool_calls.empty()) message["tool_calls"] = tool_calls_json(c.message.tool_calls, c.tool_call_ids);
        list.push_back({{"index", i}, {"message", message}, {"logprobs", nullptr}, {"finish_reason", c.finish_reason}});
    }
    return {{"id", id},
            {"object", "chat.completion"},
            {"created", created},
            {"model", model},
            {"choices", list},
            {"usage",
             {{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}}}};
}

json chat_chunk(const std::string& id, int64_t created, const std::string& model, int index, const json& delta,
                const std::string& finish_reason) {
    json choice = {{"index", index},
                   {"delta", delta},
                   {"logprobs", nullptr},
                   {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
    return {{"id", id},       {"object", "chat.completion.chunk"}, {"created", created},
            {"model", model}, {"choices", json::array({choice})}};
}

std::vector<json> chat_deltas(const ChatOutputDelta& step, int first_call_index, const std::vector<std::string>& call_ids) {
    std::vector<json> deltas;
    if (!step.reasoning.empty()) deltas.push_back({{"reasoning_content", step.reasoning}, {"reasoning", step.reasoning}});
    if (!step.content.empty()) deltas.push_back({{"content", step.content}});
    for (size_t i = 0; i < step.tool_calls.size(); ++i) {
        const int index = first_call_index + int(i);
        const ParsedToolCall& call = step.tool_calls[i];
        deltas.push_back({{"tool_calls", json::array({{{"index", index},
                                                        {"id", call_ids.at(size_t(index))},
                                                        {"type", "function"},
                                                        {"function", {{"name", call.name}, {"arguments", ""}}}}})}});
        deltas.push_back(
            {{"tool_calls", json::array({{{"index", index}, {"function", {{"arguments", call.arguments}}}}})}});
    }
    return deltas;
}

json chat_usage_chunk(const std::string& id, int64_t created, const std::string& model, int64_t prompt_tokens,
                      int64_t completion_tokens) {
    return {{"id", id},
            {"object", "chat.completion.chunk"},
            {"created", created},
            {"model", model},
            {"choices", json::array()},
            {"usage",
             {{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}}}};
}

}  // namespace xinfer
