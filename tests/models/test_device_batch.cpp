// A serving batch on the device against the CPU oracle, end to end: 16 sequences of a small
// MiMo-shaped model with bf16 dummy weights whose experts are all chosen by every token, so that
// the prefill and the graph-captured decode steps run the CUDA plugin's staged expert kernels
// (plugins/cuda/moe_staged.cu: more than 8 pairs per expert, hidden 256, expert width 128), next
// to batched attention, KV stores and projections. Dummy weights of tensors this small are the
// same values on every backend (src/models/dummy_weights.h). Device-only (scripts/gpu-check.sh runs
// it with XINFER_TEST_DEVICE=cuda); XINFER_TEST_CPU_SELF=1 runs the harness CPU against CPU.
#include "model_test_util.h"
#include "runtime/runner.h"
#include "unit/safetensors_test_writer.h"

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>

namespace xinfer::test {
namespace {

constexpr int kSequences = 16, kPromptTokens = 4, kDecodeSteps = 6;

std::unique_ptr<LoadedModel> load_dummy(const std::filesystem::path& dir, const std::string& device) {
    LoadOptions options;
    options.dummy = true;
    options.dtype = "bfloat16";  // host-memory backends still compute in f32: the reference
    return std::make_unique<LoadedModel>(dir, device, options);
}

// Logits of the prefill and of every decode step for `tokens` (prompt then continuation), the
// continuation teacher-forced: [step][sequence · vocab].
std::vector<std::vector<float>> teacher_forced(Runner& runner, const std::vector<std::vector<int32_t>>& tokens) {
    std::vector<std::vector<float>> out;
    std::vector<SequenceChunk> chunks;
    for (size_t s = 0; s < tokens.size(); ++s)
        chunks.push_back({int(s), 0, std::span(tokens[s]).first(kPromptTokens), false});
    out.push_back(runner.step(chunks));
    for (int step = 0; step < kDecodeSteps; ++step) {
        chunks.clear();
        const int64_t at = kPromptTokens + step;
        for (size_t s = 0; s < tokens.size(); ++s) chunks.push_back({int(s), at, std::span(tokens[s]).subspan(at, 1), false});
        out.push_back(runner.step(chunks));
    }
    for (size_t s = 0; s < tokens.size(); ++s) runner.release(int(s));
    return out;
}

TEST(DeviceBatch, ServingBatchWithStagedExpertsMatchesTheCpu) {
    if (test_device() == "cpu" && !std::getenv("XINFER_TEST_CPU_SELF")) GTEST_SKIP() << "set XINFER_TEST_DEVICE=cuda to compare a device with the CPU";
    nlohmann::json config = nlohmann::json::parse(std::ifstream(fixture_dir("mimo_hub_f32") / "config.json"));
    config["hidden_size"] = 256;
    config["moe_intermediate_size"] = 128;
    config["n_routed_experts"] = 8;
    config["num_experts_per_tok"] = 8;  // every token picks every expert: 16 pairs per expert
    config["n_group"] = 1;
    config["topk_group"] = 1;
    TempDir dir;
    std::ofstream(dir.path() / "config.json") << config.dump();
    const int64_t vocab = config["vocab_size"];

    RunnerOptions options;
    options.page_size = 4;
    options.max_cached_tokens = 512;
    options.max_graph_batch = kSequences;
    const auto cpu = load_dummy(dir.path(), "cpu");
    const auto device = load_dummy(dir.path(), test_device());

    // The CPU's greedy continuation, fed to both sides.
    std::vector<std::vector<int32_t>> tokens;
    for (int s = 0; s < kSequences; ++s) {
        std::vector<int32_t> prompt;
        for (int i = 0; i < kPromptTokens; ++i) prompt.push_back(int32_t((s * 131 + i * 17 + 3) % vocab));
        tokens.push_back(prompt);
    }
    {
        Runner runner(*cpu->model, *cpu->backend, options);
        std::vector<SequenceChunk> chunks;
        for (int s = 0; s < kSequences; ++s) chunks.push_back({s, 0, tokens[size_t(s)], false});
        for (int step = 0; step < kDecodeSteps; ++step) {
            const std::vector<float> logits = runner.step(chunks);
            chunks.clear();
            for (int s = 0; s < kSequences; ++s) {
                const float* row = logits.data() + size_t(s) * size_t(vocab);
                auto& seq = tokens[size_t(s)];
                seq.push_back(int32_t(std::max_element(row, row + vocab) - row));
                chunks.push_back({s, int64_t(seq.size()) - 1, std::span(seq).last(1), false});
            }
        }
        for (int s = 0; s < kSequences; ++s) runner.release(s);
    }
    Runner cpu_runner(*cpu->model, *cpu->backend, options);
    const auto expected = teacher_forced(cpu_runner, tokens);
    Runner device_runner(*device->model, *device->backend, options);
    const auto actual = teacher_forced(device_runner, tokens);
    if (device_runner.graphs_enabled()) {
        EXPECT_GE(device_runner.graph_stats().replays, kDecodeSteps - 1);
    }

    double worst = 0;
    for (size_t step = 0; step < expected.size(); ++step) {
        ASSERT_EQ(actual[step].size(), expected[step].size());
        for (int s = 0; s < kSequences; ++s) {
            const size_t at = size_t(s) * size_t(vocab);
            const double err = relative_error(&actual[step][at], &expected[step][at], size_t(vocab));
            worst = std::max(worst, err);
            EXPECT_LE(err, 3e-2) << "step " << step << " (0: prefill), sequence " << s;
        }
    }
    std::cout << fmt::format("[ {:<8} ] {} batch {} (staged experts, graphs {}): prefill + {} decode steps vs cpu, "
                             "relative error {:.2e}\n",
                             "batch", test_device(), kSequences, device_runner.graphs_enabled() ? "on" : "off",
                             kDecodeSteps, worst);
}

}  // namespace
}  // namespace xinfer::test
