// Helpers the model-level suites share (tests/models, tests/spec): which device the tests run on,
// a fixture loaded onto it (FixtureModelTest for suites parameterised by fixture), and prompts of
// varied lengths for batching tests.
#pragma once

#include "fixture.h"
#include "models/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace xinfer::test {

// XINFER_TEST_DEVICE=cuda runs device-aware suites on a device (scripts/gpu-check.sh does); the
// default is the CPU oracle.
inline std::string test_device() {
    const char* device = std::getenv("XINFER_TEST_DEVICE");
    return device && *device ? device : "cpu";
}

// A fixture's model on `device`, with the activation dtype XINFER_TEST_DTYPE (auto when unset:
// the checkpoint's, as `--dtype auto`).
struct LoadedModel {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Checkpoint> checkpoint;
    std::unique_ptr<Model> model;
    LoadedModel() = default;  // parts filled in by the caller
    explicit LoadedModel(const std::filesystem::path& dir, const std::string& device = test_device())
        : LoadedModel(dir, device, env_options()) {}
    // Any options; dummy weights need only the directory's config.json.
    LoadedModel(const std::filesystem::path& dir, const std::string& device, const LoadOptions& options) {
        backend = make_backend(device);
        checkpoint = Checkpoint::open(dir, /*load_weights=*/!options.dummy);
        model = load_model(*checkpoint, *backend, options);
    }
    static LoadOptions env_options() {
        LoadOptions options;
        if (const char* dtype = std::getenv("XINFER_TEST_DTYPE")) options.dtype = dtype;
        return options;
    }
};

// Tests parameterised by fixture name: the fixture and its model, loaded on test_device().
class FixtureModelTest : public ::testing::TestWithParam<std::string> {
protected:
    void SetUp() override {
        fixture_ = load_fixture(GetParam());
        loaded_ = std::make_unique<LoadedModel>(fixture_.dir);
    }
    Fixture fixture_;
    std::unique_ptr<LoadedModel> loaded_;
};

// n prompts of different lengths and contents built from the fixture prompt.
inline std::vector<std::vector<int32_t>> varied_prompts(const Fixture& f, size_t n) {
    std::vector<std::vector<int32_t>> prompts;
    for (size_t i = 0; i < n; ++i) {
        const size_t len = 3 + (f.prompt.size() - 3) * (i + 1) / n;
        std::vector<int32_t> p(f.prompt.begin(), f.prompt.begin() + long(len));
        std::rotate(p.begin(), p.begin() + long(i % p.size()), p.end());
        prompts.push_back(p);
    }
    return prompts;
}

}  // namespace xinfer::test
