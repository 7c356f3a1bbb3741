#include "tokenizer/chat_template.h"

#include "tokenizer/python_json.h"

#include <fmt/format.h>

#include <stdexcept>

namespace xinfer {
namespace {

using ojson = nlohmann::ordered_json;

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
bool ends_with(const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Python's str.lstrip / rstrip / strip with an explicit character set.
std::string lstrip(const std::string& s, const char* chars) {
    const size_t at = s.find_first_not_of(chars);
    return at == std::string::npos ? std::string() : s.substr(at);
}
std::string rstrip(const std::string& s, const char* chars) {
    const size_t at = s.find_last_not_of(chars);
    return at == std::string::npos ? std::string() : s.substr(0, at + 1);
}
std::string strip(const std::string& s, const char* chars) { return lstrip(rstrip(s, chars), chars); }
// Jinja's `trim`: Python's str.strip() (ASCII whitespace here).
std::string trim(const std::string& s) { return strip(s, " \t\n\r\f\v"); }

// s.split(sep)[0] and s.split(sep)[-1].
std::string before_first(const std::string& s, const std::string& sep) {
    const size_t at = s.find(sep);
    return at == std::string::npos ? s : s.substr(0, at);
}
std::string after_last(const std::string& s, const std::string& sep) {
    const size_t at = s.rfind(sep);
    return at == std::string::npos ? s : s.substr(at + sep.size());
}

// ---------------------------------------------------------------------------------------------
// Qwen3 (ChatML, JSON tools). Each block below follows the official template's statements in order.
class Qwen3Template final : public ChatTemplate {
public:
    const char* name() const override { return "qwen3"; }
    const char* tool_call_format() const override { return "hermes"; }
    bool thinking_enabled(const ChatTemplateInput& input) const override { return input.enable_thinking.value_or(true); }

    std::string render(const ChatTemplateInput& input) const override {
        const std::vector<ChatMessage>& messages = input.messages;
        if (messages.empty()) throw std::invalid_argument("'messages' must not be empty");
        // vLLM hands this template string content: parts joined with "\n", null content as "".
        const auto content_of = [](const ChatMessage& m) { return m.text_content(); };
        std::string out;
        const bool first_is_system = messages[0].role == "system";
        if (!input.tools.empty()) {
            out += "<|im_start|>system\n";
            if (first_is_system) out += content_of(messages[0]) + "\n\n";
            out += "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                   "with function signatures within <tools></tools> XML tags:\n<tools>";
            for (const ojson& tool : input.tools) {
                out += '\n';
                out += python_json_dumps(tool);
            }
            out += "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                   "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                   "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";
        } else if (first_is_system) {
            out += "<|im_start|>system\n" + content_of(messages[0]) + "<|im_end|>\n";
        }

        // The last real user query: later assistant turns keep their reasoning. A "user" turn
        // that only wraps a tool response does not count.
        int64_t last_query_index = int64_t(messages.size()) - 1;
        for (int64_t i = int64_t(messages.size()) - 1; i >= 0; --i) {
            const ChatMessage& m = messages[size_t(i)];
            if (m.role != "user") continue;
            const std::string content = content_of(m);
            if (!(starts_with(content, "<tool_response>") && ends_with(content, "</tool_response>"))) {
                last_query_index = i;
                break;
            }
        }

        for (size_t i = 0; i < messages.size(); ++i) {
            const ChatMessage& m = messages[i];
            std::string content = content_of(m);
            const bool last = i + 1 == messages.size();
            if (m.role == "user" || (m.role == "system" && i != 0)) {
                out += "<|im_start|>" + m.role + "\n" + content + "<|im_end|>\n";
            } else if (m.role == "assistant") {
                std::string reasoning;
                if (m.reasoning_content) {
                    reasoning = *m.reasoning_content;
                } else if (contains(content, "</think>")) {
                    reasoning = lstrip(after_last(rstrip(before_first(content, "</think>"), "\n"), "<think>"), "\n");
                    content = lstrip(after_last(content, "</think>"), "\n");
                }
                if (int64_t(i) > last_query_index && (last || !reasoning.empty()))
                    out += "<|im_start|>assistant\n<think>\n" + strip(reasoning, "\n") + "\n</think>\n\n" +
                           lstrip(content, "\n");
                else
                    out += "<|im_start|>assistant\n" + content;
                for (size_t c = 0; c < m.tool_calls.size(); ++c) {
                    const ChatToolCall& call = m.tool_calls[c];
                    if ((c == 0 && !content.empty()) || c > 0) out += "\n";
                    out += "<tool_call>\n{\"name\": \"" + call.name + "\", \"arguments\": ";
                    out += call.arguments.is_string() ? call.arguments.get<std::string>() : python_json_dumps(call.arguments);
                    out += "}\n</tool_call>";
                }
                out += "<|im_end|>\n";
            } else if (m.role == "tool") {
                if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
                out += "\n<tool_response>\n" + content + "\n</tool_response>";
                if (last || messages[i + 1].role != "tool") out += "<|im_end|>\n";
            }
            // The first system message was rendered above; the template renders no other role.
        }
        if (input.add_generation_prompt) {
            out += "<|im_start|>assistant\n";
            if (input.enable_thinking == false) out += "<think>\n\n</think>\n\n";
        }
        return out;
    }
};

// ---------------------------------------------------------------------------------------------
// MiMo-V2 (ChatML without newlines between turns, XML tools). See the header for what is verified.

// The template's render_extra_keys: every key of `fields` not in `handled`, as <key>value</key>.
void render_extra_keys(std::string& out, const ojson& fields, std::initializer_list<const char*> handled) {
    if (!fields.is_object()) return;
    for (auto it = fields.begin(); it != fields.end(); ++it) {
        bool skip = false;
        for (const char* h : handled) skip = skip || it.key() == h;
        if (skip) continue;
        const ojson& v = it.value();
        out += "\n<" + it.key() + ">" + (v.is_object() || v.is_array() ? python_json_dumps(v) : python_str(v)) + "</" +
               it.key() + ">";
    }
}

class MiMoTemplate final : public ChatTemplate {
public:
    const char* name() const override { return "mimo"; }
    const char* tool_call_format() const override { return "mimo_xml"; }
    bool thinking_enabled(const ChatTemplateInput& input) const override { return input.enable_thinking.value_or(true); }

    std::string render(const ChatTemplateInput& input) const override {
        if (input.messages.empty()) throw std::invalid_argument("'messages' must not be empty");
        // render_content: text parts concatenated as they are (this template takes the OpenAI
        // content array itself, so vLLM does not join the parts with newlines).
        const auto content_of = [](const ChatMessage& m) {
            std::string s;
            for (const std::string& p : m.parts) s += p;
            return s;
        };
        std::vector<const ChatMessage*> loop;
        std::string out = "<|im_start|>system\n";
        size_t first = 0;
        if (input.messages[0].role == "system") {
            out += content_of(input.messages[0]);
            first = 1;
        } else {
            out += "You are MiMo, a helpful AI assistant engineered by Xiaomi.";
        }
        for (size_t i = first; i < input.messages.size(); ++i) loop.push_back(&input.messages[i]);
        // The template also finds the last user turn, to drop older reasoning; but its
        // keep_all_reasoning defaults to true (not settable through the API), so every turn keeps it.

        if (!input.tools.empty()) {
            out += "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou have access "
                   "to the following functions:\n\n<tools>";
            for (const ojson& entry : input.tools) {
                const ojson& tool = entry.contains("function") ? entry["function"] : entry;
                out += "\n<function>\n<name>" + python_str(tool.value("name", ojson())) + "</name>";
                if (tool.contains("description")) out += "\n<description>" + trim(python_str(tool["description"])) + "</description>";
                out += "\n<parameters>";
                const ojson parameters = tool.value("parameters", ojson());
                if (parameters.is_object() && parameters.contains("properties") && parameters["properties"].is_object()) {
                    for (auto p = parameters["properties"].begin(); p != parameters["properties"].end(); ++p) {
                        const ojson& fields = p.value();
                        out += "\n<parameter>\n<name>" + p.key() + "</name>";
                        if (fields.is_object() && fields.contains("type")) out += "\n<type>" + python_str(fields["type"]) + "</type>";
                        if (fields.is_object() && fields.contains("description"))
                            out += "\n<description>" + trim(python_str(fields["description"])) + "</description>";
                        render_extra_keys(out, fields, {"name", "type", "description"});
                        out += "\n</parameter>";
                    }
                }
                render_extra_keys(out, parameters, {"type", "properties"});
                out += "\n</parameters>";
                render_extra_keys(out, tool, {"type", "name", "description", "parameters"});
                out += "\n</function>";
            }
            out += "\n</tools>";
            out += "\n\nFor each function call, output the function name and arguments in the following format:\n"
                   "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>value_1</parameter>\n"
                   "<parameter=example_parameter_2>This is the value for the second parameter\nthat can span\nmultiple "
                   "lines</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n- Function calls MUST follow the "
                   "specified format: an inner <function=...></function> block must be nested within "
                   "<tool_call></tool_call> XML tags\n- DO NOT use function calls inside <think></think> tags.\n- The "
                   "value enclosed between parameter tags is preserved exactly as-is, including newlines and "
                   "spaces.\n</IMPORTANT>";
        }
        out += "<|im_end|>";

        for (size_t i = 0; i < loop.size(); ++i) {
            const ChatMessage& m = *loop[i];
            std::string content = content_of(m);
            if (m.role == "assistant") {
                std::string reasoning;
                if (m.reasoning_content) {
                    reasoning = *m.reasoning_content;
                } else if (contains(content, "</think>")) {
                    reasoning = after_last(before_first(content, "</think>"), "<think>");
                    content = after_last(content, "</think>");
                }
                // keep_all_reasoning defaults to true: every past turn keeps its reasoning.
                if (!reasoning.empty()) out += "<|im_start|>assistant\n<think>" + reasoning + "</think>" + content;
                else out += "<|im_start|>assistant\n<think></think>" + content;
                for (const ChatToolCall& call : m.tool_calls) {
                    out += "<tool_call>\n<function=" + call.name + ">\n";
                    if (!call.arguments.is_object())
                        throw std::invalid_argument(fmt::format(
                            "the mimo chat template needs the arguments of tool call '{}' as a JSON object", call.name));
                    for (auto a = call.arguments.begin(); a != call.arguments.end(); ++a) {
                        const ojson& v = a.value();
                        out += "<parameter=" + a.key() + ">" +
                               (v.is_object() || v.is_array() ? python_json_dumps(v) : python_str(v)) + "</parameter>\n";
                    }
                    out += "</function>\n</tool_call>";
                }
                out += "<|im_end|>";
            } else if (m.role == "tool") {
                // loop.previtem is undefined for the first message: no header then (as the template).
                if (i > 0 && loop[i - 1]->role != "tool") out += "<|im_start|>tool\n";
                out += "<tool_response>\n" + content + "\n</tool_response>\n";
                if (i + 1 == loop.size() || loop[i + 1]->role != "tool") out += "<|im_end|>";
            } else {
                out += "<|im_start|>" + m.role + "\n" + content + "<|im_end|>";
            }
        }
        if (input.add_generation_prompt) {
            out += "<|im_start|>assistant\n";
            if (!thinking_enabled(input)) out += "<think></think>";
        }
        return out;
    }
};

}  // namespace

std::string ChatMessage::text_content() const {
    std::string s;
    for (size_t i = 0; i < parts.size(); ++i) s += (i ? "\n" : "") + parts[i];
    return s;
}

std::unique_ptr<ChatTemplate> make_chat_template(const std::string& name) {
    if (name == "qwen3") return std::make_unique<Qwen3Template>();
    if (name == "mimo") return std::make_unique<MiMoTemplate>();
    return nullptr;
}

std::string builtin_chat_template_for(const std::string& architecture) {
    if (architecture == "Qwen3ForCausalLM" || architecture == "Qwen3MoeForCausalLM") return "qwen3";
    if (architecture == "MiMoV2FlashForCausalLM") return "mimo";
    return "";
}

std::string builtin_chat_template_names() { return "qwen3, mimo"; }

}  // namespace xinfer
