#include "tokenizer/python_json.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdlib>

namespace xinfer {
namespace {

using ojson = nlohmann::ordered_json;

// json.dumps's string escapes (ensure_ascii=False: only '"', '\' and control characters).
void append_json_string(std::string& out, const std::string& s) {
    out += '"';
    for (unsigned char c : s) {
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            case '\b': out += "\\b"; break;
            case '\f': out += "\\f"; break;
            default:
                if (c < 0x20) out += fmt::format("\\u{:04x}", c);
                else out += char(c);
        }
    }
    out += '"';
}

// repr(str): single quotes unless the text holds one and no double quote.
void append_python_repr(std::string& out, const std::string& s) {
    const char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
    out += quote;
    for (unsigned char c : s) {
        if (c == '\\') out += "\\\\";
        else if (c == quote) out += std::string("\\") + char(quote);
        else if (c == '\n') out += "\\n";
        else if (c == '\r') out += "\\r";
        else if (c == '\t') out += "\\t";
        else if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
        else out += char(c);
    }
    out += quote;
}

// A list or dict as both writers lay it out: items separated by ", ", a dict's keys followed by
// ": ", in insertion order; `key` and `item` write a key and a value.
template <typename Key, typename Item>
void append_container(std::string& out, const ojson& v, const Key& key, const Item& item) {
    const bool dict = v.is_object();
    out += dict ? '{' : '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
        if (!first) out += ", ";
        first = false;
        if (dict) {
            key(it.key());
            out += ": ";
        }
        item(it.value());
    }
    out += dict ? '}' : ']';
}

void append_dumps(std::string& out, const ojson& v) {
    switch (v.type()) {
        case ojson::value_t::null: out += "null"; break;
        case ojson::value_t::boolean: out += v.get<bool>() ? "true" : "false"; break;
        case ojson::value_t::number_integer: out += std::to_string(v.get<int64_t>()); break;
        case ojson::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); break;
        case ojson::value_t::number_float: {
            const double d = v.get<double>();
            // json.dumps(allow_nan=True) spells these as JavaScript does.
            if (std::isnan(d)) out += "NaN";
            else if (std::isinf(d)) out += d > 0 ? "Infinity" : "-Infinity";
            else out += python_float_repr(d);
            break;
        }
        case ojson::value_t::string: append_json_string(out, v.get_ref<const std::string&>()); break;
        case ojson::value_t::array:
        case ojson::value_t::object:
            append_container(
                out, v, [&](const std::string& key) { append_json_string(out, key); },
                [&](const ojson& item) { append_dumps(out, item); });
            break;
        default: out += "null"; break;  // binary / discarded: not produced by a JSON parse
    }
}

void append_str(std::string& out, const ojson& v, bool nested) {
    switch (v.type()) {
        case ojson::value_t::null: out += "None"; break;
        case ojson::value_t::boolean: out += v.get<bool>() ? "True" : "False"; break;
        case ojson::value_t::number_float: {
            const double d = v.get<double>();
            if (std::isnan(d)) out += "nan";
            else if (std::isinf(d)) out += d > 0 ? "inf" : "-inf";
            else out += python_float_repr(d);
            break;
        }
        case ojson::value_t::string:
            // str() of a string is the string; inside a list or dict it is its repr.
            if (nested) append_python_repr(out, v.get_ref<const std::string&>());
            else out += v.get_ref<const std::string&>();
            break;
        case ojson::value_t::array:
        case ojson::value_t::object:
            append_container(
                out, v, [&](const std::string& key) { append_python_repr(out, key); },
                [&](const ojson& item) { append_str(out, item, true); });
            break;
        default: append_dumps(out, v); break;  // integers
    }
}

}  // namespace

std::string python_float_repr(double value) {
    if (value == 0) return std::signbit(value) ? "-0.0" : "0.0";
    // The shortest round-trip digits, as d.ddde±x.
    char buf[64];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, value, std::chars_format::scientific);
    std::string sci(buf, ec == std::errc() ? end : buf);
    std::string out;
    size_t at = 0;
    if (sci[0] == '-') {
        out += '-';
        at = 1;
    }
    const size_t e = sci.find('e');
    std::string digits;
    for (size_t i = at; i < e; ++i)
        if (sci[i] != '.') digits += sci[i];
    const int exponent = std::atoi(sci.c_str() + e + 1);
    const int decpt = exponent + 1;  // digits before the decimal point
    const int n = int(digits.size());
    // Python (pystrtod.c, repr): exponential when decpt <= -4 or decpt > 16.
    if (decpt <= -4 || decpt > 16) {
        out += digits[0];
        if (n > 1) {
            out += '.';
            out += digits.substr(1);
        }
        out += fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
    } else if (decpt <= 0) {
        out += "0.";
        out.append(size_t(-decpt), '0');
        out += digits;
    } else if (decpt < n) {
        out += digits.substr(0, size_t(decpt));
        out += '.';
        out += digits.substr(size_t(decpt));
    } else {
        out += digits;
        out.append(size_t(decpt - n), '0');
        out += ".0";
    }
    return out;
}

std::string python_json_dumps(const ojson& value) {
    std::string out;
    append_dumps(out, value);
    return out;
}

std::string python_str(const ojson& value) {
    std::string out;
    append_str(out, value, false);
    return out;
}

}  // namespace xinfer
