// Typed access to config.json fields. A field of the wrong type is an error naming the file,
// the field, the expected type and the value found; a missing required field likewise.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace xinfer {

// Holds a reference to `json`, which must outlive the reader. Not thread-safe to construct
// while the JSON is being modified; reading from several threads is fine.
class ConfigReader {
public:
    // `prefix` is how errors name this object's fields ("rope_parameters.sliding_attention.").
    ConfigReader(const nlohmann::json& json, std::filesystem::path path, std::string prefix = "")
        : json_(json), path_(std::move(path)), prefix_(std::move(prefix)) {}

    const nlohmann::json& json() const { return json_; }
    const std::filesystem::path& path() const { return path_; }
    bool has(const std::string& key) const;  // present and not null

    int64_t get_int(const std::string& key) const;  // required
    int64_t get_int(const std::string& key, int64_t fallback) const;
    double get_float(const std::string& key) const;
    double get_float(const std::string& key, double fallback) const;  // null also → fallback
    bool get_bool(const std::string& key, bool fallback) const;
    std::string get_string(const std::string& key) const;
    std::string get_string(const std::string& key, const std::string& fallback) const;
    std::vector<int64_t> get_int_list(const std::string& key) const;
    std::vector<std::string> get_string_list(const std::string& key) const;
    // A nested object as its own reader (errors then name "key.sub").
    ConfigReader object(const std::string& key) const;

    // Throws "<path>: field '<prefix><key>': expected <expected>, found <value>". Public so that
    // model code can report its own semantic checks in the same words.
    [[noreturn]] void type_error(const std::string& key, const char* expected) const;

private:
    const nlohmann::json& at(const std::string& key) const;  // throws "missing required field"
    // type_error for a value that is not directly a field of this object (a list element).
    [[noreturn]] void value_error(const std::string& field, const char* expected, const nlohmann::json& found) const;
    const nlohmann::json& json_;
    std::filesystem::path path_;
    std::string prefix_;
};

}  // namespace xinfer
