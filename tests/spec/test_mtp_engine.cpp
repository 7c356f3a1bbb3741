// Greedy speculation with the MTP drafter through the Engine (CPU) is token-identical to greedy
// without it: one request and a batch with chunked prefill, on the f32 fixtures with 1 and 3 MTP
// heads and on the FP8 block-scaled fixture (its MTP block dequantized like the decoder's).
#include "models/model_test_util.h"
#include "runtime/engine_impl.h"
#include "runtime/runner.h"
#include "spec/mtp.h"

#include <map>

namespace xinfer::test {
namespace {

struct Case {
    std::string fixture;
    int k;  // num_speculative_tokens
};

class MtpEngineTest : public ::testing::TestWithParam<Case> {
protected:
    void SetUp() override {
        fixture_ = load_fixture(GetParam().fixture == "mimo_mtp_f32" ? "mimo_hub_f32" : GetParam().fixture);
        dir_ = fixture_dir(GetParam().fixture);  // mimo_mtp_f32: mimo_hub_f32's target + 3 MTP blocks
        checkpoint_ = Checkpoint::open(dir_);
        LoadOptions options;
        if (const char* dtype = std::getenv("XINFER_TEST_DTYPE")) options.dtype = dtype;
        model_ = load_model(*checkpoint_, *backend_, options);
    }
    Runner make_runner(bool features) {
        RunnerOptions options;
        options.page_size = 4;  // chains cross page boundaries, rollbacks free pages
        options.n_pages = 512;
        if (features) options.feature_layers = {kFinalNormFeature};
        return Runner(*model_, *backend_, options);
    }
    // Tokens per prompt; with MTP also the engine's speculative counters.
    std::vector<std::vector<int32_t>> run(const std::vector<std::vector<int32_t>>& prompts, SchedulerOptions options,
                                          int max_tokens, bool speculate, SpecCounters* counters = nullptr,
                                          std::vector<std::pair<std::vector<int32_t>, int>>* trace = nullptr) {
        Runner runner = make_runner(speculate);
        std::unique_ptr<Drafter> drafter;
        if (speculate) {
            SpeculativeConfig config;
            config.method = "mtp";
            config.num_speculative_tokens = GetParam().k;
            drafter = make_drafter(config, DrafterContext{*model_, *backend_, dir_.string(), false,
                                                          options.max_num_seqs, 4096});
        }
        std::unique_ptr<Engine> engine = make_engine(runner, options, drafter.get());
        std::map<uint64_t, size_t> index;
        for (size_t i = 0; i < prompts.size(); ++i) index[engine->submit(prompts[i], {}, max_tokens)] = i;
        std::vector<std::vector<int32_t>> tokens(prompts.size());
        while (engine->has_work()) {
            for (const RequestOutput& out : engine->step()) {
                auto& t = tokens[index.at(out.id)];
                t.insert(t.end(), out.new_tokens.begin(), out.new_tokens.end());
                if (out.accepted >= 0) {
                    EXPECT_LE(size_t(out.accepted), out.proposed.size());
                }
                if (out.accepted >= 0 && trace) trace->push_back({out.proposed, out.accepted});
            }
        }
        EXPECT_EQ(runner.kv().free_pages(), runner.kv().n_pages()) << "a target page leaked";
        if (counters) *counters = engine->stats().spec;
        return tokens;
    }

