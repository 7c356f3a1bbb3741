#include "server/tool_call_parser.h"

#include "server/text_markers.h"
#include "tokenizer/python_json.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>

namespace xinfer {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kCallStart = "<tool_call>";
constexpr std::string_view kCallEnd = "</tool_call>";
constexpr std::string_view kWhitespace = " \t\n\r\f\v";

std::string_view trim(std::string_view s) {
    const size_t b = s.find_first_not_of(kWhitespace);
    if (b == std::string_view::npos) return {};
    return s.substr(b, s.find_last_not_of(kWhitespace) - b + 1);
}

std::string lower(std::string_view s) {
    std::string out(s);
    for (char& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
    return out;
}

// {"name": ..., "arguments": {...}} (some models write "parameters"); arguments given as a JSON
// string are accepted when that string is a JSON object.
bool parse_hermes(std::string_view body, ParsedToolCall& call) {
    const ojson j = ojson::parse(trim(body), nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
    call.name = j["name"].get<std::string>();
    if (call.name.empty()) return false;
    const char* key = j.contains("arguments") ? "arguments" : j.contains("parameters") ? "parameters" : nullptr;
    if (!key || j[key].is_null()) {
        call.arguments = "{}";
        return true;
    }
    ojson arguments = j[key];
    if (arguments.is_string()) arguments = ojson::parse(arguments.get<std::string>(), nullptr, false);
    if (!arguments.is_object()) return false;
    call.arguments = python_json_dumps(arguments);
    return true;
}

// The JSON-schema type the request declares for `param` of tool `name`; empty when undeclared.
std::string declared_type(const std::vector<ojson>& tools, const std::string& name, const std::string& param) {
    for (const ojson& tool : tools) {
        const ojson& function = tool.contains("function") ? tool["function"] : tool;
        if (!function.is_object() || function.value("name", "") != name) continue;
        const ojson parameters = function.value("parameters", ojson::object());
        if (!parameters.is_object() || !parameters.contains("properties") || !parameters["properties"].is_object() ||
            !parameters["properties"].contains(param))
            return "";
        const ojson& schema = parameters["properties"][param];
        if (!schema.is_object() || !schema.contains("type")) return "";
        const ojson& type = schema["type"];
        if (type.is_string()) return lower(type.get<std::string>());
        if (type.is_array())  // ["integer", "null"]: the first type that is not null
            for (const ojson& t : type)
                if (t.is_string() && t != "null") return lower(t.get<std::string>());
        return "";
    }
    return "";
}

// A parameter's raw text as the JSON value its declared type calls for; text when it does not
// read as that type (the model's words are kept rather than dropped).
ojson convert_parameter(const std::string& value, const std::string& type) {
    if (type.empty() || type == "string" || type == "str" || type == "text" || type == "varchar" || type == "char" ||
        type == "enum")
        return value;
    const std::string_view v = trim(value);
    if (lower(v) == "null") return nullptr;
    if (type == "integer" || type == "int") {
        int64_t i = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), i);
        if (ec == std::errc() && end == v.data() + v.size() && !v.empty()) return i;
        return value;
    }
    if (type == "number" || type == "float" || type == "double") {
        const std::string text(v);
        char* end = nullptr;
        const double d = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size()) return value;
        if (text.find_first_of(".eE") == std::string::npos) {
            int64_t i = 0;
            const auto [iend, ec] = std::from_chars(text.data(), text.data() + text.size(), i);
            if (ec == std::errc() && iend == text.data() + text.size()) return i;
        }
        return d;
    }
    if (type == "boolean" || type == "bool") {
        const std::string b = lower(v);
        if (b == "true") return true;
        if (b == "false") return false;
        return value;
    }
    if (type == "object" || type == "array" || type == "dict" || type == "list") {
        ojson parsed = ojson::parse(v, nullptr, false);
        if (!parsed.is_discarded()) return parsed;
        return value;
    }
    return value;  // a type we do not know: keep the text
}

