#include "server/openai_protocol.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace xinfer {
namespace {

using json = nlohmann::json;

// A token array: every element an integer that fits int32 (range against the vocabulary is the
// engine's check, whose message names the vocabulary size).
bool token_array(const json& value, std::vector<int32_t>& out, std::string& error, const std::string& what) {
    if (!value.is_array()) {
        error = fmt::format("{} must be an array of token ids", what);
        return false;
    }
    out.clear();
    for (size_t i = 0; i < value.size(); ++i) {
        const json& t = value[i];
        if (!t.is_number_integer() || t.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
            t.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
            error = fmt::format("{}[{}] is {}, not a token id (an integer)", what, i, t.dump());
            return false;
        }
        out.push_back(t.get<int32_t>());
    }
    return true;
}

json usage_of(const std::vector<ChoiceResult>& choices) {
    int64_t prompt = 0, completion = 0;
    for (const ChoiceResult& c : choices) {
        prompt += c.prompt_tokens;
        completion += int64_t(c.token_ids.size());
    }
    return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

}  // namespace

static ParsedCompletion parse_request_fields(const std::string& body);

ParsedCompletion parse_completion_request(const std::string& body) {
    try {
        return parse_request_fields(body);
    } catch (const nlohmann::json::exception& e) {  // a field of an unexpected type the checks below missed
        ParsedCompletion parsed;
        parsed.error = fmt::format("malformed request: {}", e.what());
        return parsed;
    }
}

static ParsedCompletion parse_request_fields(const std::string& body) {
    ParsedCompletion parsed;
    CompletionRequest& r = parsed.request;
    std::string& error = parsed.error;
    const json j = json::parse(body, nullptr, false);
    if (j.is_discarded()) {
        error = "the request body is not valid JSON";
        return parsed;
    }
    if (!j.is_object()) {
        error = "the request body must be a JSON object";
        return parsed;
    }

    if (!j.contains("prompt")) {
        error = "'prompt' is required";
        return parsed;
    }
    const json& prompt = j["prompt"];
    if (prompt.is_string()) {
        r.text_prompts.push_back(prompt.get<std::string>());
    } else if (!prompt.is_array() || prompt.empty()) {
        error = "'prompt' must be a string or a non-empty array (of strings, of token ids, or of token-id arrays)";
        return parsed;
    } else if (prompt[0].is_string()) {
        for (size_t i = 0; i < prompt.size(); ++i) {
            if (!prompt[i].is_string()) {
                error = fmt::format("prompt[{}] must be a string, as prompt[0] is", i);
                return parsed;
            }
            r.text_prompts.push_back(prompt[i].get<std::string>());
        }
    } else if (prompt[0].is_array()) {
        for (size_t i = 0; i < prompt.size(); ++i) {
            std::vector<int32_t> ids;
            if (!token_array(prompt[i], ids, error, fmt::format("prompt[{}]", i))) return parsed;
            if (ids.empty()) {
                error = fmt::format("prompt[{}] is empty", i);
                return parsed;
            }
            r.prompts.push_back(std::move(ids));
        }
    } else {
        std::vector<int32_t> ids;
        if (!token_array(prompt, ids, error, "prompt")) return parsed;
        r.prompts.push_back(std::move(ids));
    }

    parse_common_request_fields(j, r, error, /*chat=*/false);
    return parsed;
}

bool parse_common_request_fields(const json& j, CompletionRequest& r, std::string& error, bool chat) {
    // Typed getters: a field of the wrong type is a 400 naming it.
    const auto number = [&](const char* key, double lo, double hi, double& out) {
        if (!j.contains(key) || j[key].is_null()) return true;
        if (!j[key].is_number()) {
            error = fmt::format("'{}' must be a number, got {}", key, j[key].dump());
            return false;
        }
        out = j[key].get<double>();
        if (!(out >= lo && out <= hi)) {
            error = fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, j[key].dump());
            return false;
        }
        return true;
    };
    const auto integer = [&](const char* key, int64_t lo, int64_t hi, int64_t& out) {
        if (!j.contains(key) || j[key].is_null()) return true;
        if (!j[key].is_number_integer()) {
            error = fmt::format("'{}' must be an integer, got {}", key, j[key].dump());
            return false;
        }
        out = j[key].get<int64_t>();
        if (out < lo || out > hi) {
            error = fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, out);
            return false;
        }
        return true;
    };

    if (j.contains("model") && !j["model"].is_null()) {
        if (!j["model"].is_string()) {
            error = "'model' must be a string";
            return false;
        }
        r.model = j["model"].get<std::string>();
    }

    int64_t max_tokens = r.max_tokens, top_k = 0, seed = 0, n = 1;
    double temperature = 1.0, top_p = 1.0, presence = 0.0, frequency = 0.0;  // OpenAI's defaults
    // Chat: 'max_completion_tokens' is OpenAI's newer name for 'max_tokens' (which wins if both).
    if (chat && !integer("max_completion_tokens", 1, std::numeric_limits<int32_t>::max(), max_tokens)) return false;
    if (!integer("max_tokens", 1, std::numeric_limits<int32_t>::max(), max_tokens) ||
        !number("temperature", 0.0, 100.0, temperature) || !number("top_p", 0.0, 1.0, top_p) ||
        !integer("top_k", -1, std::numeric_limits<int32_t>::max(), top_k) ||
        !integer("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), seed) ||
        !integer("n", 1, 128, n) || !number("presence_penalty", -2.0, 2.0, presence) ||
        !number("frequency_penalty", -2.0, 2.0, frequency))
        return false;
    if (top_p <= 0.0) {
        error = "'top_p' must be > 0";
        return false;
    }
    r.max_tokens = int(max_tokens);
    r.n = int(n);
    r.sampling.temperature = float(temperature);
    r.sampling.top_p = float(top_p);
    r.sampling.top_k = top_k < 0 ? 0 : int(top_k);  // vLLM: -1 = no limit
    r.sampling.seed = uint64_t(seed);
    r.seeded = j.contains("seed") && !j["seed"].is_null();

    // Requested features that are not there are refused, never silently dropped.
    if (presence != 0.0 || frequency != 0.0) error = "presence and frequency penalties are not supported";
    else if (j.contains("best_of") && !j["best_of"].is_null() && j["best_of"] != 1) error = "'best_of' is not supported";
    // Chat's logprobs is a boolean (false asks for nothing); completions' an integer.
    else if (j.contains("logprobs") && !j["logprobs"].is_null() && !(chat && j["logprobs"] == false))
        error = "'logprobs' is not supported";
    else if (chat && j.contains("top_logprobs") && !j["top_logprobs"].is_null()) error = "'top_logprobs' is not supported";
    else if (j.value("echo", false) == true) error = "'echo' is not supported";
    else if (j.contains("suffix") && !j["suffix"].is_null()) error = "'suffix' is not supported";
    else if (j.contains("logit_bias") && !j["logit_bias"].is_null() && !j["logit_bias"].empty())
        error = "'logit_bias' is not supported";
    if (!error.empty()) return false;

    // 'stop': a string or an array of strings (whether the model can use them is the engine's
    // call: it needs a tokenizer.json).
    if (j.contains("stop") && !j["stop"].is_null()) {
        const json& stop = j["stop"];
        const bool ok = stop.is_string() || (stop.is_array() && std::all_of(stop.begin(), stop.end(), [](const json& s) {
                                                 return s.is_string();
                                             }));
        if (!ok) {
            error = "'stop' must be a string or an array of strings";
            return false;
        }
        if (stop.is_string()) r.sampling.stop = {stop.get<std::string>()};
        else r.sampling.stop = stop.get<std::vector<std::string>>();
        for (const std::string& s : r.sampling.stop)
            if (s.empty()) {
                error = "'stop' strings must not be empty";
                return false;
            }
    }

    if (j.contains("stop_token_ids") && !j["stop_token_ids"].is_null() &&
        !token_array(j["stop_token_ids"], r.stop_token_ids, error, "stop_token_ids"))
        return false;
    if (j.contains("stream") && !j["stream"].is_null()) {
        if (!j["stream"].is_boolean()) {
            error = "'stream' must be a boolean";
            return false;
        }
        r.stream = j["stream"].get<bool>();
    }
    if (j.contains("stream_options") && !j["stream_options"].is_null()) {
        const json& so = j["stream_options"];
        if (!so.is_object() || (so.contains("include_usage") && !so["include_usage"].is_boolean())) {
            error = "'stream_options' must be an object with a boolean 'include_usage'";
            return false;
        }
        if (!r.stream) {
            error = "'stream_options' is only allowed with 'stream': true";
            return false;
        }
        r.include_usage = so.value("include_usage", false);
    }
    return true;
}

