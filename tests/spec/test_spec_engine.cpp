// Speculative decoding through the Engine on the golden fixtures (CPU): greedy output with any
// drafter — good, useless or adversarial — is token-identical to greedy without one, alone and
// batched, with chunked prefill, prefix caching, preemption, stop ids and max_tokens; every
// step leaves the KV pool intact; sampling keeps the target's distribution.
#include "byte_level_tokenizer.h"
#include "models/model_test_util.h"
#include "runtime/engine_impl.h"
#include "runtime/generate.h"
#include "runtime/memory_plan.h"
#include "unit/safetensors_test_writer.h"

#include <map>

namespace xinfer::test {
namespace {


RunnerOptions pool(int64_t n_pages, bool prefix_caching = false) {
    RunnerOptions options;
    options.page_size = 4;  // small pages: chains cross page boundaries, rollbacks free pages
    options.n_pages = n_pages;
    options.enable_prefix_caching = prefix_caching;
    return options;
}

// Proposes the continuation of a known sequence (an oracle: every draft is accepted under
// greedy) or, with `corrupt`, the same tokens shifted by one (every draft is rejected).
class ScriptedDrafter final : public Drafter {
public:
    ScriptedDrafter(std::vector<std::vector<int32_t>> sequences, int k, int64_t vocab, bool corrupt)
        : sequences_(std::move(sequences)), k_(k), vocab_(vocab), corrupt_(corrupt) {}
    const char* method() const override { return "scripted"; }
    int num_speculative_tokens() const override { return k_; }
    std::vector<std::vector<int32_t>> propose(std::span<const DraftRequest> requests) override {
        std::vector<std::vector<int32_t>> drafts;
        for (const DraftRequest& r : requests) {
            std::vector<int32_t> d;
            for (const std::vector<int32_t>& s : sequences_) {
                if (s.size() <= r.tokens.size() || !std::equal(r.tokens.begin(), r.tokens.end(), s.begin())) continue;
                for (size_t i = r.tokens.size(); i < s.size() && int(d.size()) < r.max_drafts; ++i)
                    d.push_back(corrupt_ ? int32_t((s[i] + 1) % vocab_) : s[i]);
                break;
            }
            drafts.push_back(std::move(d));
        }
        return drafts;
    }

private:
    std::vector<std::vector<int32_t>> sequences_;
    int k_;
    int64_t vocab_;
    bool corrupt_;
};

struct RunResult {
    std::vector<std::vector<int32_t>> tokens;  // per prompt
    std::vector<std::string> finish_reasons;
    std::vector<std::string> texts;  // with a detokenizer
    EngineStats stats;
};

RunResult run_all(Runner& runner, const std::vector<std::vector<int32_t>>& prompts, SchedulerOptions options, int max_tokens,
            Drafter* drafter, std::vector<int32_t> stop_ids = {}, SamplingParams sampling = {},
            const Detokenizer* detokenizer = nullptr) {
    std::unique_ptr<Engine> engine = make_engine(runner, options, drafter, detokenizer);
    std::map<uint64_t, size_t> index;
    for (size_t i = 0; i < prompts.size(); ++i) {
        SamplingParams s = sampling;
        s.seed += i;
        index[engine->submit(prompts[i], s, max_tokens, stop_ids)] = i;
    }
    RunResult run;
    run.tokens.resize(prompts.size());
    run.finish_reasons.resize(prompts.size());
    run.texts.resize(prompts.size());
    while (engine->has_work()) {
        for (const RequestOutput& out : engine->step()) {
            auto& t = run.tokens[index.at(out.id)];
            t.insert(t.end(), out.new_tokens.begin(), out.new_tokens.end());
            if (out.accepted >= 0) {
                EXPECT_LE(out.accepted, int(out.proposed.size()));
                EXPECT_LE(out.new_tokens.size(), size_t(out.accepted) + 1);
            }
            run.texts[index.at(out.id)] += out.text;
            if (out.finished) run.finish_reasons[index.at(out.id)] = out.finish_reason;
        }
        runner.kv().check_integrity();
    }
    EXPECT_EQ(runner.kv().free_pages(), runner.kv().n_pages()) << "a page leaked";
    run.stats = engine->stats();
    return run;
}

class SpecEngineTest : public FixtureModelTest {
protected:
    // Plain greedy, one request at a time: the oracle every speculative run must equal.
    std::vector<std::vector<int32_t>> plain(const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
                                            std::vector<int32_t> stop_ids = {}) {
        std::vector<std::vector<int32_t>> result;
        for (const auto& p : prompts) {
            Runner runner(*loaded_->model, *loaded_->backend, pool(512));
            result.push_back(run_all(runner, {p}, {1, 4096, 0}, max_tokens, nullptr, stop_ids).tokens[0]);
        }
        return result;
    }
    // Full sequences (prompt + plain continuation) for the scripted drafters.
    static std::vector<std::vector<int32_t>> joined(const std::vector<std::vector<int32_t>>& prompts,
                                                    const std::vector<std::vector<int32_t>>& continuations) {
        std::vector<std::vector<int32_t>> sequences;
        for (size_t i = 0; i < prompts.size(); ++i) {
            sequences.push_back(prompts[i]);
            sequences.back().insert(sequences.back().end(), continuations[i].begin(), continuations[i].end());
        }
        return sequences;
    }
};

TEST_P(SpecEngineTest, NgramGreedyIsLossless) {
    const int max_tokens = 32;
    auto ngram = make_ngram_drafter(parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":5})"));
    Runner runner(*loaded_->model, *loaded_->backend, pool(512));
    const RunResult run = run_all(runner, {fixture_.prompt}, {1, 4096, 0}, max_tokens, ngram.get());
    EXPECT_EQ(run.tokens[0], plain({fixture_.prompt}, max_tokens)[0]);
    EXPECT_EQ(run.stats.spec_method, "ngram");
    EXPECT_EQ(run.stats.spec.num_accepted_tokens, [&] {
        int64_t sum = 0;
        for (int64_t a : run.stats.spec.accepted_per_position) sum += a;
        return sum;
    }());
}

// Every draft right (chains of k accepted + bonus) or every draft wrong (each rejected at once):
// the tokens cannot tell, and the counters can.
TEST_P(SpecEngineTest, OracleAndAdversarialDraftsAreLossless) {
    const auto prompts = varied_prompts(fixture_, 4);
    const int max_tokens = 20, k = 4;
    const auto expected = plain(prompts, max_tokens);
    for (bool corrupt : {false, true}) {
        ScriptedDrafter drafter(joined(prompts, expected), k, fixture_.vocab, corrupt);
        Runner runner(*loaded_->model, *loaded_->backend, pool(512));
        const RunResult run = run_all(runner, prompts, {4, 4096, 0}, max_tokens, &drafter);
        EXPECT_EQ(run.tokens, expected) << (corrupt ? "adversarial" : "oracle");
        const SpecCounters& spec = run.stats.spec;
        EXPECT_GT(spec.num_drafts, 0);
        if (corrupt) {
            EXPECT_EQ(spec.num_accepted_tokens, 0);
        } else {
            EXPECT_EQ(spec.num_accepted_tokens, spec.num_draft_tokens);
            // 19 tokens after the first, in chains of up to k + 1: about 4 verify steps each.
            EXPECT_GE(spec.mean_acceptance_length(), 3.5);
            EXPECT_LE(run.stats.steps, 4 * 5 + 2);
        }
    }
}

TEST_P(SpecEngineTest, BatchedChunkedPrefillIsLossless) {
    const auto prompts = varied_prompts(fixture_, 5);
    const int max_tokens = 16;
    const auto expected = plain(prompts, max_tokens);
    ScriptedDrafter oracle(joined(prompts, expected), 3, fixture_.vocab, false);
    auto ngram = make_ngram_drafter(parse_speculative_config(R"({"method":"ngram"})"));
    for (Drafter* drafter : {static_cast<Drafter*>(&oracle), ngram.get()}) {
        Runner runner(*loaded_->model, *loaded_->backend, pool(512));
        // A budget of 9 tokens splits prompts into chunks next to other requests' verify chains.
        EXPECT_EQ(run_all(runner, prompts, {5, 9, 0}, max_tokens, drafter).tokens, expected) << drafter->method();
    }
}

// A stop id or max_tokens falling inside an accepted chain ends the request right there.
TEST_P(SpecEngineTest, StopAndMaxTokensInsideAChain) {
    const int max_tokens = 24;
    const auto full = plain({fixture_.prompt}, max_tokens)[0];
    ScriptedDrafter oracle(joined({fixture_.prompt}, {full}), 6, fixture_.vocab, false);
    // Stop at the 7th generated token (the first occurrence of that id).
    const int32_t stop = full[6];
    const auto with_stop = plain({fixture_.prompt}, max_tokens, {stop})[0];
    ASSERT_EQ(with_stop.back(), stop);
    {
        Runner runner(*loaded_->model, *loaded_->backend, pool(512));
        const RunResult run = run_all(runner, {fixture_.prompt}, {1, 4096, 0}, max_tokens, &oracle, {stop});
        EXPECT_EQ(run.tokens[0], with_stop);
        EXPECT_EQ(run.finish_reasons[0], "stop");
    }
    for (int limit : {1, 2, 6, 9}) {
        Runner runner(*loaded_->model, *loaded_->backend, pool(512));
        const RunResult run = run_all(runner, {fixture_.prompt}, {1, 4096, 0}, limit, &oracle);
        EXPECT_EQ(run.tokens[0], std::vector<int32_t>(full.begin(), full.begin() + limit)) << "max_tokens " << limit;
        EXPECT_EQ(run.finish_reasons[0], "length");
    }
}

// A stop string that several accepted drafts complete at once ends the request at the token that
// completed it, with the text cut before it, exactly as without speculation.
TEST_P(SpecEngineTest, StopStringsInsideAChain) {
    const int max_tokens = 24;
    const auto full = plain({fixture_.prompt}, max_tokens)[0];
    TempDir dir;
    const Detokenizer detokenizer = Detokenizer::load(write_byte_level_tokenizer(dir.path(), fixture_.vocab));
    // The stop string: the bytes of generated tokens 8 and 9; expected, the first token whose text
    // completes its first occurrence, and the text before that occurrence.
    SamplingParams sampling;
    sampling.stop = {detokenizer.token_bytes(full[8]) + detokenizer.token_bytes(full[9]), "never appears"};
    ASSERT_FALSE(sampling.stop[0].empty());
    std::string text;
    size_t end = 0;
    for (; end < full.size(); ++end) {
        text += detokenizer.token_bytes(full[end]);
        if (text.find(sampling.stop[0]) != std::string::npos) break;
    }
    ASSERT_LE(end, size_t(9));
    const std::vector<int32_t> expected(full.begin(), full.begin() + end + 1);
    const std::string expected_text = to_valid_utf8(text.substr(0, text.find(sampling.stop[0])));

    auto ngram = make_ngram_drafter(parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":5})"));
    ScriptedDrafter oracle(joined({fixture_.prompt}, {full}), 6, fixture_.vocab, false);
    ScriptedDrafter adversary(joined({fixture_.prompt}, {full}), 6, fixture_.vocab, true);
    for (Drafter* drafter : {static_cast<Drafter*>(nullptr), ngram.get(), static_cast<Drafter*>(&oracle),
                             static_cast<Drafter*>(&adversary)}) {
        Runner runner(*loaded_->model, *loaded_->backend, pool(512));
        const RunResult run =
            run_all(runner, {fixture_.prompt}, {1, 4096, 0}, max_tokens, drafter, {}, sampling, &detokenizer);
        const std::string which = drafter ? drafter->method() : "none";
        EXPECT_EQ(run.tokens[0], expected) << which;
        EXPECT_EQ(run.finish_reasons[0], "stop") << which;
        EXPECT_EQ(run.texts[0], expected_text) << which;
    }
    // Without a stop string the text is the whole continuation's.
    Runner runner(*loaded_->model, *loaded_->backend, pool(512));
    const RunResult run = run_all(runner, {fixture_.prompt}, {1, 4096, 0}, max_tokens, &oracle, {}, {}, &detokenizer);
    EXPECT_EQ(run.texts[0], to_valid_utf8(detokenizer.decode(full)));
    EXPECT_EQ(run.finish_reasons[0], "length");
}

