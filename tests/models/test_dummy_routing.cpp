// `--load-format dummy` models route like trained ones: the router's correction bias is zero
// (transformers initialises it so), and a batch of different prompts touches about as many
// experts per MoE layer as uniform routing would. A random bias as wide as the spread of the
// router's scores sent most tokens to the same few experts, so the serving benchmarks measured
// hot experts that a trained model's load balancing (the purpose of that bias) never produces.
#include "fixture.h"
#include "unit/safetensors_test_writer.h"
#include "xinfer/engine.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>

namespace xinfer::test {
namespace {

TEST(DummyWeights, RouteAboutAsUniformlyAsATrainedModel) {
    // The MiMo fixture's shape with 32 experts, top-8, and a wider hidden state.
    constexpr int kExperts = 32, kTopK = 8, kBatch = 8;
    nlohmann::json config = nlohmann::json::parse(std::ifstream(fixture_dir("mimo_hub_f32") / "config.json"));
    config["n_routed_experts"] = kExperts;
    config["num_experts_per_tok"] = kTopK;
    config["hidden_size"] = 256;
    config["n_group"] = 1;  // as MiMo-V2-Flash: no group limit
    config["topk_group"] = 1;
    TempDir dir;
    std::ofstream(dir.path() / "config.json") << config.dump();

    EngineOptions options;
    options.model_dir = dir.path().string();
    options.load_format = "dummy";
    options.max_num_seqs = kBatch;
    options.max_model_len = 64;
    std::unique_ptr<Engine> engine = Engine::create(options);
    engine->set_expert_census(true);
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> token(0, int32_t(config["vocab_size"]) - 1);
    for (int s = 0; s < kBatch; ++s) {
        std::vector<int32_t> prompt(16);
        for (int32_t& t : prompt) t = token(rng);
        engine->submit(prompt, {}, 8);
    }
    // Decode steps of the whole batch only (the first step prefills every prompt).
    int64_t layer_steps = 0, distinct = 0;
    bool first = true;
    while (engine->has_work()) {
        const EngineStats before = engine->stats();
        const std::vector<RequestOutput> outputs = engine->step();
        const EngineStats after = engine->stats();
        if (!first && outputs.size() == size_t(kBatch)) {
            layer_steps += after.census_moe_layer_steps - before.census_moe_layer_steps;
            distinct += after.census_distinct_experts - before.census_distinct_experts;
        }
        first = false;
    }
    ASSERT_GT(layer_steps, 0);
    const double measured = double(distinct) / double(layer_steps);
    const double uniform = kExperts * (1.0 - std::pow(1.0 - double(kTopK) / kExperts, kBatch));  // 28.8
    EXPECT_GT(measured, 0.9 * uniform) << "distinct experts per MoE layer and step: " << measured
                                       << ", uniform routing: " << uniform;
}

}  // namespace
}  // namespace xinfer::test
