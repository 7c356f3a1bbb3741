// Block-scaled FP8 weights resident on accelerators (src/models/fp8_weights.h): the residency
// rule, the op scale grids (stacked parts, shard-restarting grids), the byte accounting of the
// decoder and of the memory plan, dummy FP8 weights, and a whole model run with e4m3 weights.
//
// The accelerator is played by "fp8cpu": the CPU backend's table posing as device memory
// (host_memory = 0) and accepting f8 MATMUL / MOE_EXPERTS under the conditions the CUDA plugin
// states (plugins/cuda/gemm.cu fit_scale_grid, moe.cu expert_weight_ok). It dequantizes each f8
// weight with the op's scales and runs the CPU op, so with f32 activations a model holding e4m3
// weights must reproduce the oracle (which dequantizes at load) to rounding.
// XINFER_TEST_DEVICE=cuda runs the model comparison on that device instead.
#include "model_test_util.h"
#include "models/decoder.h"
#include "models/dummy_weights.h"
#include "models/fp8_weights.h"
#include "runtime/generate.h"
#include "runtime/memory_plan.h"

#include "backend/op_desc.h"

#include <fmt/core.h>

#include <cstdlib>
#include <iostream>
#include <numeric>

namespace xinfer::test {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- the fake fp8 accelerator -------------------------------------------------------------

xinfer_backend_api g_fp8_api;
int g_fp8_ops = 0;  // f8 ops run (all contexts)

int64_t numel(const xinfer_tensor& t) {
    int64_t n = 1;
    for (int i = 0; i < t.rank; ++i) n *= t.shape[i];
    return n;
}

// The grid an f8 weight [.., rows, cols] with scale [.., scale_rows, scale_cols] describes, as the
// CUDA plugin reads it (matmul: contiguous or shard-restarting; experts: contiguous only).
std::optional<Fp8ScaleGrid> op_grid(const xinfer_tensor& w, const xinfer_tensor& scale, const xinfer_op& op,
                                    bool experts) {
    const int64_t br = op.params.matmul.block_rows > 0 ? op.params.matmul.block_rows : 128;
    const int64_t bc = op.params.matmul.block_cols > 0 ? op.params.matmul.block_cols : 128;
    if (w.dtype != XINFER_DTYPE_F8_E4M3 || scale.dtype != XINFER_DTYPE_F32 || scale.rank != w.rank) return {};
    if (experts && (w.rank != 3 || scale.shape[0] != w.shape[0])) return {};
    const int r = w.rank;
    const int64_t rows = w.shape[r - 2], cols = w.shape[r - 1];
    if (experts && scale.shape[r - 2] != ceil_div(rows, br)) return {};
    return fit_fp8_scale_grid(rows, cols, br, bc, scale.shape[r - 2], scale.shape[r - 1]);
}

// An f32 copy of the f8 weight, dequantized with its scales.
std::vector<float> dequantized(const xinfer_tensor& w, const Fp8ScaleGrid& grid, const xinfer_tensor& scale) {
    std::vector<float> out(size_t(numel(w)));
    const int64_t matrices = w.rank == 3 ? w.shape[0] : 1;
    dequantize_fp8_blocks(static_cast<const uint8_t*>(w.data), static_cast<const float*>(scale.data), matrices, grid,
                          DType::f32, out.data());
    (void)numel(scale);
    return out;
}

int fp8_supports_op(void* ctx, const xinfer_op* op) {
    if (op->type == XINFER_OP_MATMUL && op->src[1].dtype == XINFER_DTYPE_F8_E4M3) {
        if (!op_grid(op->src[1], op->src[2], *op, false)) return 0;
        xinfer_op plain = *op;
        plain.src[1].dtype = XINFER_DTYPE_F32;
        plain.src[2] = {};
        return cpu_backend_api()->supports_op(ctx, &plain);
    }
    if (op->type == XINFER_OP_MOE_EXPERTS && op->src[3].dtype == XINFER_DTYPE_F8_E4M3) {
        if (!op_grid(op->src[3], op->src[5], *op, true) || !op_grid(op->src[4], op->src[6], *op, true)) return 0;
        xinfer_op plain = *op;
        plain.src[3].dtype = plain.src[4].dtype = XINFER_DTYPE_F32;
        plain.src[5] = plain.src[6] = {};
        return cpu_backend_api()->supports_op(ctx, &plain);
    }
    return cpu_backend_api()->supports_op(ctx, op);
}

int fp8_run_op(void* ctx, const xinfer_op* op) {
    if (op->type == XINFER_OP_MATMUL && op->src[1].dtype == XINFER_DTYPE_F8_E4M3) {
        const auto grid = op_grid(op->src[1], op->src[2], *op, false);
        if (!grid) return XINFER_UNSUPPORTED;
        std::vector<float> w = dequantized(op->src[1], *grid, op->src[2]);
        xinfer_op plain = *op;
        plain.src[1].dtype = XINFER_DTYPE_F32;
        plain.src[1].data = w.data();
        plain.src[2] = {};
        ++g_fp8_ops;
        return cpu_backend_api()->run_op(ctx, &plain);
    }
    if (op->type == XINFER_OP_MOE_EXPERTS && op->src[3].dtype == XINFER_DTYPE_F8_E4M3) {
        const auto gate_up_grid = op_grid(op->src[3], op->src[5], *op, true);
        const auto down_grid = op_grid(op->src[4], op->src[6], *op, true);
        if (!gate_up_grid || !down_grid) return XINFER_UNSUPPORTED;
        std::vector<float> gate_up = dequantized(op->src[3], *gate_up_grid, op->src[5]);
        std::vector<float> down = dequantized(op->src[4], *down_grid, op->src[6]);
        xinfer_op plain = *op;
        plain.src[3].dtype = plain.src[4].dtype = XINFER_DTYPE_F32;
        plain.src[3].data = gate_up.data();
        plain.src[4].data = down.data();
        plain.src[5] = plain.src[6] = {};
        ++g_fp8_ops;
        return cpu_backend_api()->run_op(ctx, &plain);
    }
    return cpu_backend_api()->run_op(ctx, op);
}

int fp8_device_props(int device, xinfer_device_props* out) {
    const int status = cpu_backend_api()->device_props(device, out);
    out->host_memory = 0;  // pose as an accelerator: FP8 residency applies
    std::snprintf(out->name, sizeof(out->name), "fp8cpu");
    return status;
}

std::unique_ptr<Backend> make_fp8_backend() {
    g_fp8_api = *cpu_backend_api();
    g_fp8_api.name = "fp8cpu";
    g_fp8_api.device_props = fp8_device_props;
    g_fp8_api.supports_op = fp8_supports_op;
    g_fp8_api.run_op = fp8_run_op;
    g_fp8_api.graph_begin = nullptr;  // eager only
    g_fp8_api.graph_end = nullptr;
    g_fp8_api.graph_launch = nullptr;
    g_fp8_api.graph_destroy = nullptr;
    return std::make_unique<Backend>(&g_fp8_api, 0, "fp8cpu");
}


// ---- config and grids ---------------------------------------------------------------------

ModelConfig config_of(const std::filesystem::path& dir) {
    return read_model_config(*Checkpoint::open(dir, /*load_weights=*/false));
}

TEST(Fp8Weights, ConfigNamesTheQuantizedMatrices) {
    const ModelConfig config = config_of(fixture_dir("mimo_hub_fp8"));
    ASSERT_TRUE(config.fp8.enabled);
    EXPECT_EQ(config.fp8.block_rows, 128);
    EXPECT_EQ(config.fp8.block_cols, 128);
    EXPECT_TRUE(config.fp8.quantizes("model.layers.1.self_attn.q_proj.weight"));
    EXPECT_TRUE(config.fp8.quantizes("model.layers.1.mlp.experts.3.down_proj.weight"));
    EXPECT_FALSE(config.fp8.quantizes("model.layers.1.self_attn.o_proj.weight"));
    EXPECT_FALSE(config.fp8.quantizes("model.layers.1.mlp.gate.weight"));
    EXPECT_TRUE(config.fp8.quantizes("model.layers.0.mlp.gate_proj.weight"));  // not the router "mlp.gate"
    EXPECT_FALSE(config.fp8.quantizes("lm_head.weight"));
    Fp8WeightConfig short_names{true, 128, 128, {"o_proj"}};
    EXPECT_FALSE(short_names.quantizes("model.layers.7.self_attn.o_proj.weight"));
    EXPECT_TRUE(short_names.quantizes("model.layers.7.self_attn.q_proj.weight"));
    EXPECT_FALSE(config_of(fixture_dir("mimo_hub_f32")).fp8.enabled);
}

TEST(Fp8Weights, OpGridOfContiguousTensorsKeepsTheStoredBlocks) {
    // MiMo-V2-Flash: experts [2048, 4096] gate + up stack on a block boundary.
    const Fp8ScaleGrid gate{2048, 4096, 128, 128, 16, 32, 1};
    const Fp8ScaleGrid parts[] = {gate, gate};
    EXPECT_EQ(op_block_rows(parts), 128);
    const Fp8ScaleGrid q{12288, 4096, 128, 128, 96, 32, 1};
    EXPECT_EQ(op_block_rows(std::span(&q, 1)), 128);
    const Fp8ScaleGrid edge{200, 320, 128, 128, 2, 3, 1};  // partial edge block, alone: unchanged
    EXPECT_EQ(op_block_rows(std::span(&edge, 1)), 128);
}

TEST(Fp8Weights, OpGridRefinesShardRestartsAndStackedParts) {
    // MiMo's GA k_proj [768, 4096] with scales [8, 32]: 4 shards of 192 rows → 64-row blocks.
    const auto k_proj = fit_fp8_scale_grid(768, 4096, 128, 128, 8, 32);
    ASSERT_TRUE(k_proj && k_proj->shard_count == 4);
    EXPECT_EQ(op_block_rows(std::span(&*k_proj, 1)), 64);
    std::vector<float> stored(8 * 32);
    std::iota(stored.begin(), stored.end(), 0.f);
    std::vector<float> op;
    const Fp8Part part{*k_proj, stored.data()};
    append_op_scales(std::span(&part, 1), 64, op);
    ASSERT_EQ(op.size(), 12u * 32u);
    // Every weight row reads the same scale through the op grid as through the stored one.
    for (int64_t row = 0; row < 768; ++row)
        for (int64_t col = 0; col < 32; ++col)
            ASSERT_EQ(op[size_t((row / 64) * 32 + col)], stored[size_t(k_proj->scale_row_of(row) * 32 + col)])
                << "row " << row;

    // gate + up of 96 rows each (the fixture's experts): 32-row blocks, each part's own scales.
    const Fp8ScaleGrid gate{96, 320, 128, 128, 1, 3, 1};
    const Fp8ScaleGrid parts_grids[] = {gate, gate};
    EXPECT_EQ(op_block_rows(parts_grids), 32);
    const float gate_scales[] = {1, 2, 3}, up_scales[] = {4, 5, 6};
    const Fp8Part parts[] = {{gate, gate_scales}, {gate, up_scales}};
    op.clear();
    append_op_scales(parts, 32, op);
    ASSERT_EQ(op.size(), 6u * 3u);
    for (int64_t block = 0; block < 6; ++block)
        EXPECT_EQ(op[size_t(block * 3)], block < 3 ? 1.f : 4.f) << "block " << block;
    // 200-row parts (the fixture's dense gate/up): the part boundary at row 200 → 8-row blocks.
    const Fp8ScaleGrid dense{200, 320, 128, 128, 2, 3, 1};
    const Fp8ScaleGrid dense_parts[] = {dense, dense};
    EXPECT_EQ(op_block_rows(dense_parts), 8);
}

// ---- the residency rule ---------------------------------------------------------------------

TEST(Fp8Weights, ResidencyFollowsTheBackendAndTheOption) {
    const ModelConfig fp8 = config_of(fixture_dir("mimo_hub_fp8"));
    const ModelConfig plain = config_of(fixture_dir("mimo_hub_f32"));
    auto cpu = make_cpu_backend();
    auto device = make_fp8_backend();
    LoadOptions options;
    EXPECT_FALSE(keep_fp8_weights(fp8, options, *cpu, DType::f32)) << "the oracle dequantizes";
    EXPECT_TRUE(keep_fp8_weights(fp8, options, *device, DType::bf16));
    EXPECT_FALSE(keep_fp8_weights(fp8, options, *device, DType::f32)) << "auto: exact weights for f32 activations";
    options.fp8_weights = "keep";
    EXPECT_TRUE(keep_fp8_weights(fp8, options, *device, DType::f32));
    options.fp8_weights = "auto";
    EXPECT_FALSE(keep_fp8_weights(plain, options, *device, DType::bf16)) << "nothing to keep";
    options.fp8_weights = "dequantize";
    EXPECT_FALSE(keep_fp8_weights(fp8, options, *device, DType::bf16));
    options.fp8_weights = "sometimes";
    EXPECT_THROW(keep_fp8_weights(fp8, options, *device, DType::bf16), Error);
    // The probes describe what the loader will issue.
    EXPECT_TRUE(supports_fp8_matmul(*device, DType::bf16, 384, 320, 128, 128));
    EXPECT_TRUE(supports_fp8_moe(*device, DType::bf16, 8, 320, 96, 2, 32, 128));
}

// ---- a whole model with resident FP8 weights ------------------------------------------------

struct LoadedModel {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<Checkpoint> checkpoint;
    std::unique_ptr<Model> model;
};

LoadedModel load_on(std::unique_ptr<Backend> backend, const std::filesystem::path& dir, LoadOptions options) {
    LoadedModel m;
    m.backend = std::move(backend);
    m.checkpoint = Checkpoint::open(dir, !options.dummy);
    m.model = load_model(*m.checkpoint, *m.backend, options);
    return m;
}

// chunk 0: the whole prompt in one step; else steps of `chunk` tokens.
std::vector<float> logits_of(LoadedModel& m, const std::vector<int32_t>& prompt, size_t chunk = 0) {
    RunnerOptions options;
    options.page_size = 4;
    options.max_cached_tokens = 256;
    options.enforce_eager = true;
    Runner runner(*m.model, *m.backend, options);
    return prompt_logits(runner, prompt, chunk);
}

// The serving bench's roofline splits a decode step's weight bytes into a routing-independent part
// and one expert (Engine::decode_weight_bytes): what a model holds less what a batch-1 step reads
// must be exactly the experts it skips and the embedding rows it does not look up, and one expert is
// its e4m3 matrices plus their scales when resident, 4 bytes a weight in the f32 oracle.
TEST(Fp8Weights, ExpertBytesSplitTheDecodeRead) {
    const Fixture fixture = load_fixture("mimo_hub_fp8");
    LoadOptions options;
    options.dtype = "float32";
    LoadedModel oracle = load_on(make_cpu_backend(), fixture.dir, options);
    options.fp8_weights = "keep";
    LoadedModel resident = load_on(make_fp8_backend(), fixture.dir, options);
    const ModelConfig& c = resident.model->config();
    ASSERT_GT(c.n_experts, c.router.top_k);
    uint64_t moe_layers = 0;
    for (const LayerSpec& l : c.layers) moe_layers += l.ffn == FfnKind::moe;
    ASSERT_GT(moe_layers, 0u);
    const uint64_t expert_weights = 3 * uint64_t(c.hidden_size) * uint64_t(c.moe_intermediate_size);
    EXPECT_EQ(oracle.model->expert_weight_bytes(), 4 * expert_weights);
    EXPECT_GT(resident.model->expert_weight_bytes(), expert_weights);          // + its block scales
    EXPECT_LT(resident.model->expert_weight_bytes(), expert_weights * 5 / 4);  // f32 per block, blocks ≥ 16 weights
    for (LoadedModel* m : {&oracle, &resident}) {
        uint64_t held = 0;
        for (const auto& [dtype, n] : m->model->weight_bytes()) held += n;
        const Tensor& embedding = m->model->token_embedding();
        const uint64_t unread_embedding = c.tie_word_embeddings ? 0 : embedding.nbytes() - embedding.row_bytes();
        EXPECT_EQ(held - m->model->weight_bytes_per_decode_token(),
                  moe_layers * uint64_t(c.n_experts - c.router.top_k) * m->model->expert_weight_bytes() + unread_embedding);
    }
}

TEST(Fp8Weights, ResidentFp8ModelMatchesTheDequantizingOracle) {
    const Fixture fixture = load_fixture("mimo_hub_fp8");
    LoadOptions options;
    options.dtype = "float32";
    LoadedModel oracle = load_on(make_cpu_backend(), fixture.dir, options);
    options.fp8_weights = "keep";  // "auto" dequantizes for f32 activations
    LoadedModel resident = load_on(make_fp8_backend(), fixture.dir, options);

    // What stays e4m3: q/k/v, the dense FFN and the experts; o_proj (modules_to_not_convert),
    // embeddings, norms and routers do not.
    const std::map<DType, uint64_t> oracle_bytes = oracle.model->weight_bytes();
    const std::map<DType, uint64_t> bytes = resident.model->weight_bytes();
    ASSERT_TRUE(bytes.contains(DType::f8_e4m3));
    const ModelConfig& c = resident.model->config();
    uint64_t fp8_elements = 0;
    for (const LayerSpec& l : c.layers) {
        const int64_t qkv_rows = l.n_q_heads * l.head_dim_k + l.n_kv_heads * (l.head_dim_k + l.head_dim_v);
        fp8_elements += uint64_t(c.hidden_size) * uint64_t(qkv_rows);
        fp8_elements += uint64_t(c.hidden_size) * 3 *
                        uint64_t(l.ffn == FfnKind::dense ? c.intermediate_size : c.moe_intermediate_size * c.n_experts);
    }
    EXPECT_EQ(bytes.at(DType::f8_e4m3), fp8_elements);
    EXPECT_FALSE(oracle_bytes.contains(DType::f8_e4m3));
    // f32: what the oracle holds in f32 less the fp8 matrices (dequantized there), plus the bf16
    // ones (o_proj, embeddings: f32 activations on the "device"), plus the scales.
    EXPECT_FALSE(bytes.contains(DType::bf16));
    const int64_t scale_bytes = int64_t(bytes.at(DType::f32)) -
                                (int64_t(oracle_bytes.at(DType::f32)) - 4 * int64_t(fp8_elements) +
                                 2 * int64_t(oracle_bytes.at(DType::bf16)));
    EXPECT_GT(scale_bytes, 0);
    EXPECT_LT(scale_bytes, int64_t(fp8_elements) / 4);
    EXPECT_LT(resident.model->weight_bytes_per_decode_token(), oracle.model->weight_bytes_per_decode_token());

    g_fp8_ops = 0;
    const std::vector<float> expected = logits_of(oracle, fixture.prompt);
    const std::vector<float> logits = logits_of(resident, fixture.prompt);
    EXPECT_GT(g_fp8_ops, 0);
    const double err = relative_error(logits.data(), expected.data(), logits.size());
    EXPECT_LE(err, 1e-5);
    const double ref_err = relative_error(logits.data(), fixture.logits.data(), logits.size());
    EXPECT_LE(ref_err, 1e-4);
    // One token per step: q, k and v in one e4m3 matmul (qkv_proj and its fused scale grid).
    const std::vector<float> stepped = logits_of(resident, fixture.prompt, 1);
    const double step_err = relative_error(stepped.data(), expected.data(), stepped.size());
    EXPECT_LE(step_err, 1e-5);
    std::cout << fmt::format(
        "[ fp8      ] resident e4m3 vs dequantizing oracle: {:.2e} (token by token {:.2e}); vs float64 reference: "
        "{:.2e}\n",
        err, step_err, ref_err);
}

// On a real device (XINFER_TEST_DEVICE=cuda): resident FP8 against the dequantized mode and the
// float64 reference, both in the device's activation dtype. Tiny random routers flip near-tied
// expert choices under bf16, so the error is reported next to the dequantized mode's and must
// not be much worse.
TEST(Fp8Weights, DeviceResidentVsDequantized) {
    if (test_device() == "cpu") GTEST_SKIP() << "set XINFER_TEST_DEVICE to run on a device";
    const Fixture fixture = load_fixture("mimo_hub_fp8");
    LoadOptions options;
    if (const char* dtype = std::getenv("XINFER_TEST_DTYPE")) options.dtype = dtype;
    LoadedModel resident = load_on(make_backend(test_device()), fixture.dir, options);
    ASSERT_TRUE(resident.model->weight_bytes().contains(DType::f8_e4m3)) << "the device refused fp8 weights";
    const std::vector<float> resident_logits = logits_of(resident, fixture.prompt);
    resident.model.reset();
    resident.backend.reset();
    options.fp8_weights = "dequantize";
    LoadedModel dequantized = load_on(make_backend(test_device()), fixture.dir, options);
    const std::vector<float> dequantized_logits = logits_of(dequantized, fixture.prompt);
    const double resident_err = relative_error(resident_logits.data(), fixture.logits.data(), fixture.logits.size());
    const double dequantized_err =
        relative_error(dequantized_logits.data(), fixture.logits.data(), fixture.logits.size());
    const double between = relative_error(resident_logits.data(), dequantized_logits.data(), fixture.logits.size());
    std::cout << fmt::format("[ fp8      ] {}: resident vs reference {:.2e}, dequantized vs reference {:.2e}, "
                             "resident vs dequantized {:.2e}\n",
                             test_device(), resident_err, dequantized_err, between);
    EXPECT_LE(resident_err, std::max(3e-2, 2 * dequantized_err));
}

// ---- dummy FP8 --------------------------------------------------------------------------------

TEST(Fp8Weights, DummyFp8WeightsDequantizeToTheDummyStream) {
    auto backend = make_cpu_backend();
    const int64_t rows = 300, cols = 260;  // partial edge blocks both ways
    std::vector<uint8_t> weight(size_t(rows * cols));
    std::vector<float> scale(size_t(ceil_div(rows, 128) * ceil_div(cols, 128)));
    const Tensor w(weight.data(), DType::f8_e4m3, {rows, cols});
    const Tensor s(scale.data(), DType::f32, {ceil_div(rows, 128), ceil_div(cols, 128)});
    fill_dummy_fp8_weights(*backend, w, s, 42);
    const float expected_scale = 1.f / std::sqrt(float(cols)) / 448.f;
    for (float v : scale) EXPECT_FLOAT_EQ(v, expected_scale);
    const std::vector<float> values = dummy_values(rows * cols, cols, false, 42);
    const float amplitude = 1.f / std::sqrt(float(cols));
    float amax = 0;
    for (int64_t i = 0; i < rows * cols; ++i) {
        const float dq = f8_e4m3_to_f32(weight[size_t(i)]) * expected_scale;
        ASSERT_LE(std::fabs(dq - values[size_t(i)]), amplitude / 16) << "element " << i;  // e4m3: 3 mantissa bits
        amax = std::max(amax, std::fabs(f8_e4m3_to_f32(weight[size_t(i)])));
    }
    EXPECT_GT(amax, 400.f);  // the scale uses e4m3's range (amax ≈ 448)
    EXPECT_LE(amax, 448.f);
}

TEST(Fp8Weights, DummyFp8ModelOnAnAcceleratorIsE4m3) {
    // The fixture's config (fp8 quantization_config) with dummy weights: e4m3 matrices + scales.
    LoadOptions options;
    options.dummy = true;
    options.dtype = "float32";
    options.fp8_weights = "keep";  // the fake accelerator computes in f32, where "auto" dequantizes
    LoadedModel resident = load_on(make_fp8_backend(), fixture_dir("mimo_hub_fp8"), options);
    const std::map<DType, uint64_t> bytes = resident.model->weight_bytes();
    ASSERT_TRUE(bytes.contains(DType::f8_e4m3));
    options.fp8_weights = "dequantize";
    LoadedModel dequantized = load_on(make_fp8_backend(), fixture_dir("mimo_hub_fp8"), options);
    EXPECT_FALSE(dequantized.model->weight_bytes().contains(DType::f8_e4m3));
    // Same shapes: every fp8 byte was 4 bytes of f32 in the dequantized model.
    const auto total = [](const std::map<DType, uint64_t>& m) {
        uint64_t n = 0;
        for (const auto& [dtype, b] : m) n += b;
        return n;
    };
    EXPECT_LT(total(bytes), total(dequantized.model->weight_bytes()) - 2 * bytes.at(DType::f8_e4m3));
    // It runs, and its logits are finite and of the dummy scale.
    const std::vector<float> logits = logits_of(resident, {1, 2, 3, 4, 5});
    for (float v : logits) ASSERT_TRUE(std::isfinite(v));
}

TEST(Fp8Weights, DummyFp8TilesReplicateOnAccelerators) {
    // Above one 2^20-element tile, accelerators replicate the quantized tile by device copies.
    auto backend = make_fp8_backend();
    const int64_t rows = 1024, cols = 2048;
    Buffer wb = backend->alloc(size_t(rows * cols)), sb = backend->alloc(size_t(8 * 16 * 4));
    const Tensor w(wb.data(), DType::f8_e4m3, {rows, cols});
    const Tensor s(sb.data(), DType::f32, {8, 16});
    fill_dummy_fp8_weights(*backend, w, s, 7);
    const uint8_t* bytes = static_cast<const uint8_t*>(wb.data());
    const int64_t tile = int64_t(1) << 20;
    for (int64_t i = 0; i < tile; i += 4099) ASSERT_EQ(bytes[i], bytes[i + tile]) << i;
}

// ---- the memory plan ------------------------------------------------------------------------

TEST(Fp8Weights, PlanCountsE4m3AndScalesForTheBenchModel) {
    // bench/models/mimo_v2_flash_e8_fp8: the real shapes with 8 experts, top-8, so a batch-1
    // decode step reads what the real 256-expert model reads: 17.0 GB in FP8, 29.5 GB in bf16.
    const std::filesystem::path dir = std::filesystem::path(XINFER_FIXTURES_DIR) / ".." / ".." / "bench" / "models" /
                                      "mimo_v2_flash_e8_fp8";
    const ModelConfig config = config_of(dir);
    ASSERT_TRUE(config.fp8.enabled);
    PlanOptions options;
    options.device_memory = parse_memory_size("141GiB");
    options.max_model_len = 4096;
    const MemoryPlan bf16 = plan_memory(config, options);
    options.fp8_weights = true;
    const MemoryPlan fp8 = plan_memory(config, options);
    std::cout << fmt::format("[ plan     ] read per token: fp8 {:.3f} GB, bf16 {:.3f} GB, held {:.3f} / {:.3f} GB\n",
                             fp8.decode_weight_bytes / 1e9, bf16.decode_weight_bytes / 1e9, fp8.weight_bytes / 1e9,
                             bf16.weight_bytes / 1e9);
    EXPECT_NEAR(double(fp8.decode_weight_bytes) / 1e9, 17.0, 0.1);
    EXPECT_NEAR(double(bf16.decode_weight_bytes) / 1e9, 29.5, 0.1);
    // Held = read + the embedding table (one row read) + nothing else: top-8 of 8 experts.
    const double table = double(config.vocab_size * config.hidden_size * 2);
    EXPECT_NEAR(double(fp8.weight_bytes), double(fp8.decode_weight_bytes) + table, 1e7);
    // e4m3 bytes and f32 scales (1/16384 of them per 128×128 block, ×4 B).
    uint64_t e4m3 = 0, f32 = 0;
    for (const WeightLine& line : fp8.weights) {
        if (line.dtype == DType::f8_e4m3) e4m3 = line.sharded + line.replicated;
        if (line.dtype == DType::f32) f32 = line.sharded + line.replicated;
    }
    EXPECT_GT(e4m3, uint64_t(12.5e9));
    EXPECT_GT(f32, e4m3 * 4 / 16384);
    EXPECT_NE(fp8.report().find("e4m3"), std::string::npos);
    // No quantization_config: the same numbers as before.
    const ModelConfig plain = config_of(dir.parent_path() / "mimo_v2_flash_e8");
    options.fp8_weights = true;
    EXPECT_EQ(plan_memory(plain, options).weight_bytes, bf16.weight_bytes);
}

}  // namespace
}  // namespace xinfer::test