// <function=NAME> then <parameter=KEY>value</parameter>… then </function>, with only whitespace
// between the pieces. A value missing its </parameter> ends at the next <parameter= or
// </function> (as SGLang and vLLM accept).
bool parse_mimo_xml(std::string_view body, const std::vector<ojson>& tools, ParsedToolCall& call) {
    constexpr std::string_view kFunction = "<function=", kFunctionEnd = "</function>";
    constexpr std::string_view kParameter = "<parameter=", kParameterEnd = "</parameter>";
    std::string_view rest = trim(body);
    if (rest.substr(0, kFunction.size()) != kFunction) return false;
    rest.remove_prefix(kFunction.size());
    const size_t name_end = rest.find('>');
    if (name_end == std::string_view::npos) return false;
    call.name = std::string(trim(rest.substr(0, name_end)));
    if (call.name.empty() || call.name.find_first_of("<\n") != std::string::npos) return false;
    rest.remove_prefix(name_end + 1);
    ojson arguments = ojson::object();
    for (;;) {
        rest = rest.substr(std::min(rest.size(), rest.find_first_not_of(kWhitespace)));
        if (rest.substr(0, kFunctionEnd.size()) == kFunctionEnd) {
            rest.remove_prefix(kFunctionEnd.size());
            if (!trim(rest).empty()) return false;  // text after the function: not a call we understand
            call.arguments = python_json_dumps(arguments);
            return true;
        }
        if (rest.substr(0, kParameter.size()) != kParameter) return false;
        rest.remove_prefix(kParameter.size());
        const size_t key_end = rest.find('>');
        if (key_end == std::string_view::npos) return false;
        const std::string key(trim(rest.substr(0, key_end)));
        if (key.empty() || key.find_first_of("<\n") != std::string::npos) return false;
        rest.remove_prefix(key_end + 1);
        size_t value_end = rest.find(kParameterEnd);
        const size_t next = std::min(rest.find(kParameter), rest.find(kFunctionEnd));
        size_t skip = kParameterEnd.size();
        if (value_end == std::string_view::npos || next < value_end) {
            if (next == std::string_view::npos) return false;
            value_end = next;
            skip = 0;
        }
        std::string value(rest.substr(0, value_end));
        if (!value.empty() && value.front() == '\n') value.erase(0, 1);
        if (!value.empty() && value.back() == '\n') value.pop_back();
        arguments[key] = convert_parameter(value, declared_type(tools, call.name, key));
        rest.remove_prefix(value_end + skip);
    }
}

}  // namespace

bool parse_tool_call_body(ToolCallFormat format, std::string_view body, const std::vector<ojson>& tools,
                          ParsedToolCall& call) {
    call = {};
    const bool ok = format == ToolCallFormat::hermes ? parse_hermes(body, call) : parse_mimo_xml(body, tools, call);
    if (!ok) call = {};
    return ok;
}

ToolCallSplit ToolCallParser::feed(std::string_view text) {
    ToolCallSplit out;
    pending_ += text;
    for (;;) {
        if (!inside_call_) {
            const size_t start = pending_.find(kCallStart);
            if (start == std::string::npos) {
                const size_t keep = marker_prefix_suffix(pending_, kCallStart);
                out.content += pending_.substr(0, pending_.size() - keep);
                pending_.erase(0, pending_.size() - keep);
                return out;
            }
            out.content += pending_.substr(0, start);
            pending_.erase(0, start + kCallStart.size());
            inside_call_ = true;
        }
        const size_t end = pending_.find(kCallEnd);
        if (end == std::string::npos) return out;  // the call is not whole yet
        ParsedToolCall call;
        const std::string_view body(pending_.data(), end);
        if (parse_tool_call_body(format_, body, tools_, call)) out.calls.push_back(std::move(call));
        else out.content += std::string(kCallStart) + std::string(body) + std::string(kCallEnd);
        pending_.erase(0, end + kCallEnd.size());
        inside_call_ = false;
    }
}

ToolCallSplit ToolCallParser::finish() {
    ToolCallSplit out;
    if (inside_call_) {
        ParsedToolCall call;
        if (parse_tool_call_body(format_, pending_, tools_, call)) out.calls.push_back(std::move(call));
        else out.content = std::string(kCallStart) + pending_;
    } else {
        out.content = pending_;
    }
    pending_.clear();
    inside_call_ = false;
    return out;
}

}  // namespace xinfer