json error_body(const std::string& message, const std::string& type, int code) {
    return {{"error", {{"message", message}, {"type", type}, {"param", nullptr}, {"code", code}}}};
}

json completion_body(const std::string& id, int64_t created, const std::string& model,
                     const std::vector<ChoiceResult>& choices) {
    json list = json::array();
    for (size_t i = 0; i < choices.size(); ++i)
        list.push_back({{"index", i},
                        {"text", choices[i].text},
                        {"token_ids", choices[i].token_ids},
                        {"logprobs", nullptr},
                        {"finish_reason", choices[i].finish_reason}});
    return {{"id", id},         {"object", "text_completion"}, {"created", created},
            {"model", model},   {"choices", list},             {"usage", usage_of(choices)}};
}

json completion_chunk(const std::string& id, int64_t created, const std::string& model, int index,
                      const std::vector<int32_t>& token_ids, const std::string& finish_reason,
                      const std::string& text) {
    json choice = {{"index", index},
                   {"text", text},
                   {"token_ids", token_ids},
                   {"logprobs", nullptr},
                   {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
    return {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model},
            {"choices", json::array({choice})}};
}

json usage_chunk(const std::string& id, int64_t created, const std::string& model,
                 const std::vector<ChoiceResult>& choices) {
    return {{"id", id},       {"object", "text_completion"}, {"created", created},
            {"model", model}, {"choices", json::array()},    {"usage", usage_of(choices)}};
}

}  // namespace xinfer