    std::unique_ptr<Backend> backend_ = make_backend(test_device());  // XINFER_TEST_DEVICE (gpu-check.sh)
    Fixture fixture_;
    std::filesystem::path dir_;
    std::unique_ptr<Checkpoint> checkpoint_;
    std::unique_ptr<Model> model_;
};

TEST_P(MtpEngineTest, GreedyAloneIsLossless) {
    const int max_tokens = 32;
    SpecCounters spec;
    std::vector<std::pair<std::vector<int32_t>, int>> trace;  // what --spec-trace writes
    const auto with = run({fixture_.prompt}, {1, 4096, 0}, max_tokens, true, &spec, &trace);
    const auto without = run({fixture_.prompt}, {1, 4096, 0}, max_tokens, false);
    EXPECT_EQ(with, without);
    EXPECT_GT(spec.num_drafts, 0);
    EXPECT_LE(spec.num_draft_tokens, spec.num_drafts * GetParam().k);
    if (GetParam().fixture == "mimo_mtp_f32") {
        // Every step's proposals equal the float64 reference chain at its anchor (decidable
        // drafts only: margin >= 1e-2 for the draft and all before it; test_mtp.cpp).
        const std::filesystem::path ref_path = dir_ / "reference_mtp.json";
        std::ifstream in(ref_path);
        const nlohmann::json ref = nlohmann::json::parse(in);
        const auto chains = ref.at("chain_drafts").get<std::vector<std::vector<int32_t>>>();
        const auto margins = ref.at("chain_margins").get<std::vector<std::vector<double>>>();
        int64_t P = int64_t(fixture_.prompt.size()) - 1;  // last committed position before the anchor
        size_t compared = 0;
        for (const auto& [proposed, accepted] : trace) {
            if (P >= int64_t(chains.size())) break;
            for (size_t j = 0; j < proposed.size() && margins[size_t(P)][j] >= 1e-2; ++j, ++compared)
                EXPECT_EQ(proposed[j], chains[size_t(P)][j]) << "anchor " << P + 1 << " draft " << j;
            P += accepted + 1;
        }
        EXPECT_GE(compared, size_t(20 * GetParam().k));
    }
    std::printf("%s k=%d: %lld drafts, %lld draft tokens, %lld accepted, mean acceptance length %.3f\n",
                GetParam().fixture.c_str(), GetParam().k, (long long)spec.num_drafts, (long long)spec.num_draft_tokens,
                (long long)spec.num_accepted_tokens, spec.mean_acceptance_length());
}

TEST_P(MtpEngineTest, GreedyBatchedChunkedIsLossless) {
    const auto prompts = varied_prompts(fixture_, 4);
    const int max_tokens = 16;
    std::vector<std::vector<int32_t>> expected;
    for (const auto& p : prompts) expected.push_back(run({p}, {1, 4096, 0}, max_tokens, false)[0]);
    // A budget of 9 tokens splits prompts into chunks next to other requests' verify chains.
    EXPECT_EQ(run(prompts, {4, 9, 0}, max_tokens, true), expected);
    EXPECT_EQ(run(prompts, {4, 4096, 0}, max_tokens, true), expected);
}

// Prefix caching composes with MTP: a second request with the same prompt is served from the
// target's cache except for the last context_window() prompt positions, which the heads observe,
// so it drafts from its first step and proposes what the cold first request proposed.
TEST_P(MtpEngineTest, DraftsAfterPrefixCacheHit) {
    RunnerOptions runner_options;
    runner_options.page_size = 4;
    runner_options.n_pages = 512;
    runner_options.enable_prefix_caching = true;
    runner_options.feature_layers = {kFinalNormFeature};
    Runner runner(*model_, *backend_, runner_options);
    const auto expected = run({fixture_.prompt}, {1, 4096, 0}, 16, false)[0];
    SpecCounters counters[2];
    std::vector<std::vector<int32_t>> proposals[2];
    int64_t hits = 0;
    for (int pass = 0; pass < 2; ++pass) {
        SpeculativeConfig config;
        config.method = "mtp";
        config.num_speculative_tokens = GetParam().k;
        std::unique_ptr<Drafter> drafter =
            make_drafter(config, DrafterContext{*model_, *backend_, dir_.string(), false, 1, 4096});
        std::unique_ptr<Engine> engine = make_engine(runner, {1, 4096, 0}, drafter.get());
        engine->submit(fixture_.prompt, {}, 16);
        std::vector<int32_t> tokens;
        while (engine->has_work())
            for (const RequestOutput& out : engine->step()) {
                tokens.insert(tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
                if (out.accepted >= 0) proposals[pass].push_back(out.proposed);
            }
        EXPECT_EQ(tokens, expected) << "pass " << pass;
        counters[pass] = engine->stats().spec;
        hits = engine->stats().prefix_hit_tokens;
    }
    EXPECT_GT(hits, 0) << "the second pass did not hit the prefix cache";
    EXPECT_GT(counters[0].num_drafts, 0);
    EXPECT_EQ(counters[1].num_drafts, counters[0].num_drafts);
    EXPECT_EQ(proposals[1], proposals[0]);
    runner.kv().check_integrity();
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MtpEngineTest,
                         ::testing::Values(Case{"mimo_hub_f32", 1}, Case{"mimo_mtp_f32", 3}, Case{"mimo_mtp_f32", 2},
                                           Case{"mimo_hub_fp8", 1}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                             return info.param.fixture + "_k" + std::to_string(info.param.k);
                         });

}  // namespace
}  // namespace xinfer::test