TEST(SpecEngine, StopStringsNeedATokenizer) {
    const Fixture fixture = load_fixture("qwen3_f32");
    LoadedModel loaded(fixture.dir);
    Runner runner(*loaded.model, *loaded.backend, pool(64));
    std::unique_ptr<Engine> engine = make_engine(runner, {1, 4096, 0});
    SamplingParams sampling;
    sampling.stop = {"x"};
    EXPECT_THROW(engine->submit(fixture.prompt, sampling, 4), std::exception);
    TempDir dir;
    const Detokenizer detokenizer = Detokenizer::load(write_byte_level_tokenizer(dir.path(), fixture.vocab));
    std::unique_ptr<Engine> with_tokenizer = make_engine(runner, {1, 4096, 0}, nullptr, &detokenizer);
    sampling.stop = {""};
    EXPECT_THROW(with_tokenizer->submit(fixture.prompt, sampling, 4), std::exception);
}

TEST_P(SpecEngineTest, PrefixCachingAndPreemptionAreLossless) {
    const auto prompts = varied_prompts(fixture_, 4);
    const int max_tokens = 16;
    const auto expected = plain(prompts, max_tokens);
    ScriptedDrafter oracle(joined(prompts, expected), 4, fixture_.vocab, false);
    // Prefix caching: the same prompts twice through one runner; the second pass hits the cache.
    {
        Runner runner(*loaded_->model, *loaded_->backend, pool(512, /*prefix_caching=*/true));
        EXPECT_EQ(run_all(runner, prompts, {4, 4096, 0}, max_tokens, &oracle).tokens, expected);
        const RunResult again = run_all(runner, prompts, {4, 4096, 0}, max_tokens, &oracle);
        EXPECT_EQ(again.tokens, expected);
        EXPECT_GT(again.stats.prefix_hit_tokens, 0);
    }
    // A pool that holds the longest request alone but not all of them: preemption by recompute.
    const KvLayout layout = Runner(*loaded_->model, *loaded_->backend, pool(1)).layout();
    int64_t longest = 0;
    for (const auto& p : prompts) longest = std::max<int64_t>(longest, int64_t(p.size()) + max_tokens);
    const int64_t chunk = 8;
    Runner runner(*loaded_->model, *loaded_->backend, pool(max_pages_per_sequence(layout, longest, chunk) + 1));
    const RunResult run = run_all(runner, prompts, {4, chunk, longest}, max_tokens, &oracle);
    EXPECT_EQ(run.tokens, expected);
    EXPECT_GT(run.stats.preemptions, 0);
}

