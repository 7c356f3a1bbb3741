// The MTP drafter (src/spec/mtp.h) against the float64 reference of scripts/gen_mtp_fixture.py
// (tests/fixtures/mimo_mtp_f32: the tiny MiMo target + 3 random MTP blocks), on the CPU backend in
// f32, and greedy speculation with it through the Engine against greedy without it.
//
// Tolerances: head-0 logits within 1e-4 relative (max|a−b| / max|b| over the rows of a step; the
// f32 path measures ~1e-6: the target's hidden feeds one f32 block); drafts must equal the
// reference wherever the reference's top-1/top-2 margin of that draft and every earlier draft
// of its chain is ≥ 1e-2 (a chain stops being decidable at its first near-tie).
#include "models/fixture.h"
#include "runtime/engine_impl.h"
#include "runtime/runner.h"
#include "spec/mtp.h"

#include <map>

namespace xinfer::test {
namespace {

constexpr double kLogitTolerance = 1e-4;
constexpr double kDecidableMargin = 1e-2;

struct MtpReference {
    std::vector<int32_t> sequence;               // prompt + target greedy continuation
    int64_t n_positions = 0;                     // positions with a target hidden (0..n-1)
    std::vector<std::vector<int32_t>> drafts;    // [anchor P] d0, d1, d2
    std::vector<std::vector<double>> margins;    // [anchor P]
    std::vector<float> head0_logits;             // [n_positions, vocab]
    int64_t vocab = 0;
};

MtpReference load_reference() {
    MtpReference r;
    const std::filesystem::path dir = fixture_dir("mimo_mtp_f32");
    std::ifstream in(dir / "reference_mtp.json");
    if (!in) throw std::runtime_error("missing " + (dir / "reference_mtp.json").string());
    const nlohmann::json json = nlohmann::json::parse(in);
    r.sequence = json.at("sequence_ids").get<std::vector<int32_t>>();
    r.n_positions = json.at("n_positions").get<int64_t>();
    r.drafts = json.at("chain_drafts").get<std::vector<std::vector<int32_t>>>();
    r.margins = json.at("chain_margins").get<std::vector<std::vector<double>>>();
    auto file = SafetensorsFile::open(dir / "reference_mtp.safetensors");
    for (const TensorInfo& t : file->tensors()) {
        if (t.name != "head0_logits") continue;
        r.vocab = t.shape[1];
        r.head0_logits.resize(size_t(t.numel()));
        std::memcpy(r.head0_logits.data(), t.data, t.nbytes);
    }
    if (r.head0_logits.empty()) throw std::runtime_error("no head0_logits in reference_mtp.safetensors");
    return r;
}

// The leading drafts of reference chain P that are decidable (see the header comment).
size_t decidable_drafts(const MtpReference& r, size_t P) {
    size_t n = 0;
    while (n < r.margins[P].size() && r.margins[P][n] >= kDecidableMargin) ++n;
    return n;
}

struct Target {
    std::unique_ptr<Backend> backend = make_backend("cpu");
    std::unique_ptr<Checkpoint> checkpoint;
    std::unique_ptr<Model> model;
    std::filesystem::path dir;
    explicit Target(const std::string& name) : dir(fixture_dir(name)) {
        checkpoint = Checkpoint::open(dir);
        model = load_model(*checkpoint, *backend);
    }
    std::unique_ptr<MtpDrafter> drafter(int k, int max_seqs = 4, bool dummy = false) {
        SpeculativeConfig config;
        config.method = "mtp";
        config.num_speculative_tokens = k;
        return std::make_unique<MtpDrafter>(config,
                                            DrafterContext{*model, *backend, dir.string(), dummy, max_seqs, 4096});
    }
    Runner runner(int64_t n_pages = 512) {
        RunnerOptions options;
        options.page_size = 4;
        options.n_pages = n_pages;
        options.feature_layers = {kFinalNormFeature};
        return Runner(*model, *backend, options);
    }
};

// Runs the target over tokens [start, end) of `seq` (one chunk per sequence, one step) and lets
// the drafter observe it; tokens[end] is the "sampled" token each sequence's TargetHidden sees.
void step_and_observe(Runner& runner, Drafter& drafter, const std::vector<int>& seqs,
                      const std::vector<std::vector<int32_t>>& tokens, const std::vector<int64_t>& starts,
                      const std::vector<int64_t>& ends) {
    std::vector<SequenceChunk> chunks;
    for (size_t i = 0; i < seqs.size(); ++i)
        chunks.push_back({seqs[i], starts[i],
                          std::span(tokens[i]).subspan(size_t(starts[i]), size_t(ends[i] - starts[i])), false});
    runner.step(chunks);
    TargetHidden hidden;
    hidden.features = runner.features();
    int64_t row = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
        hidden.sequences.push_back(
            {seqs[i], row, starts[i], ends[i] - starts[i], std::span(tokens[i]).first(size_t(ends[i] + 1))});
        row += ends[i] - starts[i];
    }
    drafter.observe(hidden);
}

TEST(MtpDrafter, Head0LogitsAndDraftChainsMatchReference) {
    const MtpReference ref = load_reference();
    Target target("mimo_mtp_f32");
    auto drafter = target.drafter(3);
    EXPECT_EQ(drafter->num_speculative_tokens(), 3);
    EXPECT_EQ(drafter->feature_layers(), std::vector<int>{kFinalNormFeature});
    std::vector<float> head0;  // rows of head 0 logits as observed, in position order
    drafter->set_tap([&](std::string_view name, int head, const Tensor& logits) {
        if (name == "mtp_logits" && head == 0)
            head0.insert(head0.end(), logits.as<float>(), logits.as<float>() + logits.numel());
    });
    Runner runner = target.runner();
    // Prefill in two chunks (the second crosses the window), then one position per step.
    std::vector<int64_t> bounds{0, 20, 48};
    for (int64_t p = 49; p <= ref.n_positions; ++p) bounds.push_back(p);
    size_t checked_drafts = 0;
    double worst = 0;
    for (size_t b = 0; b + 1 < bounds.size(); ++b) {
        const int64_t start = bounds[b], end = bounds[b + 1];
        head0.clear();
        step_and_observe(runner, *drafter, {0}, {ref.sequence}, {start}, {end});
        ASSERT_EQ(int64_t(head0.size()), (end - start) * ref.vocab);
        const double err = relative_error(head0.data(), ref.head0_logits.data() + size_t(start * ref.vocab),
                                          head0.size());
        worst = std::max(worst, err);
        EXPECT_LE(err, kLogitTolerance) << "head 0 logits at positions " << start << ".." << end - 1;

        // Drafts at anchor `end` (last committed position P = end - 1).
        const size_t P = size_t(end - 1);
        const std::vector<int32_t> prefix(ref.sequence.begin(), ref.sequence.begin() + end + 1);
        const DraftRequest request{0, prefix, 3};
        const std::vector<std::vector<int32_t>> drafts = drafter->propose(std::span(&request, 1));
        ASSERT_EQ(drafts.size(), 1u);
        ASSERT_EQ(drafts[0].size(), 3u) << "anchor " << end;
        const size_t n = decidable_drafts(ref, P);
        for (size_t j = 0; j < n; ++j) EXPECT_EQ(drafts[0][j], ref.drafts[P][j]) << "anchor " << end << " draft " << j;
        checked_drafts += n;
    }
    EXPECT_GE(checked_drafts, 60u);  // most of the 3 × 32 drafts at the decode anchors are decidable
    std::printf("MTP head-0 logits: worst relative error %.3g; %zu reference drafts checked\n", worst, checked_drafts);
}

// Anchors of a short prompt: the chain of 3 exists from the first position on (head k's chain
// starts at position k); early-anchor drafts equal the reference too.
TEST(MtpDrafter, EarlyAnchorsMatchReference) {
    const MtpReference ref = load_reference();
    Target target("mimo_mtp_f32");
    auto drafter = target.drafter(3);
    Runner runner = target.runner();
    for (int64_t p = 0; p < 6; ++p) {
        step_and_observe(runner, *drafter, {0}, {ref.sequence}, {p}, {p + 1});
        const std::vector<int32_t> prefix(ref.sequence.begin(), ref.sequence.begin() + p + 2);
        const DraftRequest request{0, prefix, 3};
        const auto drafts = drafter->propose(std::span(&request, 1));
        ASSERT_EQ(drafts[0].size(), 3u) << "anchor " << p + 1;
        for (size_t j = 0; j < decidable_drafts(ref, size_t(p)); ++j)
            EXPECT_EQ(drafts[0][j], ref.drafts[size_t(p)][j]) << "anchor " << p + 1 << " draft " << j;
    }
}

// Batched observe/propose (sequences of different lengths in one step, fewer drafts asked by one)
// gives each sequence what it gets alone; a drafter that saw the prefix in one chunk agrees with
// one that saw it token by token (proposals depend on committed tokens only).
TEST(MtpDrafter, BatchedAndChunkingInvariant) {
    const MtpReference ref = load_reference();
    Target target("mimo_mtp_f32");
    std::vector<int32_t> other(ref.sequence.rbegin(), ref.sequence.rend());  // a second sequence
    auto batched = target.drafter(3);
    Runner runner = target.runner();
    step_and_observe(runner, *batched, {7, 3}, {ref.sequence, other}, {0, 0}, {30, 45});
    for (int64_t p = 30; p < 40; ++p)
        step_and_observe(runner, *batched, {7, 3}, {ref.sequence, other}, {p, p + 15}, {p + 1, p + 16});
    const std::vector<int32_t> prefix7(ref.sequence.begin(), ref.sequence.begin() + 41);
    const std::vector<int32_t> prefix3(other.begin(), other.begin() + 56);
    const DraftRequest requests[2] = {{7, prefix7, 3}, {3, prefix3, 2}};
    const auto drafts = batched->propose(requests);
    ASSERT_EQ(drafts[0].size(), 3u);
    ASSERT_EQ(drafts[1].size(), 2u);
    for (size_t j = 0; j < decidable_drafts(ref, 39); ++j) EXPECT_EQ(drafts[0][j], ref.drafts[39][j]);

    // Sequence 3 alone, its 55 positions in one chunk.
    auto alone = target.drafter(3);
    Runner runner2 = target.runner();
    step_and_observe(runner2, *alone, {3}, {other}, {0}, {55});
    const DraftRequest request{3, prefix3, 3};
    const auto alone_drafts = alone->propose(std::span(&request, 1));
    ASSERT_EQ(alone_drafts[0].size(), 3u);
    EXPECT_EQ(std::vector<int32_t>(alone_drafts[0].begin(), alone_drafts[0].begin() + 2), drafts[1]);
    // Proposing twice is idempotent (the draft rows were rolled back).
    EXPECT_EQ(alone->propose(std::span(&request, 1)), alone_drafts);

    // Unknown, released or out-of-step sequences get no drafts.
    batched->release(7);
    EXPECT_TRUE(batched->propose(std::span(&requests[0], 1))[0].empty());
    const DraftRequest stale{3, prefix7, 3};  // wrong length for sequence 3
    EXPECT_TRUE(batched->propose(std::span(&stale, 1))[0].empty());
}

// A prompt longer than one observe pass (MtpDrafter::kMaxRowsPerPass) in one chunk: passes and
// the heads' sliding-window page release give the drafts a token-by-token drafter gives.
TEST(MtpDrafter, LongChunkEqualsSmallChunks) {
    Target target("mimo_mtp_f32");
    std::vector<int32_t> tokens;
    for (int i = 0; i < 601; ++i) tokens.push_back(int32_t((i * 7919 + 13) % 509 + 3));
    const int64_t n = 600;
    std::vector<std::vector<int32_t>> results;
    for (int64_t chunk : {n, int64_t(37)}) {
        auto drafter = target.drafter(3, 1);
        Runner runner = target.runner(4096);
        for (int64_t start = 0; start < n; start += chunk)
            step_and_observe(runner, *drafter, {0}, {tokens}, {start}, {std::min(n, start + chunk)});
        const DraftRequest request{0, tokens, 3};
        results.push_back(drafter->propose(std::span(&request, 1))[0]);
    }
    ASSERT_EQ(results[0].size(), 3u);
    EXPECT_EQ(results[0], results[1]);
}

// A sequence first observed mid-context (after a prefix-cache hit the target runs only the tail)
// drafts exactly what a drafter that saw it from position 0 drafts, once context_window()
// positions are observed (3 heads × window 8). A start inside that window still yields a whole
// chain (here a different one).
TEST(MtpDrafter, MidContextStartMatchesAFullObservation) {
    Target target("mimo_mtp_f32");
    std::vector<int32_t> tokens;
    for (int i = 0; i < 201; ++i) tokens.push_back(int32_t((i * 7919 + 13) % 509 + 3));
    const int64_t n = 200;
    auto full = target.drafter(3, 1);
    ASSERT_EQ(full->context_window(), 24);
    std::vector<std::vector<int32_t>> drafts;
    for (int64_t start : {int64_t(0), n - 24, n - 40, n - 5}) {
        auto drafter = target.drafter(3, 1);
        Runner runner = target.runner(1024);
        if (start > 0) {  // the target's cached prefix: run, but not observed by the drafter
            std::vector<SequenceChunk> chunk{{0, 0, std::span(tokens).first(size_t(start)), false}};
            runner.step(chunk);
        }
        step_and_observe(runner, *drafter, {0}, {tokens}, {start}, {n});
        const DraftRequest request{0, std::vector<int32_t>(tokens.begin(), tokens.begin() + n + 1), 3};
        drafts.push_back(drafter->propose(std::span(&request, 1))[0]);
        ASSERT_EQ(drafts.back().size(), 3u) << "start " << start;
    }
    EXPECT_EQ(drafts[1], drafts[0]) << "started context_window() positions before the anchor";
    EXPECT_EQ(drafts[2], drafts[0]) << "started 40 positions before the anchor";
    // The control that makes the equalities above mean something: 5 observed positions are too
    // few for these heads (their windows reach 24 back), and the chain differs.
    EXPECT_NE(drafts[3], drafts[0]) << "started 5 positions before the anchor";
}

TEST(MtpDrafter, ClearErrors) {
    {
        Target target("mimo_native_f32");  // same target, no MTP tensors
        try {
            target.drafter(1);
            FAIL() << "expected an error";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("no MTP heads"), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("mimo_native_f32"), std::string::npos) << e.what();
        }
    }
    Target target("mimo_hub_f32");  // one MTP block
    EXPECT_EQ(target.drafter(0)->num_speculative_tokens(), 1);  // 0: all the checkpoint's heads
    try {
        target.drafter(3);
        FAIL() << "expected an error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("exceeds the 1 MTP head"), std::string::npos) << e.what();
    }
}

TEST(MtpDrafter, DummyWeightsRun) {
    Target target("mimo_native_f32");  // dummy: no MTP tensors needed, MiMo's 3 heads assumed
    auto drafter = target.drafter(0, 2, true);
    EXPECT_EQ(drafter->num_speculative_tokens(), 3);
    const MtpReference ref = load_reference();
    Runner runner = target.runner();
    step_and_observe(runner, *drafter, {0}, {ref.sequence}, {0}, {20});
    const std::vector<int32_t> prefix(ref.sequence.begin(), ref.sequence.begin() + 21);
    const DraftRequest request{0, prefix, 3};
    const auto drafts = drafter->propose(std::span(&request, 1));
    ASSERT_EQ(drafts[0].size(), 3u);
    for (int32_t d : drafts[0]) EXPECT_TRUE(d >= 0 && d < ref.vocab);
}

}  // namespace
}  // namespace xinfer::test
