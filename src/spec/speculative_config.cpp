#include "spec/speculative_config.h"

#include "core/status.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace xinfer {
namespace {

int int_field(const std::string& key, const nlohmann::json& value) {
    if (!value.is_number_integer()) fail("--speculative-config: \"{}\" must be an integer, got {}", key, value.dump());
    return value.get<int>();
}

// DFlash's default is block_size - 1 (the drafter's config.json); a missing file is reported
// by the drafter loader with its own message, so here it only leaves the value unresolved.
int dflash_block_size(const std::string& dir) {
    std::ifstream in(std::filesystem::path(dir) / "config.json");
    if (!in) return 0;
    try {
        const nlohmann::json config = nlohmann::json::parse(in);
        return config.value("block_size", 0);
    } catch (const std::exception&) {
        return 0;
    }
}

}  // namespace

SpeculativeConfig parse_speculative_config(const std::string& text) {
    SpeculativeConfig config;
    if (text.empty()) return config;
    nlohmann::json json;
    try {
        json = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
        fail("--speculative-config: not valid JSON ({}): {}", e.what(), text);
    }
    if (!json.is_object()) fail("--speculative-config: expected a JSON object, got {}", json.type_name());
    for (const auto& [key, value] : json.items()) {
        if (key == "method" || key == "model") {
            if (!value.is_string()) fail("--speculative-config: \"{}\" must be a string, got {}", key, value.dump());
            (key == "method" ? config.method : config.model) = value.get<std::string>();
        } else if (key == "num_speculative_tokens") {
            config.num_speculative_tokens = int_field(key, value);
        } else if (key == "prompt_lookup_min") {
            config.prompt_lookup_min = int_field(key, value);
        } else if (key == "prompt_lookup_max") {
            config.prompt_lookup_max = int_field(key, value);
        } else {
            fail("--speculative-config: unknown field \"{}\" (expected method, model, num_speculative_tokens, "
                 "prompt_lookup_min, prompt_lookup_max)",
                 key);
        }
    }
    if (config.method != "mtp" && config.method != "dflash" && config.method != "ngram")
        fail("--speculative-config: unknown method \"{}\" (expected dflash, mtp or ngram)", config.method);
    if (config.method == "dflash" && config.model.empty())
        fail("--speculative-config: method dflash needs \"model\": the drafter's directory");
    if (config.method != "dflash" && !config.model.empty())
        fail("--speculative-config: \"model\" is only for dflash ({} drafts without a separate model)", config.method);
    if (config.num_speculative_tokens == 0) {
        if (config.method == "ngram") config.num_speculative_tokens = 4;
        if (config.method == "mtp") config.num_speculative_tokens = 3;
        if (config.method == "dflash") config.num_speculative_tokens = std::max(0, dflash_block_size(config.model) - 1);
    }
    // The verify chain is the anchor plus the drafts: at most 32 query tokens per sequence.
    if (config.num_speculative_tokens < 1 || config.num_speculative_tokens > 31)
        fail("--speculative-config: num_speculative_tokens must be 1..31, got {}", config.num_speculative_tokens);
    if (config.prompt_lookup_min < 1 || config.prompt_lookup_max < config.prompt_lookup_min)
        fail("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {} and {}",
             config.prompt_lookup_min, config.prompt_lookup_max);
    return config;
}

}  // namespace xinfer
