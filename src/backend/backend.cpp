// Backend registry. Only the built-in CPU backend exists for now; device plugins
// (libxinfer-<name>.so behind the C ABI) will be looked up here.
#include "backend/backend.h"

namespace xinfer {

std::unique_ptr<Backend> make_backend(const std::string& device) {
    if (device == "cpu") return make_cpu_backend();
    fail("unknown device '{}': available devices are: cpu", device);
}

}  // namespace xinfer