// A prefix-cache hit leaves a drafter's context_window() prompt tokens to compute, so the drafter
// observes them: the first observed position of a request served from the cache is at most
// prompt length - window (and, with no window, the hit is as long as the cache allows).
TEST_P(SpecEngineTest, PrefixCacheHitLeavesTheDraftersWindow) {
    class Recording final : public Drafter {
    public:
        explicit Recording(int64_t window) : window_(window) {}
        const char* method() const override { return "recording"; }
        int num_speculative_tokens() const override { return 2; }
        int64_t context_window() const override { return window_; }
        std::vector<int> feature_layers() const override { return {kFinalNormFeature}; }
        void observe(const TargetHidden& hidden) override {
            for (const TargetHidden::Sequence& s : hidden.sequences)
                if (!first_.count(s.seq)) first_[s.seq] = s.start_position;
        }
        std::vector<std::vector<int32_t>> propose(std::span<const DraftRequest> requests) override {
            return std::vector<std::vector<int32_t>>(requests.size());
        }
        std::map<int, int64_t> first_;  // seq → first observed position (kept after release)

    private:
        int64_t window_;
    };
    std::vector<int32_t> prompt;
    while (prompt.size() < 61) prompt.insert(prompt.end(), fixture_.prompt.begin(), fixture_.prompt.end());
    prompt.resize(61);
    const int64_t window = 20;
    for (int64_t drafter_window : {int64_t(0), window}) {
        Recording drafter(drafter_window);
        RunnerOptions options = pool(512, /*prefix_caching=*/true);
        options.feature_layers = drafter.feature_layers();
        Runner runner(*loaded_->model, *loaded_->backend, options);
        run_all(runner, {prompt}, {1, 4096, 0}, 4, &drafter);  // warms the cache (request id 1)
        std::unique_ptr<Engine> engine = make_engine(runner, {1, 4096, 0}, &drafter);
        const uint64_t id = engine->submit(prompt, {}, 1);  // id 1 again in a new engine: forget the first
        drafter.first_.clear();
        engine->step();  // the prefill: the drafter's first observation of this request
        const int64_t hit = engine->stats().prefix_hit_tokens;
        ASSERT_GT(hit, 0) << "no prefix-cache hit to hold back from";
        ASSERT_TRUE(drafter.first_.count(int(id)));
        EXPECT_EQ(drafter.first_.at(int(id)), hit);  // the drafter sees exactly what was computed
        if (drafter_window > 0) EXPECT_LE(hit, int64_t(prompt.size()) - window);
        else EXPECT_GT(hit, int64_t(prompt.size()) - window) << "the control: without a window the hit is longer";
        while (engine->has_work()) engine->step();
    }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SpecEngineTest,
                         ::testing::Values("qwen3_f32", "qwen3_moe_f32", "mimo_native_f32", "mimo_hub_f32",
                                           "mimo_hub_fp8"));

