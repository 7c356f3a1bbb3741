// --kv-cache-dtype fp8 on the golden fixtures (CPU, and cuda through scripts/gpu-check.sh): e4m3 K/V with one f32 scale per (token, kv
// head) row (src/backend/cpu/kv_fp8.h). Logits stay within a stated tolerance of the float64
// reference, decidable greedy steps are unchanged, and the engine equivalences still hold
// exactly (quantization is per row, so batching and prefix caching cannot change it).
#include "model_test_util.h"
#include "runtime/engine_impl.h"
#include "runtime/generate.h"

#include <fmt/core.h>

#include <iostream>
#include <map>

namespace xinfer::test {
namespace {

// The golden fixtures are tiny random-weight models that amplify any perturbation of the KV
// cache: a bf16 cache (unit roundoff 2^-9) already moves their logits by 3.5e-3 (qwen3_f32),
// 1.1e-2..1.9e-2 (MiMo) and 2.7e-1 (qwen3_moe: router flips), and e4m3's 3 mantissa bits round
// 16× coarser. So the accuracy of the cache itself is checked where nothing amplifies it — the
// first layer's attention output, against the same model with an f32 cache (the op-level
// bounds of tests/ops/test_kv_fp8.cpp: NMSE ≤ 6e-3, max relative ≤ 1.25e-1) — and the logits
// against the float64 reference on the best-conditioned fixture, qwen3_f32 (measured 5.6e-2;
// tolerance 1e-1). Every fixture's logits error is printed; all must stay finite.
constexpr double kFirstLayerNmse = 6e-3, kFirstLayerMaxRelative = 1.25e-1;
constexpr double kQwen3LogitsTolerance = 1e-1;


RunnerOptions fp8_options(bool prefix_caching = false, const char* dtype = "fp8") {
    RunnerOptions options;
    options.kv_cache_dtype = dtype;
    options.page_size = 4;  // small pages: sequences span many, windows end mid-page
    options.n_pages = 512;
    options.enable_prefix_caching = prefix_caching;
    return options;
}

class Fp8Kv : public FixtureModelTest {
protected:
    Runner make_runner(bool prefix_caching = false) { return Runner(*loaded_->model, *loaded_->backend, fp8_options(prefix_caching)); }
    // Worst row's relative error and the largest absolute logit error.
    std::pair<double, double> logits_error(const std::vector<float>& logits) const {
        const size_t vocab = size_t(fixture_.vocab);
        double worst = 0, max_abs = 0;
        for (size_t row = 0; row < fixture_.prompt.size(); ++row)
            worst = std::max(worst, relative_error(&logits[row * vocab], &fixture_.logits[row * vocab], vocab));
        for (size_t i = 0; i < logits.size(); ++i)
            max_abs = std::max(max_abs, std::fabs(double(logits[i]) - double(fixture_.logits[i])));
        return {worst, max_abs};
    }
};

TEST_P(Fp8Kv, UsesAnFp8Pool) {
    Runner runner = make_runner();
    EXPECT_EQ(runner.layout().dtype, DType::f8_e4m3);
}

// Layer 0's attention output over the prompt (one-shot prefill: every query reads quantized
// keys and values) with an fp8 and with an f32 cache.
TEST_P(Fp8Kv, FirstLayerAttentionWithinQuantizationError) {
    std::vector<float> outputs[2];
    for (int i = 0; i < 2; ++i) {
        Runner runner(*loaded_->model, *loaded_->backend, fp8_options(false, i == 0 ? "fp8" : "float32"));
        const SequenceChunk chunk{0, 0, fixture_.prompt, true};
        runner.step(std::span(&chunk, 1), [&](std::string_view name, int layer, const Tensor& value) {
            if (name == "attn_output" && layer == 0) {
                outputs[i].resize(size_t(value.numel()));
                loaded_->backend->download(value, outputs[i].data());
            }
        });
    }
    ASSERT_FALSE(outputs[0].empty());
    ASSERT_EQ(outputs[0].size(), outputs[1].size());
    double diff2 = 0, ref2 = 0;
    for (size_t i = 0; i < outputs[0].size(); ++i) {
        diff2 += (double(outputs[0][i]) - outputs[1][i]) * (double(outputs[0][i]) - outputs[1][i]);
        ref2 += double(outputs[1][i]) * outputs[1][i];
    }
    const double nmse = diff2 / ref2, max_relative = relative_error(outputs[0].data(), outputs[1].data(), outputs[0].size());
    EXPECT_LE(nmse, kFirstLayerNmse);
    EXPECT_LE(max_relative, kFirstLayerMaxRelative);
    std::cout << fmt::format("[ {:<8} ] {} layer-0 attention, fp8 vs f32 cache: nmse {:.2e} (tolerance {:.0e}), max "
                             "relative {:.2e} (tolerance {:.2e})\n",
                             "attn", GetParam(), nmse, kFirstLayerNmse, max_relative, kFirstLayerMaxRelative);
}

// One-shot prefill and token-by-token decode against the float64 reference.
TEST_P(Fp8Kv, PromptLogitsAgainstReference) {
    Runner runner = make_runner();
    for (int64_t chunk : {int64_t(0), int64_t(1)}) {
        const std::vector<float> logits = prompt_logits(runner, fixture_.prompt, chunk);
        ASSERT_EQ(logits.size(), fixture_.logits.size());
        const auto [relative, absolute] = logits_error(logits);
        EXPECT_TRUE(std::isfinite(relative)) << "NaN in the logits";
        if (GetParam() == "qwen3_f32") {
            EXPECT_LE(relative, kQwen3LogitsTolerance) << (chunk ? "decode" : "prefill");
        }
        std::cout << fmt::format("[ {:<8} ] {} {} with fp8 KV: relative error {:.2e}{}, max abs {:.3f}\n", "logits",
                                 GetParam(), chunk ? "decode" : "prefill", relative,
                                 GetParam() == "qwen3_f32" ? fmt::format(" (tolerance {:.0e})", kQwen3LogitsTolerance)
                                                           : std::string(" (reported)"),
                                 absolute);
    }
    runner.kv().check_integrity();
}

// Greedy steps whose top-1/top-2 margin exceeds twice the largest logit error fp8 causes on the
// prompt (measured, as the device golden tests do) must match the reference. On these
// fixtures that error is large, so few or no steps are decidable; the test says how many.
TEST_P(Fp8Kv, DecidableGreedyStepsMatchReference) {
    Runner probe = make_runner();
    const double max_abs = logits_error(prompt_logits(probe, fixture_.prompt)).second;
    const double min_margin = std::max(0.05, 2 * max_abs);
    const size_t decidable = decidable_greedy_steps(fixture_, min_margin);
    Runner runner = make_runner();
    GenerateOptions options;
    options.max_tokens = int(fixture_.greedy.size());
    const GenerateResult result = generate(runner, {fixture_.prompt}, options);
    ASSERT_EQ(result.tokens[0].size(), fixture_.greedy.size());
    const std::vector<int32_t> expected(fixture_.greedy.begin(), fixture_.greedy.begin() + long(decidable));
    const std::vector<int32_t> actual(result.tokens[0].begin(), result.tokens[0].begin() + long(decidable));
    EXPECT_EQ(actual, expected) << "first " << decidable << " decidable greedy steps (margin > " << min_margin << ")";
    size_t same = 0;
    while (same < result.tokens[0].size() && result.tokens[0][same] == fixture_.greedy[same]) ++same;
    std::cout << fmt::format("[ {:<8} ] {} with fp8 KV: {} decidable greedy steps (margin > {:.3f}) identical; "
                             "{} of {} reference tokens before the first difference\n",
                             "greedy", GetParam(), decidable, min_margin, same, fixture_.greedy.size());
}

// Sequences of different lengths decoded together get exactly the tokens each gets alone.
TEST_P(Fp8Kv, BatchedEqualsAlone) {
    std::vector<std::vector<int32_t>> prompts;
    for (size_t len : {fixture_.prompt.size(), fixture_.prompt.size() / 3 + 1, fixture_.prompt.size() * 2 / 3}) {
        std::vector<int32_t> p(fixture_.prompt.begin(), fixture_.prompt.begin() + long(len));
        std::reverse(p.begin(), p.end());
        prompts.push_back(p);
    }
    GenerateOptions options;
    options.max_tokens = 10;
    Runner runner = make_runner();
    const GenerateResult together = generate(runner, prompts, options);
    for (size_t i = 0; i < prompts.size(); ++i) {
        const GenerateResult alone = generate(runner, {prompts[i]}, options);
        EXPECT_EQ(together.tokens[i], alone.tokens[0]) << "sequence " << i;
    }
    runner.kv().check_integrity();
}

// A warm prefix-cache hit reads the cold run's quantized pages: same logits, same tokens.
TEST_P(Fp8Kv, PrefixCacheHitEqualsColdRun) {
    Runner runner = make_runner(/*prefix_caching=*/true);
    const int64_t block = runner.layout().block_tokens();
    std::vector<int32_t> prompt;
    while (int64_t(prompt.size()) < 2 * block + 3)
        prompt.insert(prompt.end(), fixture_.prompt.begin(), fixture_.prompt.end());
    prompt.resize(size_t(2 * block + 3));

    const size_t vocab = size_t(fixture_.vocab);
    const std::vector<float> cold = prompt_logits(runner, prompt);
    KvCacheManager& kv = runner.kv();
    const int64_t reused = kv.add_sequence(7, prompt);
    ASSERT_EQ(reused, 2 * block);
    ASSERT_TRUE(kv.allocate(7, int64_t(prompt.size())));
    const SequenceChunk rest{7, reused, std::span(prompt).subspan(size_t(reused)), true};
    const std::vector<float> warm = runner.forward(std::span(&rest, 1));
    kv.commit(7, prompt, int64_t(prompt.size()));
    kv.free_sequence(7);
    const std::vector<float> cold_rest(cold.begin() + long(size_t(reused) * vocab), cold.end());
    // Exact up to f32 summation order when the model runs in f32. In bf16 (mimo_hub_fp8 on an
    // accelerator) the rest's shorter step rounds its activations differently from the one-shot
    // prefill, and the fixture amplifies that (cuda: 1.5e-2): the golden tests' bf16 bound.
    const double tolerance = loaded_->model->activation_dtype() == DType::f32 ? 1e-5 : 3e-2;
    EXPECT_LE(relative_error(warm.data(), cold_rest.data(), warm.size()), tolerance);

    auto run = [&](EngineStats* stats) {
        std::unique_ptr<Engine> engine = make_engine(runner, {2, 4096, 0});
        const uint64_t id = engine->submit(prompt, {}, 6);
        std::vector<int32_t> tokens;
        while (engine->has_work())
            for (const RequestOutput& out : engine->step())
                if (out.id == id) tokens.insert(tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
        *stats = engine->stats();
        return tokens;
    };
    EngineStats first_stats, second_stats;
    const std::vector<int32_t> first = run(&first_stats), second = run(&second_stats);
    EXPECT_EQ(first, second);
    EXPECT_GE(second_stats.prefix_hit_tokens, 2 * block);
    runner.kv().check_integrity();
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Fp8Kv,
                         ::testing::Values("mimo_native_f32", "mimo_hub_f32", "mimo_hub_fp8", "qwen3_f32",
                                           "qwen3_moe_f32"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace xinfer::test
