// Errors. xinfer reports failures as xinfer::Error exceptions whose message names the
// file/tensor/field involved, the expected value and the actual value.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace xinfer {

class Error : public std::runtime_error {
public:
    explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
    throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace xinfer

// Cheap invariant checks stay on in release builds.
#define XINFER_CHECK(cond, ...)                                                                   \
    do {                                                                                          \
        if (!(cond)) ::xinfer::fail("{}:{}: check `{}` failed: {}", __FILE__, __LINE__, #cond,    \
                                    ::fmt::format(__VA_ARGS__));                                  \
    } while (0)