// Sampling at temperature 0.7: the second generated token (the first one a verify step emits)
// has the same distribution with speculation as without. 1,500 seeded requests each; the
// drafter always proposes the most frequent plain-run token, so acceptance and rejection both
// happen often. Two-sample chi-square over tokens seen ≥ 20 times in the pooled runs (the rest
// pooled into one cell); the bound is the p = 1e-4 critical value for the degrees of freedom.
TEST(SpecSampling, TemperatureSamplingKeepsTheDistribution) {
    const Fixture fixture = load_fixture("qwen3_f32");
    LoadedModel loaded(fixture.dir);
    const std::vector<int32_t> prompt(fixture.prompt.begin(), fixture.prompt.begin() + 12);
    const int n = 1500;
    SamplingParams sampling;
    sampling.temperature = 0.7f;
    auto second_tokens = [&](Drafter* drafter, uint64_t seed_base) {
        Runner runner(*loaded.model, *loaded.backend, pool(4096));
        std::vector<std::vector<int32_t>> prompts(n, prompt);
        SamplingParams s = sampling;
        s.seed = seed_base;
        const RunResult run = run_all(runner, prompts, {64, 4096, 0}, 3, drafter, {}, s);
        std::map<int32_t, int64_t> counts;
        for (const auto& t : run.tokens) ++counts[t.at(1)];
        return std::make_pair(counts, run.stats.spec);
    };
    const auto [plain_counts, unused] = second_tokens(nullptr, 1);
    int32_t common = plain_counts.begin()->first;
    for (const auto& [token, count] : plain_counts)
        if (count > plain_counts.at(common)) common = token;
    // Propose `common` twice, whatever the context.
    class Constant final : public Drafter {
    public:
        explicit Constant(int32_t token) : token_(token) {}
        const char* method() const override { return "constant"; }
        int num_speculative_tokens() const override { return 2; }
        std::vector<std::vector<int32_t>> propose(std::span<const DraftRequest> requests) override {
            return std::vector<std::vector<int32_t>>(requests.size(), std::vector<int32_t>(2, token_));
        }

    private:
        int32_t token_;
    } constant(common);
    const auto [spec_counts, spec] = second_tokens(&constant, 100000);
    EXPECT_GT(spec.num_accepted_tokens, 100);
    EXPECT_LT(spec.num_accepted_tokens, spec.num_draft_tokens);

    std::map<int32_t, std::pair<int64_t, int64_t>> cells;  // token → (plain, spec)
    for (const auto& [t, c] : plain_counts) cells[t].first += c;
    for (const auto& [t, c] : spec_counts) cells[t].second += c;
    std::vector<std::pair<double, double>> table;
    std::pair<double, double> rest{0, 0};
    for (const auto& [t, c] : cells) {
        if (c.first + c.second >= 20) table.push_back({double(c.first), double(c.second)});
        else rest.first += double(c.first), rest.second += double(c.second);
    }
    table.push_back(rest);
    double chi2 = 0;
    for (const auto& [a, b] : table) {
        if (a + b == 0) continue;
        const double expected = (a + b) / 2;  // equal sample sizes
        chi2 += (a - expected) * (a - expected) / expected + (b - expected) * (b - expected) / expected;
    }
    const double df = double(table.size() - 1);
    // Wilson–Hilferty approximation of the chi-square quantile at p = 1e-4 (z = 3.719).
    const double bound = df * std::pow(1 - 2 / (9 * df) + 3.719 * std::sqrt(2 / (9 * df)), 3);
    EXPECT_LT(chi2, bound) << table.size() << " cells";
}

}  // namespace
}  // namespace xinfer::test
