// JSON text exactly as Python writes it, for chat templates and tool-call arguments.
//
// Hugging Face chat templates run in Jinja under transformers, whose `tojson` filter is
// json.dumps(x, ensure_ascii=False): ", " and ": " separators, keys in insertion order, non-ASCII
// characters written as themselves, floats as Python's repr (1.0, 1e-05, 1e+16). nlohmann's dump()
// differs in all but the key order (when given ordered_json), and a prompt that differs by a space
// is a different prompt. vLLM also writes tool-call arguments with json.dumps(ensure_ascii=False),
// so clients see the same text from us.
//
// Jinja's `string` filter is Python's str(): True/False/None, floats as repr, lists and dicts as
// Python literals ("['a', 'b']"); python_str writes that.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace xinfer {

// json.dumps(value, ensure_ascii=False). Strings are written byte for byte apart from the escapes
// json.dumps makes (\" \\ \n \r \t \b \f and \u00XX for other control characters).
std::string python_json_dumps(const nlohmann::ordered_json& value);

// str(value) for the Python value json.loads would give.
std::string python_str(const nlohmann::ordered_json& value);

// repr(float): the shortest text that reads back as `value`, in Python's layout.
std::string python_float_repr(double value);

}  // namespace xinfer
