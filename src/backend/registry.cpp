// Finding and opening backends: the built-in CPU table, or a plugin libxinfer-<name>.so.
#include "backend/backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <vector>

namespace xinfer {
namespace {

std::filesystem::path executable_dir() {
    std::error_code ec;
    const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    return ec ? std::filesystem::current_path() : exe.parent_path();
}

std::vector<std::filesystem::path> plugin_search_path() {
    std::vector<std::filesystem::path> dirs;
    if (const char* env = std::getenv("XINFER_PLUGIN_PATH")) {
        std::string list = env;
        for (size_t begin = 0; begin <= list.size();) {
            size_t end = list.find(':', begin);
            if (end == std::string::npos) end = list.size();
            if (end > begin) dirs.emplace_back(list.substr(begin, end - begin));
            begin = end + 1;
        }
    }
    dirs.push_back(executable_dir());
    dirs.push_back(executable_dir() / ".." / "lib");
    return dirs;
}

// Loaded plugin tables, by name. Libraries are never unloaded: their threads and static
// state may outlive any one Backend (ggml makes the same choice).
const xinfer_backend_api* load_plugin(const std::string& name) {
    static std::mutex mutex;
    static std::map<std::string, const xinfer_backend_api*> loaded;
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = loaded.find(name); it != loaded.end()) return it->second;

    const std::string file = "libxinfer-" + name + ".so";
    std::string searched;
    for (const auto& dir : plugin_search_path()) {
        const auto path = dir / file;
        searched += (searched.empty() ? "" : ", ") + dir.string();
        if (!std::filesystem::exists(path)) continue;
        void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!handle) fail("backend plugin {}: cannot load {}: {}", name, path.string(), dlerror());
        auto init = reinterpret_cast<xinfer_backend_init_fn>(dlsym(handle, XINFER_BACKEND_INIT_SYMBOL));
        if (!init) fail("backend plugin {}: {} does not export {}", name, path.string(), XINFER_BACKEND_INIT_SYMBOL);
        const xinfer_backend_api* api = init();
        if (!api) fail("backend plugin {} ({}): no usable device on this machine", name, path.string());
        if (api->abi_version != XINFER_BACKEND_ABI_VERSION)
            fail("backend plugin {} ({}): ABI version {}, but this xinfer needs version {}; rebuild the plugin "
                 "against this xinfer's include/xinfer/backend_abi.h",
                 name, path.string(), api->abi_version, XINFER_BACKEND_ABI_VERSION);
        loaded[name] = api;
        return api;
    }
    fail("device '{}': backend plugin {} not found (looked in: {}; set XINFER_PLUGIN_PATH to add directories)", name,
         file, searched);
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<Backend>(cpu_backend_api(), 0, "cpu"); }

std::unique_ptr<Backend> make_backend(const std::string& device) {
    std::string name = device;
    int index = 0;
    if (const size_t colon = device.find(':'); colon != std::string::npos) {
        name = device.substr(0, colon);
        const std::string number = device.substr(colon + 1);
        char* end = nullptr;
        const long parsed = std::strtol(number.c_str(), &end, 10);
        if (number.empty() || *end != '\0' || parsed < 0)
            fail("device '{}': expected <name> or <name>:<index> with a non-negative index", device);
        index = int(parsed);
    }
    if (name.empty()) fail("device '{}': empty backend name", device);
    if (name == "cpu") {
        if (index != 0) fail("device '{}': the CPU backend has one device, cpu:0", device);
        return make_cpu_backend();
    }
    const xinfer_backend_api* api = load_plugin(name);
    const int count = api->device_count();
    if (index >= count) fail("device '{}': backend {} has {} device(s) ({}:0..{}:{})", device, name, count, name, name, count - 1);
    return std::make_unique<Backend>(api, index, name + ":" + std::to_string(index));
}

}  // namespace xinfer
