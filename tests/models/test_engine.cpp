// Serving-core equivalences on the golden fixtures (CPU, greedy): the Engine's batching,
// chunked prefill, prefix cache and preemption must not change a single token, and no request
// is ever dropped or leaks a KV page.
#include "model_test_util.h"
#include "runtime/engine_impl.h"
#include "runtime/generate.h"
#include "runtime/memory_plan.h"

#include <map>
#include <random>
#include <set>

namespace xinfer::test {
namespace {


RunnerOptions pool(int64_t n_pages, bool prefix_caching = false) {
    RunnerOptions options;
    options.page_size = 4;  // small pages: sequences span many, windows end mid-page
    options.n_pages = n_pages;
    options.enable_prefix_caching = prefix_caching;
    return options;
}

// Runs every prompt to completion through one engine; returns generated tokens per prompt.
std::vector<std::vector<int32_t>> run_all(Runner& runner, const std::vector<std::vector<int32_t>>& prompts,
                                          SchedulerOptions options, int max_tokens, EngineStats* stats = nullptr) {
    std::unique_ptr<Engine> engine = make_engine(runner, options);
    std::map<uint64_t, size_t> index;
    for (size_t i = 0; i < prompts.size(); ++i) index[engine->submit(prompts[i], {}, max_tokens)] = i;
    std::vector<std::vector<int32_t>> tokens(prompts.size());
    size_t finished = 0;
    while (engine->has_work()) {
        for (const RequestOutput& out : engine->step()) {
            auto& t = tokens[index.at(out.id)];
            t.insert(t.end(), out.new_tokens.begin(), out.new_tokens.end());
            if (out.finished) {
                EXPECT_EQ(out.finish_reason, "length");
                ++finished;
            }
        }
        runner.kv().check_integrity();
    }
    EXPECT_EQ(finished, prompts.size());
    if (stats) *stats = engine->stats();
    return tokens;
}

class EngineTest : public FixtureModelTest {
protected:
    std::vector<std::vector<int32_t>> alone(const std::vector<std::vector<int32_t>>& prompts, int max_tokens) {
        std::vector<std::vector<int32_t>> result;
        for (const auto& p : prompts) {
            Runner runner(*loaded_->model, *loaded_->backend, pool(512));
            result.push_back(run_all(runner, {p}, {1, 4096, 0}, max_tokens)[0]);
        }
        return result;
    }
};

TEST_P(EngineTest, BatchedEqualsAlone) {
    const auto prompts = varied_prompts(fixture_, 5);
    Runner runner(*loaded_->model, *loaded_->backend, pool(512));
    EngineStats stats;
    const auto together = run_all(runner, prompts, {8, 4096, 0}, 10, &stats);
    EXPECT_EQ(together, alone(prompts, 10));
    EXPECT_EQ(stats.preemptions, 0);
    EXPECT_EQ(runner.kv().free_pages(), runner.kv().n_pages());
}

// Sampled requests pick their tokens on the device (Runner::sample_rows) yet draw exactly what
// the host Sampler draws from the same logits and the same seeded stream: a batch of three
// sampled requests and a greedy one through the engine against a one-sequence loop of
// Runner::step + Sampler::sample. Different settings per request, so each row takes its own parameters.
TEST_P(EngineTest, SampledTokensEqualTheHostSampler) {
    const auto prompts = varied_prompts(fixture_, 4);
    // The last one is greedy: its rows take the argmax inside the same SAMPLE op.
    const SamplingParams settings[] = {{0.8f, 1.f, 0, 11, {}}, {1.3f, 0.9f, 0, 12, {}}, {1.5f, 1.f, 5, 13, {}}, {0.f, 1.f, 0, 14, {}}};
    constexpr int kTokens = 10;
    Runner runner(*loaded_->model, *loaded_->backend, pool(512));
    std::unique_ptr<Engine> engine = make_engine(runner, {8, 4096, 0});
    std::map<uint64_t, size_t> index;
    for (size_t i = 0; i < prompts.size(); ++i) index[engine->submit(prompts[i], settings[i], kTokens)] = i;
    std::vector<std::vector<int32_t>> engine_tokens(prompts.size());
    while (engine->has_work())
        for (const RequestOutput& out : engine->step()) {
            auto& t = engine_tokens[index.at(out.id)];
            t.insert(t.end(), out.new_tokens.begin(), out.new_tokens.end());
        }
    for (size_t i = 0; i < prompts.size(); ++i) {
        Runner reference(*loaded_->model, *loaded_->backend, pool(512));
        Sampler sampler(settings[i]);
        std::vector<int32_t> tokens;
        SequenceChunk chunk{0, 0, prompts[i], false};
        std::vector<float> logits = reference.step(std::span(&chunk, 1));
        for (int n = 0; n < kTokens; ++n) {
            tokens.push_back(sampler.sample(logits));
            if (n + 1 == kTokens) break;
            chunk = {0, int64_t(prompts[i].size()) + n, std::span(tokens).last(1), false};
            logits = reference.step(std::span(&chunk, 1));
        }
        EXPECT_EQ(engine_tokens[i], tokens) << "request " << i;
        if (settings[i].temperature > 0.f) {
            EXPECT_GE(std::set<int32_t>(tokens.begin(), tokens.end()).size(), 3u) << "request " << i << " barely sampled";
        }
    }
}

// The expert census (Engine::set_expert_census) counts, per MoE layer and step, the distinct
// experts the step's tokens chose: a decode step of one sequence touches exactly top_k per layer,
// and so does a step of two identical sequences (same inputs, same routing), while two different
// sequences touch between top_k and 2·top_k. Off, nothing is counted; a dense model counts nothing.
TEST_P(EngineTest, ExpertCensusCountsDistinctExperts) {
    const ModelConfig& config = loaded_->model->config();
    int64_t moe_layers = 0;
    for (const LayerSpec& l : config.layers) moe_layers += l.ffn == FfnKind::moe;
    const int64_t k = config.router.top_k;
    Runner runner(*loaded_->model, *loaded_->backend, pool(512));
    std::unique_ptr<Engine> engine = make_engine(runner, {8, 4096, 0});
    // Per decode step: (layer-steps, distinct experts) counted; `prompts` decode together.
    auto census = [&](const std::vector<std::vector<int32_t>>& prompts, bool on) {
        engine->set_expert_census(on);
        for (const auto& p : prompts) engine->submit(p, {}, 4);
        engine->step();  // the prefills
        std::vector<std::pair<int64_t, int64_t>> steps;
        while (engine->has_work()) {
            const EngineStats before = engine->stats();
            engine->step();
            const EngineStats after = engine->stats();
            steps.push_back({after.census_moe_layer_steps - before.census_moe_layer_steps,
                             after.census_distinct_experts - before.census_distinct_experts});
        }
        return steps;
    };
    const std::vector<int32_t> a = fixture_.prompt, b = varied_prompts(fixture_, 3)[1];
    for (const auto& [layers, distinct] : census({a}, true)) {
        EXPECT_EQ(layers, moe_layers);
        EXPECT_EQ(distinct, moe_layers * k);
    }
    for (const auto& [layers, distinct] : census({a, a}, true)) {
        EXPECT_EQ(layers, moe_layers);
        EXPECT_EQ(distinct, moe_layers * k) << "identical sequences route alike";
    }
    for (const auto& [layers, distinct] : census({a, b}, true)) {
        EXPECT_EQ(layers, moe_layers);
        EXPECT_GE(distinct, moe_layers * k);
        EXPECT_LE(distinct, moe_layers * 2 * k);
    }
    for (const auto& [layers, distinct] : census({a}, false)) EXPECT_EQ(layers + distinct, 0);
}

// A token budget of 7 splits every prompt into chunks (mixed with other requests' decodes).
TEST_P(EngineTest, ChunkedPrefillEqualsOneShot) {
    const auto prompts = varied_prompts(fixture_, 3);
    Runner runner(*loaded_->model, *loaded_->backend, pool(512));
    EXPECT_EQ(run_all(runner, prompts, {3, 7, 0}, 8), run_all(runner, prompts, {3, 4096, 0}, 8));
}

// The fixture's greedy reference through the engine with chunked prefill.
TEST_P(EngineTest, ChunkedGreedyMatchesReference) {
    const size_t decidable = decidable_greedy_steps(fixture_);
    Runner runner(*loaded_->model, *loaded_->backend, pool(512));
    const auto tokens = run_all(runner, {fixture_.prompt}, {2, 5, 0}, int(decidable))[0];
    EXPECT_EQ(tokens, std::vector<int32_t>(fixture_.greedy.begin(), fixture_.greedy.begin() + long(decidable)));
}

// A warm prefix-cache hit computes only the suffix, yet gives the cold run's logits and tokens.
TEST_P(EngineTest, PrefixCacheHitEqualsColdRun) {
    Runner runner(*loaded_->model, *loaded_->backend, pool(512, /*prefix_caching=*/true));
    const int64_t block = runner.layout().block_tokens();
    std::vector<int32_t> prompt;
    while (int64_t(prompt.size()) < 2 * block + 3)
        prompt.insert(prompt.end(), fixture_.prompt.begin(), fixture_.prompt.end());
    prompt.resize(size_t(2 * block + 3));

    const size_t vocab = size_t(fixture_.vocab);
    const std::vector<float> cold = prompt_logits(runner, prompt);  // seq 0, commits every page
    runner.kv().check_integrity();
    // Warm: a new sequence attaches the cached prefix and computes only the rest.
    KvCacheManager& kv = runner.kv();
    const int64_t reused = kv.add_sequence(7, prompt);
    ASSERT_EQ(reused, 2 * block) << "block " << block;
    ASSERT_TRUE(kv.allocate(7, int64_t(prompt.size())));
    const SequenceChunk rest{7, reused, std::span(prompt).subspan(size_t(reused)), true};
    const std::vector<float> warm = runner.forward(std::span(&rest, 1));
    kv.commit(7, prompt, int64_t(prompt.size()));
    kv.free_sequence(7);
    const std::vector<float> cold_rest(cold.begin() + long(size_t(reused) * vocab), cold.end());
    EXPECT_LE(relative_error(warm.data(), cold_rest.data(), warm.size()), 1e-5);

    // Through the engine: the second identical request hits the cache and generates the same.
    EngineStats stats;
    const auto first = run_all(runner, {prompt}, {2, 4096, 0}, 6);
    const auto second = run_all(runner, {prompt}, {2, 4096, 0}, 6, &stats);
    EXPECT_EQ(first, second);
    EXPECT_GE(stats.prefix_hit_tokens, 2 * block);
    runner.kv().check_integrity();
}

// A pool too small for every request at once forces preemption by recompute; tokens are those
// of uninterrupted runs.
TEST_P(EngineTest, PreemptedAndResumedEqualsUninterrupted) {
    const auto prompts = varied_prompts(fixture_, 4);
    const int max_tokens = 16;
    // Enough for the longest request alone (with its prefill chunk), not for all of them.
    const KvLayout layout = Runner(*loaded_->model, *loaded_->backend, pool(1)).layout();
    int64_t longest = 0;
    for (const auto& p : prompts) longest = std::max<int64_t>(longest, int64_t(p.size()) + max_tokens);
    const int64_t chunk = 8;
    const int64_t pages = max_pages_per_sequence(layout, longest, chunk);
    Runner runner(*loaded_->model, *loaded_->backend, pool(pages + 1));
    EngineStats stats;
    const auto tokens = run_all(runner, prompts, {4, chunk, longest}, max_tokens, &stats);
    EXPECT_GT(stats.preemptions, 0) << "pool of " << pages + 1 << " pages did not force preemption";
    EXPECT_EQ(tokens, alone(prompts, max_tokens));
    EXPECT_EQ(runner.kv().free_pages(), runner.kv().n_pages());
}

TEST_P(EngineTest, AbortFreesEveryPage) {
    Runner runner(*loaded_->model, *loaded_->backend, pool(256, /*prefix_caching=*/false));
    std::unique_ptr<Engine> engine = make_engine(runner, {4, 16, 0});
    std::vector<std::string> reasons;
    const uint64_t a = engine->submit(fixture_.prompt, {}, 50, {}, [&](const RequestOutput& out) {
        if (out.finished) reasons.push_back(out.finish_reason);
    });
    const uint64_t b = engine->submit(varied_prompts(fixture_, 2)[0], {}, 50);
    for (int i = 0; i < 6; ++i) engine->step();
    EXPECT_LT(runner.kv().free_pages(), runner.kv().n_pages());
    EXPECT_TRUE(engine->abort(a));
    EXPECT_TRUE(engine->abort(b));
    EXPECT_FALSE(engine->abort(a));
    EXPECT_EQ(runner.kv().free_pages(), runner.kv().n_pages());
    runner.kv().check_integrity();
    EXPECT_EQ(reasons, std::vector<std::string>{"abort"});
    const auto events = engine->step();  // the abort events are also returned once
    EXPECT_EQ(events.size(), 2u);
    EXPECT_FALSE(engine->has_work());
}

// Thousands of steps of random submits and aborts over a small pool with prefix caching:
// integrity after every step, and every request ends exactly once (length, stop or abort).
TEST_P(EngineTest, RandomizedSubmitAbortNeverDrops) {
    const int64_t max_len = 40;
    const KvLayout layout = Runner(*loaded_->model, *loaded_->backend, pool(1)).layout();
    // Room for one longest request and a little more: preemption is routine.
    Runner runner(*loaded_->model, *loaded_->backend, pool(max_pages_per_sequence(layout, max_len, 12) + 2, true));
    std::unique_ptr<Engine> engine = make_engine(runner, {6, 12, max_len});
    std::mt19937 rng(1234);
    std::map<uint64_t, int> ends;  // id → finished events seen
    std::vector<uint64_t> live;
    int submitted = 0;
    for (int step = 0; step < 400 || engine->has_work(); ++step) {
        ASSERT_LT(step, 5000) << "engine does not drain";
        if (step < 400 && rng() % 3 == 0) {
            std::vector<int32_t> prompt(fixture_.prompt.begin(), fixture_.prompt.begin() + long(1 + rng() % 24));
            if (rng() % 2) prompt.back() = int32_t(rng() % 100);  // some share prefixes, some do not
            const uint64_t id = engine->submit(prompt, {}, int(1 + rng() % 20), {int32_t(rng() % 512)});
            ends[id] = 0;
            live.push_back(id);
            ++submitted;
        }
        if (step < 400 && !live.empty() && rng() % 11 == 0) engine->abort(live[rng() % live.size()]);
        for (const RequestOutput& out : engine->step()) {
            ASSERT_TRUE(ends.count(out.id));
            if (out.finished) {
                ++ends[out.id];
                live.erase(std::remove(live.begin(), live.end(), out.id), live.end());
            }
        }
        runner.kv().check_integrity();
    }
    for (const auto& [id, n] : ends) EXPECT_EQ(n, 1) << "request " << id;
    EXPECT_GT(submitted, 50);
    EXPECT_GT(engine->stats().preemptions, 0);
    EXPECT_EQ(runner.kv().free_pages(), runner.kv().n_pages());
    std::cout << "[ engine   ] " << submitted << " requests, " << engine->stats().preemptions << " preemptions, "
              << engine->stats().prefix_hit_tokens << " prefix-hit tokens\n";
}

// The CPU backend with asynchronous downloads as a stream would do them: download_async takes its
// snapshot now (everything queued before it has run: CPU ops are synchronous) and hands it over
// at wait_downloads. Overlapped decode then runs here exactly as on CUDA, the queued step
// computed before the host reads the previous step's ids.
struct PendingCopy {
    void* dst;
    std::vector<char> bytes;
};
std::vector<PendingCopy> g_pending_copies;

int snapshot_download(void*, void* dst, const void* src, size_t bytes) {
    const char* from = static_cast<const char*>(src);
    g_pending_copies.push_back({dst, std::vector<char>(from, from + bytes)});
    return XINFER_OK;
}

int deliver_downloads(void*) {
    for (const PendingCopy& copy : g_pending_copies) std::copy(copy.bytes.begin(), copy.bytes.end(), static_cast<char*>(copy.dst));
    g_pending_copies.clear();
    return XINFER_OK;
}

const xinfer_backend_api* async_download_cpu_api() {
    static xinfer_backend_api api = [] {
        xinfer_backend_api a = *cpu_backend_api();
        a.download_async = snapshot_download;
        a.wait_downloads = deliver_downloads;
        return a;
    }();
    return &api;
}

struct EngineRun {
    std::map<uint64_t, std::vector<int32_t>> tokens;
    std::map<uint64_t, std::string> finish;
    EngineStats stats;
};

// Overlapped decode changes when the device computes a step, never what it computes: requests
// that stop on a stop id (their row of the queued step thrown away), on max_tokens, sampled
// ones, an abort while a step is queued, and requests arriving mid-run give the tokens, finish
// reasons and step count of the same engine without overlap; every page comes back.
TEST_P(EngineTest, OverlappedDecodeEqualsStepByStep) {
    std::unique_ptr<LoadedModel> async_cpu;
    Model* model = loaded_->model.get();
    Backend* backend = loaded_->backend.get();
    if (!backend->has_async_downloads()) {  // the CPU: load the fixture onto the wrapped backend
        async_cpu = std::make_unique<LoadedModel>();
        async_cpu->backend = std::make_unique<Backend>(async_download_cpu_api(), 0, "cpu-async");
        async_cpu->checkpoint = Checkpoint::open(fixture_.dir);
        async_cpu->model = load_model(*async_cpu->checkpoint, *async_cpu->backend, LoadedModel::env_options());
        model = async_cpu->model.get();
        backend = async_cpu->backend.get();
    }
    const auto prompts = varied_prompts(fixture_, 5);
    const auto run = [&](bool overlap, const std::vector<int32_t>& stop_ids) {
        Runner runner(*model, *backend, pool(512));
        std::unique_ptr<Engine> engine = make_engine(runner, {8, 4096, 0});
        engine->set_overlap_decode(overlap);
        EngineRun result;
        const int max_tokens[] = {12, 3, 16, 9, 14};
        std::vector<uint64_t> ids;
        for (size_t i = 0; i < 4; ++i) {
            SamplingParams sampling;
            if (i == 3) sampling = {0.9f, 1.f, 0, 21, {}};  // one sampled request
            ids.push_back(engine->submit(prompts[i], sampling, max_tokens[i], i == 2 ? stop_ids : std::vector<int32_t>{}));
        }
        for (int step = 0; engine->has_work(); ++step) {
            if (step == 10) ids.push_back(engine->submit(prompts[4], {}, max_tokens[4]));  // arrives mid-run
            if (step == 8) engine->abort(ids[0]);  // a step is queued for it by now
            for (const RequestOutput& out : engine->step()) {
                auto& t = result.tokens[out.id];
                t.insert(t.end(), out.new_tokens.begin(), out.new_tokens.end());
                if (out.finished) result.finish[out.id] = out.finish_reason;
            }
            runner.kv().check_integrity();
        }
        result.stats = engine->stats();
        EXPECT_EQ(runner.kv().free_pages(), runner.kv().n_pages());
        return result;
    };
    // Request 2 stops on its sixth token, which no length limit predicts.
    const EngineRun plain = run(false, {});
    const std::vector<int32_t>& third = plain.tokens.at(3);
    ASSERT_GE(third.size(), 6u);
    const std::vector<int32_t> stop = {third[5]};
    const EngineRun reference = run(false, stop), overlapped = run(true, stop);
    EXPECT_EQ(overlapped.tokens, reference.tokens);
    EXPECT_EQ(overlapped.finish, reference.finish);
    EXPECT_EQ(reference.finish.at(3), "stop");
    EXPECT_EQ(reference.finish.at(1), "abort");
    // A request arriving while a step is queued is admitted one step later.
    EXPECT_LE(overlapped.stats.steps, reference.stats.steps + 1);
    EXPECT_EQ(reference.stats.overlapped_steps, 0);
    EXPECT_GE(overlapped.stats.overlapped_steps, 4);
    // The stop or the abort falls inside a run of queued steps (which ones depends on the
    // fixture's prompts: a step that finishes a request by length, or follows a dropped row or an
    // admission, is not queued).
    EXPECT_GE(overlapped.stats.overlap_wasted_rows, 1);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EngineTest, ::testing::Values("mimo_hub_f32", "qwen3_f32"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace xinfer::test
