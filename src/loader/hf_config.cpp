#include "loader/hf_config.h"

#include "core/status.h"

#include <cmath>
#include <limits>

namespace xinfer {

namespace {

// How a JSON value reads in an error message: its JSON text, shortened so that a huge array or
// object does not swamp the message.
std::string describe_value(const nlohmann::json& value) {
    constexpr size_t kMaxChars = 80;
    std::string text = value.dump();
    if (text.size() > kMaxChars) text = text.substr(0, kMaxChars) + "...";
    return text;
}

// Integers must be integral JSON numbers. Hand-edited configs sometimes write "4.0"; that is
// unambiguous and accepted, while 4.5 is an error rather than a silent truncation.
std::optional<int64_t> as_int(const nlohmann::json& value) {
    if (value.is_number_integer() && !value.is_number_unsigned()) return value.get<int64_t>();
    if (value.is_number_unsigned()) {
        const uint64_t v = value.get<uint64_t>();
        if (v > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
        return int64_t(v);
    }
    if (value.is_number_float()) {
        const double v = value.get<double>();
        // 2^63 is exactly representable, so this bound admits no value that overflows int64.
        if (std::isfinite(v) && std::floor(v) == v && std::fabs(v) < 9.223372036854775808e18) return int64_t(v);
    }
    return std::nullopt;
}

}  // namespace

bool ConfigReader::has(const std::string& key) const {
    if (!json_.is_object()) return false;
    const auto it = json_.find(key);
    return it != json_.end() && !it->is_null();
}

const nlohmann::json& ConfigReader::at(const std::string& key) const {
    if (!has(key)) fail("{}: missing required field '{}{}'", path_.string(), prefix_, key);
    return json_.find(key).value();
}

void ConfigReader::type_error(const std::string& key, const char* expected) const {
    const bool present = json_.is_object() && json_.contains(key);
    value_error(prefix_ + key, expected, present ? json_.at(key) : nlohmann::json());
}

void ConfigReader::value_error(const std::string& field, const char* expected, const nlohmann::json& found) const {
    fail("{}: field '{}': expected {}, found {}", path_.string(), field, expected, describe_value(found));
}

int64_t ConfigReader::get_int(const std::string& key) const {
    const std::optional<int64_t> value = as_int(at(key));
    if (!value) type_error(key, "an integer");
    return *value;
}

int64_t ConfigReader::get_int(const std::string& key, int64_t fallback) const {
    return has(key) ? get_int(key) : fallback;
}

double ConfigReader::get_float(const std::string& key) const {
    const nlohmann::json& value = at(key);
    if (!value.is_number()) type_error(key, "a number");
    return value.get<double>();
}

double ConfigReader::get_float(const std::string& key, double fallback) const {
    return has(key) ? get_float(key) : fallback;
}

bool ConfigReader::get_bool(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& value = at(key);
    if (!value.is_boolean()) type_error(key, "true or false");
    return value.get<bool>();
}

std::string ConfigReader::get_string(const std::string& key) const {
    const nlohmann::json& value = at(key);
    if (!value.is_string()) type_error(key, "a string");
    return value.get<std::string>();
}

std::string ConfigReader::get_string(const std::string& key, const std::string& fallback) const {
    return has(key) ? get_string(key) : fallback;
}

std::vector<int64_t> ConfigReader::get_int_list(const std::string& key) const {
    const nlohmann::json& value = at(key);
    if (!value.is_array()) type_error(key, "a list of integers");
    std::vector<int64_t> result;
    result.reserve(value.size());
    for (size_t i = 0; i < value.size(); ++i) {
        const std::optional<int64_t> element = as_int(value[i]);
        if (!element) value_error(prefix_ + key + "[" + std::to_string(i) + "]", "an integer", value[i]);
        result.push_back(*element);
    }
    return result;
}

std::vector<std::string> ConfigReader::get_string_list(const std::string& key) const {
    const nlohmann::json& value = at(key);
    if (!value.is_array()) type_error(key, "a list of strings");
    std::vector<std::string> result;
    result.reserve(value.size());
    for (size_t i = 0; i < value.size(); ++i) {
        if (!value[i].is_string()) value_error(prefix_ + key + "[" + std::to_string(i) + "]", "a string", value[i]);
        result.push_back(value[i].get<std::string>());
    }
    return result;
}

ConfigReader ConfigReader::object(const std::string& key) const {
    const nlohmann::json& value = at(key);
    if (!value.is_object()) type_error(key, "an object");
    return ConfigReader(value, path_, prefix_ + key + ".");
}

}  // namespace xinfer
