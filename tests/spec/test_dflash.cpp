// DFlash drafter unit tests on the CPU backend: both config dialects, per-layer causality and
// windows, malformed checkpoints (errors name the file and the field or tensor), the
// mask-embedding sidecar in both formats, symmetric per-query sliding windows, incremental
// injection and batching invariance, KV bookkeeping, dummy weights, own embedding/lm_head.
#include "dflash_test_util.h"

#include <cmath>
#include <random>

namespace xinfer::test {
namespace {

// ---- helpers --------------------------------------------------------------------------------

nlohmann::json fixture_config(const std::string& fixture) { return read_json(dflash_fixture(fixture) / "config.json"); }

// The z-lab fixture drafter with `patch` merged into its config.json (null deletes a key).
void write_patched_drafter(const TempDir& dir, const std::string& fixture, const nlohmann::json& patch) {
    copy_drafter(fixture, dir.path());
    nlohmann::json config = fixture_config(fixture);
    config.merge_patch(patch);
    write_json(dir.path() / "config.json", config);
}

DFlashConfig config_of(TargetModel& t, const nlohmann::json& patch, const std::string& fixture = "dflash_zlab") {
    TempDir dir;
    nlohmann::json config = fixture_config(fixture);
    config.merge_patch(patch);
    write_json(dir.path() / "config.json", config);
    return read_dflash_config(*Checkpoint::open(dir.path(), false), t.model->config(), false);
}

std::vector<float> random_features(int64_t rows, int64_t cols, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-2.f, 2.f);
    std::vector<float> v(size_t(rows * cols));
    for (float& x : v) x = u(rng);
    return v;
}

std::vector<int32_t> some_tokens(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> t(n);
    for (int32_t& x : t) x = int32_t(rng() % 400);
    return t;
}

int64_t feature_width(const DFlashDrafter& d) {
    return int64_t(d.config().target_layer_ids.size()) * d.config().target_hidden_size;
}

// Observes rows [begin, end) of `features` (row r = position r) for `seq`.
void observe_rows(DFlashDrafter& d, int seq, const std::vector<float>& features, int64_t begin, int64_t end,
                  const std::vector<int32_t>& tokens) {
    const int64_t width = feature_width(d);
    TargetHidden hidden;
    hidden.features = Tensor(const_cast<float*>(features.data()) + begin * width, DType::f32, {end - begin, width});
    hidden.sequences.push_back({seq, 0, begin, end - begin, tokens});
    d.observe(hidden);
}

// Drafts for `seq` whose anchor is tokens[anchor_position]; returns the drafted slots' logits.
std::vector<float> propose_logits(DFlashDrafter& d, int seq, const std::vector<int32_t>& tokens, int64_t anchor_position,
                                  std::vector<int32_t>* drafts = nullptr) {
    DraftRequest request{seq, std::span(tokens).first(size_t(anchor_position + 1)), d.config().block_size - 1};
    std::vector<int32_t> out = d.propose(std::span(&request, 1)).at(0);
    if (drafts) *drafts = out;
    return d.last_logits();
}

// Fresh drafter: observe `n_ctx` rows, propose once; the drafted slots' logits.
std::vector<float> one_shot(TargetModel& t, const std::filesystem::path& dir, const std::vector<float>& features,
                            int64_t n_ctx, const std::vector<int32_t>& tokens) {
    std::unique_ptr<DFlashDrafter> d = make_dflash(t, dir);
    observe_rows(*d, 0, features, 0, n_ctx, tokens);
    return propose_logits(*d, 0, tokens, n_ctx);
}

double max_abs_diff(const float* a, const float* b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
    return m;
}

// ---- configs ----------------------------------------------------------------------------------

TEST(DFlashConfig, ZlabDialect) {
    TargetModel t = load_target();
    std::unique_ptr<DFlashDrafter> d = make_dflash(t, dflash_fixture("dflash_zlab"));
    const DFlashConfig& c = d->config();
    EXPECT_STREQ(d->method(), "dflash");
    EXPECT_EQ(c.block_size, 4);
    EXPECT_EQ(d->num_speculative_tokens(), 3);  // default: block_size - 1
    EXPECT_EQ(d->feature_layers(), (std::vector<int>{0, 2}));
    EXPECT_EQ(c.mask_token_id, 500);
    EXPECT_EQ(c.target_hidden_size, 64);
    EXPECT_EQ(c.head_dim, 16);
    EXPECT_EQ(c.rotary_dim, 16);
    EXPECT_FLOAT_EQ(c.rope_theta, 10000.f);
    ASSERT_EQ(c.layers.size(), 2u);
    for (const DFlashLayerAttention& l : c.layers) {
        EXPECT_EQ(l.window, 0);
        EXPECT_FALSE(l.causal);
    }
    EXPECT_FALSE(c.sinks);
    EXPECT_EQ(c.value_scale, 1.f);
    EXPECT_TRUE(c.mask_embedding.empty());
    EXPECT_EQ(make_dflash(t, dflash_fixture("dflash_zlab"), 2)->num_speculative_tokens(), 2);
}

TEST(DFlashConfig, MimoDialect) {
    TargetModel t = load_target();
    std::unique_ptr<DFlashDrafter> d = make_dflash(t, dflash_fixture("dflash_mimo"));
    const DFlashConfig& c = d->config();
    EXPECT_EQ(c.block_size, 8);
    EXPECT_EQ(d->feature_layers(), (std::vector<int>{1, 3, 4}));
    ASSERT_EQ(c.layers.size(), 2u);
    for (const DFlashLayerAttention& l : c.layers) {
        EXPECT_EQ(l.window, 4);   // use_swa: every layer sliding, window dflash_config.swa_window_size
        EXPECT_FALSE(l.causal);  // and non-causal
    }
    EXPECT_TRUE(c.sinks);
    EXPECT_FLOAT_EQ(c.value_scale, 0.6f);
    EXPECT_EQ(c.mask_embedding.size(), 64u);
    EXPECT_EQ(c.mask_embedding_file.filename(), "mask_embedding.safetensors");
}

// vLLM's _resolve_layer_attention, case by case.
TEST(DFlashConfig, LayerCausalityAndWindows) {
    TargetModel t = load_target();
    const nlohmann::json mixed = {{"layer_types", {"sliding_attention", "full_attention"}}, {"sliding_window", 16}};
    DFlashConfig c = config_of(t, mixed);  // sliding layers causal, full ones not
    EXPECT_EQ(c.layers[0].window, 16);
    EXPECT_TRUE(c.layers[0].causal);
    EXPECT_EQ(c.layers[1].window, 0);
    EXPECT_FALSE(c.layers[1].causal);

    nlohmann::json patch = mixed;
    patch["is_causal"] = false;  // top level overrides everything
    c = config_of(t, patch);
    EXPECT_FALSE(c.layers[0].causal);
    EXPECT_FALSE(c.layers[1].causal);

    patch = mixed;
    patch["dflash_config"] = {{"causal", true}};
    c = config_of(t, patch);
    EXPECT_TRUE(c.layers[0].causal);
    EXPECT_TRUE(c.layers[1].causal);

    patch = mixed;
    patch["is_causal"] = true;
    patch["dflash_config"] = {{"causal", false}};  // is_causal wins over dflash_config.causal
    c = config_of(t, patch);
    EXPECT_TRUE(c.layers[1].causal);

    // use_swa forces SWA on every layer of an all-full layer_types, non-causal; the window
    // comes from swa_window_size before sliding_window.
    c = config_of(t, {{"sliding_window", 9}, {"dflash_config", {{"use_swa", true}, {"swa_window_size", 5}}}});
    for (const DFlashLayerAttention& l : c.layers) {
        EXPECT_EQ(l.window, 5);
        EXPECT_FALSE(l.causal);
    }
    c = config_of(t, {{"layer_types", nullptr}, {"sliding_window", 9}, {"dflash_config", {{"use_swa", true}}}});
    for (const DFlashLayerAttention& l : c.layers) EXPECT_EQ(l.window, 9);

    // target_layer_ids absent: z-lab's build_target_layer_ids (6 target layers, 2 draft layers).
    c = config_of(t, {{"dflash_config", {{"target_layer_ids", nullptr}}}});
    EXPECT_EQ(c.target_layer_ids, (std::vector<int>{1, 3}));
    // mask_token_id at the top level (vLLM also reads it there).
    c = config_of(t, {{"mask_token_id", 7}, {"dflash_config", {{"mask_token_id", nullptr}}}});
    EXPECT_EQ(c.mask_token_id, 7);
}

// Every malformed config names config.json and the field.
TEST(DFlashConfig, MalformedConfigsNameFileAndField) {
    TargetModel t = load_target();
    struct Case {
        nlohmann::json patch;
        std::string field;
        std::string detail;
    };
    const std::vector<Case> cases = {
        {{{"block_size", nullptr}}, "block_size", "missing"},
        {{{"block_size", 1}}, "'block_size'", "found 1"},
        {{{"block_size", 40}}, "'block_size'", "found 40"},
        {{{"dflash_config", {{"target_layer_ids", {0, 6}}}}}, "'dflash_config.target_layer_ids'", "0..5"},
        {{{"dflash_config", {{"target_layer_ids", nlohmann::json::array()}}}}, "'dflash_config.target_layer_ids'", "[]"},
        {{{"dflash_config", {{"target_layer_ids", "0,2"}}}}, "dflash_config.target_layer_ids", "list"},
        {{{"num_target_layers", 48}}, "'num_target_layers'", "48"},
        {{{"dflash_config", {{"mask_token_id", 512}}}}, "'dflash_config.mask_token_id'", "512"},
        {{{"dflash_config", {{"mask_token_id", nullptr}}}}, "dflash_config.mask_token_id", "missing"},
        {{{"dflash_config", "yes"}}, "'dflash_config'", "object"},
        {{{"hidden_size", 32}}, "'hidden_size'", "64"},
        {{{"hidden_size", "64"}}, "'hidden_size'", "\"64\""},
        {{{"vocab_size", 1000}}, "'vocab_size'", "1000"},
        {{{"draft_vocab_size", 100}}, "'draft_vocab_size'", "d2t"},
        {{{"target_hidden_size", 32}}, "'target_hidden_size'", "32"},
        {{{"architectures", {"Qwen3ForCausalLM"}}}, "'architectures'", "Qwen3ForCausalLM"},
        {{{"layer_types", {"full_attention"}}}, "'layer_types'", "expected 2"},
        {{{"layer_types", {"full_attention", "local"}}}, "'layer_types'", "local"},
        {{{"layer_types", {"sliding_attention", "full_attention"}}}, "sliding_window", "no window"},
        {{{"dflash_config", {{"use_swa", true}, {"swa_window_size", 0}}}}, "'dflash_config.swa_window_size'", "0"},
        {{{"num_key_value_heads", 3}}, "'num_key_value_heads'", "3"},
        {{{"attention_bias", true}}, "'attention_bias'", "true"},
        {{{"hidden_act", "gelu"}}, "'hidden_act'", "gelu"},
        {{{"is_neox_style", false}}, "'is_neox_style'", "false"},
        {{{"rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 10000.0}}}}, "rope_parameters", "yarn"},
    };
    for (const Case& c : cases) {
        TempDir dir;
        write_patched_drafter(dir, "dflash_zlab", c.patch);
        const std::string message = error_message([&] { make_dflash(t, dir.path()); });
        SCOPED_TRACE(c.patch.dump());
        EXPECT_CONTAINS(message, (dir.path() / "config.json").string());
        EXPECT_CONTAINS(message, c.field);
        EXPECT_CONTAINS(message, c.detail);
    }
    // num_speculative_tokens beyond block_size - 1.
    const std::string message = error_message([&] { make_dflash(t, dflash_fixture("dflash_zlab"), 4); });
    EXPECT_CONTAINS(message, "num_speculative_tokens 4");
    EXPECT_CONTAINS(message, "block_size - 1 = 3");
    EXPECT_CONTAINS(message, "config.json");
}

// Missing, misshapen, extra and unsupported tensors name the file (or directory) and tensor.
TEST(DFlashConfig, MalformedWeightsNameFileAndTensor) {
    TargetModel t = load_target();
    struct Case {
        std::string fixture;
        std::function<void(HostTensors&)> edit;
        std::string needle;
    };
    const std::vector<Case> cases = {
        {"dflash_zlab", [](HostTensors& h) { h.values.erase("layers.1.mlp.down_proj.weight"); },
         "layers.1.mlp.down_proj.weight"},
        {"dflash_zlab",
         [](HostTensors& h) {
             h.shapes["fc.weight"] = {64, 64};
             h.values["fc.weight"].resize(64 * 64);
         },
         "fc.weight"},
        {"dflash_zlab",
         [](HostTensors& h) {
             h.shapes["layers.0.self_attn.bogus"] = {2};
             h.values["layers.0.self_attn.bogus"] = {1.f, 2.f};
         },
         "layers.0.self_attn.bogus"},
        {"dflash_zlab",
         [](HostTensors& h) {
             h.shapes["d2t"] = {4};
             h.values["d2t"] = {0, 0, 0, 0};
         },
         "d2t"},
        {"dflash_mimo", [](HostTensors& h) { h.values.erase("layers.1.self_attn.attention_sink_bias"); },
         "layers.1.self_attn.attention_sink_bias"},
    };
    for (const Case& c : cases) {
        TempDir dir;
        copy_drafter(c.fixture, dir.path());
        HostTensors h = read_tensors(dir.path() / "model.safetensors");
        c.edit(h);
        write_tensors(dir.path() / "model.safetensors", h);
        const std::string message = error_message([&] { make_dflash(t, dir.path()); });
        SCOPED_TRACE(c.needle);
        EXPECT_CONTAINS(message, dir.path().string());
        EXPECT_CONTAINS(message, c.needle);
    }
    // No weights at all.
    TempDir dir;
    write_json(dir.path() / "config.json", fixture_config("dflash_zlab"));
    EXPECT_CONTAINS(error_message([&] { make_dflash(t, dir.path()); }), "model.safetensors");
    EXPECT_CONTAINS(error_message([&] { make_dflash(t, dir.path() / "nope"); }), "nope");
}

// ---- mask-embedding sidecar -------------------------------------------------------------------

TEST(DFlashSidecar, RawFloatFileEqualsSafetensors) {
    TargetModel t = load_target();
    const std::vector<float> sidecar = read_tensors(dflash_fixture("dflash_mimo") / "mask_embedding.safetensors")
                                           .values.at("mask_embedding");
    ASSERT_EQ(sidecar.size(), 64u);
    TempDir raw;
    copy_drafter("dflash_mimo", raw.path());
    std::filesystem::remove(raw.path() / "mask_embedding.safetensors");
    write_bytes(raw.path() / "mask_embedding.bin",
                std::string(reinterpret_cast<const char*>(sidecar.data()), sidecar.size() * sizeof(float)));

    std::unique_ptr<DFlashDrafter> d = make_dflash(t, raw.path());
    EXPECT_EQ(d->config().mask_embedding, sidecar);
    EXPECT_EQ(d->config().mask_embedding_file.filename(), "mask_embedding.bin");
    const int64_t width = feature_width(*d);
    const std::vector<float> features = random_features(20, width, 1);
    const std::vector<int32_t> tokens = some_tokens(21, 2);
    const std::vector<float> from_raw = one_shot(t, raw.path(), features, 20, tokens);
    const std::vector<float> from_st = one_shot(t, dflash_fixture("dflash_mimo"), features, 20, tokens);
    EXPECT_EQ(from_raw, from_st);

    // Without a sidecar the MASK slots use embed(mask_token_id): different drafts.
    TempDir none;
    copy_drafter("dflash_mimo", none.path());
    std::filesystem::remove(none.path() / "mask_embedding.safetensors");
    const std::vector<float> without = one_shot(t, none.path(), features, 20, tokens);
    EXPECT_GT(max_abs_diff(without.data(), from_st.data(), int64_t(without.size())), 1e-3);
}

TEST(DFlashSidecar, MalformedSidecarsNameFile) {
    TargetModel t = load_target();
    {
        TempDir dir;
        copy_drafter("dflash_mimo", dir.path());
        std::filesystem::remove(dir.path() / "mask_embedding.safetensors");
        write_bytes(dir.path() / "mask_embedding.bin", std::string(63 * 4, '\0'));
        const std::string message = error_message([&] { make_dflash(t, dir.path()); });
        EXPECT_CONTAINS(message, "mask_embedding.bin");
        EXPECT_CONTAINS(message, "expected 256 bytes");
        EXPECT_CONTAINS(message, "found 252 bytes");
    }
    {
        TempDir dir;
        copy_drafter("dflash_mimo", dir.path());
        std::filesystem::remove(dir.path() / "mask_embedding.safetensors");
        write_bytes(dir.path() / "mask_embedding.pt", "PK\x03\x04 not really a zip");
        const std::string message = error_message([&] { make_dflash(t, dir.path()); });
        EXPECT_CONTAINS(message, "mask_embedding.pt");
        EXPECT_CONTAINS(message, "PyTorch pickle");
        EXPECT_CONTAINS(message, "tofile('mask_embedding.bin')");
    }
    {
        TempDir dir;
        copy_drafter("dflash_mimo", dir.path());
        const std::vector<float> two_rows(128, 0.5f);
        write_safetensors(dir.path() / "mask_embedding.safetensors",
                          {{"mask_embedding", DType::f32, {2, 64}, two_rows.data()}});
        const std::string message = error_message([&] { make_dflash(t, dir.path()); });
        EXPECT_CONTAINS(message, "mask_embedding.safetensors");
        EXPECT_CONTAINS(message, "expected shape [64]");
        EXPECT_CONTAINS(message, "[2, 64]");
    }
    {
        TempDir dir;
        copy_drafter("dflash_mimo", dir.path());
        const std::vector<float> row(64, 0.5f);
        write_safetensors(dir.path() / "mask_embedding.safetensors",
                          {{"a", DType::f32, {64}, row.data()}, {"b", DType::f32, {64}, row.data()}});
        EXPECT_CONTAINS(error_message([&] { make_dflash(t, dir.path()); }), "exactly one tensor");
    }
}

// ---- attention semantics ----------------------------------------------------------------------

// MiMo fixture: 2 layers, block 8, every layer non-causal sliding with W = 4, i.e. key j is
// visible from query p iff |p - j| < 4, measured from each query. With the anchor at position
// 20 (context 0..19, block 20..27), context row j reaches at layer 0 the block queries
// p ≤ j + 3 and, through layer 1's block-to-block attention, slots up to (j + 3 - 20) + 3.
// Slots beyond must be bit-identical when row j changes; a block-anchored window (one lower
// bound for the whole block) would let row 17 reach every slot.
TEST(DFlashAttention, SymmetricPerQueryWindow) {
    TargetModel t = load_target();
    const std::filesystem::path dir = dflash_fixture("dflash_mimo");
    const int64_t n_ctx = 20, width = 3 * 64, vocab = 512;
    const std::vector<float> features = random_features(n_ctx, width, 3);
    const std::vector<int32_t> tokens = some_tokens(size_t(n_ctx + 1), 4);
    const std::vector<float> base = one_shot(t, dir, features, n_ctx, tokens);
    ASSERT_EQ(base.size(), size_t(7 * vocab));
    for (int64_t j : {0, 12, 16, 17, 18, 19}) {
        std::vector<float> perturbed = features;
        for (int64_t c = 0; c < width; ++c) perturbed[size_t(j * width + c)] += 1.5f;
        const std::vector<float> logits = one_shot(t, dir, perturbed, n_ctx, tokens);
        const int64_t layer0_last = j + 3 - n_ctx;  // last block slot that sees row j at layer 0
        const int64_t last_reached = layer0_last < 0 ? 0 : std::min<int64_t>(7, layer0_last + 3);
        for (int64_t slot = 1; slot <= 7; ++slot) {
            const double diff = max_abs_diff(logits.data() + (slot - 1) * vocab, base.data() + (slot - 1) * vocab, vocab);
            if (slot <= last_reached) {
                EXPECT_GT(diff, 1e-5) << "context row " << j << " must reach slot " << slot;
            }
            else EXPECT_EQ(diff, 0.0) << "context row " << j << " must not reach slot " << slot;
        }
    }
}

// z-lab fixture: full non-causal layers, so every context row reaches every drafted slot.
TEST(DFlashAttention, FullLayersSeeWholeContext) {
    TargetModel t = load_target();
    const std::filesystem::path dir = dflash_fixture("dflash_zlab");
    const int64_t n_ctx = 30, width = 2 * 64, vocab = 512;
    const std::vector<float> features = random_features(n_ctx, width, 5);
    const std::vector<int32_t> tokens = some_tokens(size_t(n_ctx + 1), 6);
    const std::vector<float> base = one_shot(t, dir, features, n_ctx, tokens);
    std::vector<float> perturbed = features;
    for (int64_t c = 0; c < width; ++c) perturbed[size_t(c)] += 1.5f;  // position 0
    const std::vector<float> logits = one_shot(t, dir, perturbed, n_ctx, tokens);
    for (int64_t slot = 1; slot <= 3; ++slot)
        EXPECT_GT(max_abs_diff(logits.data() + (slot - 1) * vocab, base.data() + (slot - 1) * vocab, vocab), 1e-6);
}

// ---- KV injection, batching, bookkeeping --------------------------------------------------------

// Injecting the context in pieces, with proposals in between (whose block K/V land where later
// context goes), equals injecting it at once.
TEST(DFlashKv, IncrementalInjectionEqualsOneShot) {
    TargetModel t = load_target();
    for (const char* fixture : {"dflash_zlab", "dflash_mimo"}) {
        SCOPED_TRACE(fixture);
        const std::filesystem::path dir = dflash_fixture(fixture);
        std::unique_ptr<DFlashDrafter> d = make_dflash(t, dir);
        const int64_t n_ctx = 37, width = feature_width(*d);
        const std::vector<float> features = random_features(n_ctx, width, 7);
        const std::vector<int32_t> tokens = some_tokens(size_t(n_ctx + 1), 8);
        int64_t done = 0;
        for (int64_t piece : {10, 1, 3, 17, 6}) {
            observe_rows(*d, 3, features, done, done + piece, tokens);
            done += piece;
            EXPECT_EQ(d->context_length(3), done);
            propose_logits(*d, 3, tokens, done);
        }
        ASSERT_EQ(done, n_ctx);
        const std::vector<float> incremental = propose_logits(*d, 3, tokens, n_ctx);
        const std::vector<float> at_once = one_shot(t, dir, features, n_ctx, tokens);
        EXPECT_LT(max_abs_diff(incremental.data(), at_once.data(), int64_t(at_once.size())), 1e-5);
        // Rows already injected are skipped when observed again (overlapping observation).
        observe_rows(*d, 3, features, 30, n_ctx, tokens);
        EXPECT_EQ(d->context_length(3), n_ctx);
    }
}

// Several requests in one batched forward draft exactly what each drafts alone; max_drafts
// takes a prefix of the block's slots.
TEST(DFlashKv, BatchedEqualsAlone) {
    TargetModel t = load_target();
    const std::filesystem::path dir = dflash_fixture("dflash_mimo");
    std::unique_ptr<DFlashDrafter> batched = make_dflash(t, dir, 0, false, 3);
    const int64_t width = feature_width(*batched);
    const std::vector<int64_t> lengths = {12, 25, 3};
    std::vector<std::vector<float>> features;
    std::vector<std::vector<int32_t>> tokens;
    for (size_t s = 0; s < lengths.size(); ++s) {
        features.push_back(random_features(lengths[s], width, uint32_t(10 + s)));
        tokens.push_back(some_tokens(size_t(lengths[s] + 1), uint32_t(20 + s)));
        observe_rows(*batched, int(s), features[s], 0, lengths[s], tokens[s]);
    }
    const std::vector<int> max_drafts = {7, 2, 5};
    std::vector<DraftRequest> requests;
    for (size_t s = 0; s < lengths.size(); ++s) requests.push_back({int(s), tokens[s], max_drafts[s]});
    const std::vector<std::vector<int32_t>> drafts = batched->propose(requests);
    const std::vector<float> logits = batched->last_logits();
    size_t row = 0;
    for (size_t s = 0; s < lengths.size(); ++s) {
        ASSERT_EQ(drafts[s].size(), size_t(max_drafts[s]));
        std::vector<int32_t> alone_drafts;
        std::unique_ptr<DFlashDrafter> alone = make_dflash(t, dir);
        observe_rows(*alone, 0, features[s], 0, lengths[s], tokens[s]);
        const std::vector<float> alone_logits = propose_logits(*alone, 0, tokens[s], lengths[s], &alone_drafts);
        EXPECT_TRUE(std::equal(drafts[s].begin(), drafts[s].end(), alone_drafts.begin())) << "sequence " << s;
        EXPECT_LT(max_abs_diff(logits.data() + row * 512, alone_logits.data(), int64_t(max_drafts[s]) * 512), 1e-5);
        row += size_t(max_drafts[s]);
    }
}

TEST(DFlashKv, PoolSizeReleaseAndLostSequences) {
    TargetModel t = load_target();
    const int max_seqs = 2;
    const int64_t max_len = 100;
    std::unique_ptr<DFlashDrafter> d = make_dflash(t, dflash_fixture("dflash_mimo"), 0, false, max_seqs, max_len);
    // Pages for max_num_seqs × (max_model_len + block_size) tokens, no more.
    const KvLayout& layout = d->kv().layout();
    int64_t per_seq = 0;
    for (size_t g = 0; g < layout.groups.size(); ++g) per_seq += layout.pages_for(int(g), max_len + 8);
    EXPECT_EQ(d->kv().n_pages(), max_seqs * per_seq);
    EXPECT_EQ(d->pool_bytes(), size_t(d->kv().n_pages() * layout.page_bytes));
    ASSERT_EQ(layout.groups.size(), 1u);  // both layers: sliding, window 4
    EXPECT_TRUE(layout.groups[0].sliding);

    const int64_t width = feature_width(*d);
    const std::vector<float> features = random_features(60, width, 30);
    const std::vector<int32_t> tokens = some_tokens(61, 31);
    observe_rows(*d, 5, features, 0, 60, tokens);
    EXPECT_EQ(propose_logits(*d, 5, tokens, 60).size(), size_t(7 * 512));
    // Sliding windows release pages behind the window.
    EXPECT_GT(d->kv().free_pages(), d->kv().n_pages() - layout.pages_for(0, 68));
    // The anchor must directly follow the observed context: else no drafts.
    DraftRequest stale{5, std::span(tokens).first(40), 7};
    EXPECT_TRUE(d->propose(std::span(&stale, 1)).at(0).empty());
    DraftRequest unknown{9, tokens, 7};
    EXPECT_TRUE(d->propose(std::span(&unknown, 1)).at(0).empty());

    // An all-sliding drafter may start observing mid-context (after a prefix-cache hit)...
    observe_rows(*d, 7, features, 10, 20, tokens);
    EXPECT_EQ(d->context_length(7), 20);
    d->release(7);
    // ...but a later gap (observation starting past the context) loses the sequence until release.
    observe_rows(*d, 6, features, 0, 10, tokens);
    observe_rows(*d, 6, features, 15, 20, tokens);
    EXPECT_EQ(d->context_length(6), -2);
    DraftRequest lost{6, std::span(tokens).first(21), 7};
    EXPECT_TRUE(d->propose(std::span(&lost, 1)).at(0).empty());
    d->release(6);
    EXPECT_EQ(d->context_length(6), -1);
    observe_rows(*d, 6, features, 0, 20, tokens);
    EXPECT_EQ(propose_logits(*d, 6, tokens, 20).size(), size_t(7 * 512));

    d->release(5);
    d->release(6);
    d->release(42);  // unknown: ignored
    EXPECT_EQ(d->kv().free_pages(), d->kv().n_pages());
    d->kv().check_integrity();
}

// With a step budget, all-sliding drafters hold each sequence's last window, not its whole length,
// and draft exactly as the unbounded pool does.
TEST(DFlashKv, StepBudgetBoundsSlidingPools) {
    TargetModel t = load_target();
    SpeculativeConfig spec;
    spec.method = "dflash";
    spec.model = dflash_fixture("dflash_mimo").string();
    auto make = [&](int64_t budget) {
        auto d = std::make_unique<DFlashDrafter>(spec, DrafterContext{*t.model, *t.backend, "", false, 2, 1000, budget});
        d->keep_logits(true);
        return d;
    };
    std::unique_ptr<DFlashDrafter> whole = make(0), bounded = make(16);
    EXPECT_LT(bounded->kv().n_pages(), whole->kv().n_pages() / 10);

    const int64_t width = feature_width(*whole);
    const std::vector<float> features = random_features(200, width, 40);
    const std::vector<int32_t> tokens = some_tokens(201, 41);
    for (DFlashDrafter* d : {whole.get(), bounded.get()})
        for (int64_t begin = 0; begin < 200; begin += 16) observe_rows(*d, 3, features, begin, std::min<int64_t>(begin + 16, 200), tokens);
    EXPECT_EQ(propose_logits(*bounded, 3, tokens, 200), propose_logits(*whole, 3, tokens, 200));
    bounded->kv().check_integrity();
}

// ---- weights ------------------------------------------------------------------------------------

TEST(DFlashWeights, DummyWeightsFromConfigOnly) {
    TargetModel t = load_target();
    TempDir dir;
    write_json(dir.path() / "config.json", fixture_config("dflash_mimo"));
    std::unique_ptr<DFlashDrafter> d = make_dflash(t, dir.path(), 5, /*dummy=*/true);
    const std::vector<float> features = random_features(16, feature_width(*d), 40);
    const std::vector<int32_t> tokens = some_tokens(17, 41);
    observe_rows(*d, 0, features, 0, 16, tokens);
    DraftRequest request{0, tokens, 7};
    const std::vector<int32_t> drafts = d->propose(std::span(&request, 1)).at(0);
    EXPECT_EQ(drafts.size(), 5u);  // num_speculative_tokens caps max_drafts
    for (int32_t token : drafts) EXPECT_TRUE(token >= 0 && token < 512);
    for (float v : d->last_logits()) ASSERT_TRUE(std::isfinite(v));
}

// A drafter shipping embed_tokens.weight / lm_head.weight uses them: with the target's own
// embedding and a negated lm_head, the logits are exactly the borrowed ones negated.
TEST(DFlashWeights, OwnEmbeddingAndLmHead) {
    TargetModel t = load_target();
    const HostTensors target = read_tensors(dflash_fixture("mimo_native_f32") / "model.safetensors");
    TempDir dir;
    copy_drafter("dflash_zlab", dir.path());
    HostTensors h = read_tensors(dir.path() / "model.safetensors");
    h.shapes["embed_tokens.weight"] = {512, 64};
    h.values["embed_tokens.weight"] = target.values.at("model.embed_tokens.weight");
    h.shapes["lm_head.weight"] = {512, 64};
    h.values["lm_head.weight"] = target.values.at("lm_head.weight");
    for (float& v : h.values["lm_head.weight"]) v = -v;
    write_tensors(dir.path() / "model.safetensors", h);

    const std::vector<float> features = random_features(25, 128, 50);
    const std::vector<int32_t> tokens = some_tokens(26, 51);
    const std::vector<float> own = one_shot(t, dir.path(), features, 25, tokens);
    const std::vector<float> borrowed = one_shot(t, dflash_fixture("dflash_zlab"), features, 25, tokens);
    ASSERT_EQ(own.size(), borrowed.size());
    std::vector<float> negated = borrowed;
    for (float& v : negated) v = -v;
    EXPECT_LT(max_abs_diff(own.data(), negated.data(), int64_t(own.size())), 1e-5);
}

}  // namespace
}  // namespace xinfer::test
