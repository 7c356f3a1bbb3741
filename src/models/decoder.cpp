#include "models/decoder.h"

#include "core/status.h"
#include "models/dummy_weights.h"
#include "models/fp8_weights.h"

#include <cmath>
#include <cstring>
#include <numeric>

namespace xinfer {
namespace {

// Activations: f32 on host-memory backends (the oracle); on accelerators the requested dtype,
// "auto" meaning the checkpoint's own (f16 checkpoints run in bf16: same range as training).
DType choose_activation_dtype(const ModelConfig& config, const LoadOptions& options, const Backend& backend) {
    if (backend.props().host_memory) return DType::f32;
    if (options.dtype == "float32") return DType::f32;
    if (options.dtype == "bfloat16") return DType::bf16;
    if (options.dtype != "auto") fail("--dtype \"{}\": expected auto, float32 or bfloat16", options.dtype);
    return config.dtype == DType::f32 ? DType::f32 : DType::bf16;
}

// Where a weight matrix lives and in which dtype when it is not kept as FP8 (load_matrix):
// host-memory backends (the CPU oracle) keep f32/bf16/f16 as stored and dequantize block-scaled
// FP8 to options.dequant_dtype (f32: exact); accelerators hold it in the activation dtype.
DType resident_dtype(DType stored, const LoadOptions& options, bool host_memory, DType activation) {
    if (!host_memory) return activation;
    switch (stored) {
        case DType::f32:
        case DType::bf16:
        case DType::f16: return stored;
        default: return options.dequant_dtype;
    }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Tensor shaped(DType dtype, std::span<const int64_t> shape) {
    Tensor t;
    t.dtype = dtype;
    XINFER_CHECK(shape.size() <= size_t(kMaxRank), "rank {} > {}", shape.size(), kMaxRank);
    for (int64_t d : shape) t.shape[size_t(t.rank++)] = d;
    return t;
}

// The op grid's block height for `grids` (parts_per_matrix consecutive parts per matrix): the
// finest any matrix needs, so one height serves every matrix of a stacked tensor.
int64_t block_rows_of(const std::vector<Fp8ScaleGrid>& grids, size_t parts_per_matrix) {
    int64_t block = 0;
    for (size_t first = 0; first < grids.size(); first += parts_per_matrix)
        block = std::gcd(block, op_block_rows(std::span(grids).subspan(first, parts_per_matrix)));
    return block;
}

}  // namespace

DecoderModel::DecoderModel(ModelConfig config, Checkpoint& checkpoint, Backend& backend, const LoadOptions& options)
    : options_(options),
      config_(std::move(config)),
      backend_(backend),
      act_dtype_(choose_activation_dtype(config_, options_, backend_)),
      keep_fp8_(keep_fp8_weights(config_, options_, backend_, act_dtype_)),
      workspace_(backend) {
    load_weights(checkpoint);
}

Tensor DecoderModel::allocate(DType dtype, std::initializer_list<int64_t> shape) {
    Tensor t(nullptr, dtype, shape);
    buffers_.push_back(backend_.alloc(t.nbytes()));
    t.data = buffers_.back().data();
    return t;
}

// Dummy weights (src/models/dummy_weights.h), deterministic for a given seed and load order.
void DecoderModel::fill_dummy(const Tensor& t, bool is_norm) {
    const uint64_t stream = options_.dummy_seed * 0x9e3779b97f4a7c15ull + (++dummy_counter_) * 0xbf58476d1ce4e5b9ull;
    fill_dummy_weights(backend_, t, is_norm, stream);
}

Tensor DecoderModel::load(Checkpoint& checkpoint, const std::string& name, std::initializer_list<int64_t> shape,
                          bool keep_f32) {
    if (options_.dummy) {
        Tensor t = allocate(keep_f32 ? DType::f32 : dummy_matrix_dtype(), shape);
        fill_dummy(t, name.ends_with("norm.weight"));
        if (name.ends_with("e_score_correction_bias")) {
            // Zero, as transformers initialises it. A random bias as wide as the spread of the
            // router's scores sends most tokens to the same few experts (a small MiMo shape with
            // 32 experts at concurrency 8: 22.9 experts touched per layer where uniform routing
            // touches 28.8; zero bias: 28.4), which a trained model's load balancing, the purpose
            // of this bias, does not do. (Filled first all the same, so that every other tensor
            // keeps its dummy values: the stream counter advances per tensor.)
            XINFER_CHECK(t.dtype == DType::f32, "router bias {} is not f32", name);
            const std::vector<float> zeros(size_t(t.numel()), 0.f);
            backend_.upload(t, zeros.data());
            backend_.synchronize();  // `zeros` dies here; uploads may be stream-ordered
        }
        return t;
    }
    const bool host_memory = backend_.props().host_memory != 0;
    Tensor t = allocate(keep_f32 ? DType::f32 : resident_dtype(checkpoint.info(name).dtype, options_, host_memory, act_dtype_), shape);
    std::vector<uint8_t> host(t.nbytes());
    checkpoint.read(name, std::span<const int64_t>(shape.begin(), shape.size()), t.dtype, host.data());
    backend_.upload(t, host.data());
    backend_.synchronize();  // `host` dies here; uploads may be stream-ordered
    return t;
}

Tensor DecoderModel::load_stacked(Checkpoint& checkpoint, const std::vector<std::string>& names,
                                  std::initializer_list<int64_t> part_shape, std::initializer_list<int64_t> shape) {
    if (options_.dummy) {
        Tensor t = allocate(dummy_matrix_dtype(), shape);
        fill_dummy(t, false);
        return t;
    }
    const bool host_memory = backend_.props().host_memory != 0;
    Tensor t = allocate(resident_dtype(checkpoint.info(names.front()).dtype, options_, host_memory, act_dtype_), shape);
    XINFER_CHECK(t.nbytes() % names.size() == 0, "stacking {} tensors into {}", names.size(), t.shape_string());
    const size_t part_bytes = t.nbytes() / names.size();
    std::vector<uint8_t> host(t.nbytes());
    for (size_t i = 0; i < names.size(); ++i)
        checkpoint.read(names[i], std::span<const int64_t>(part_shape.begin(), part_shape.size()), t.dtype,
                        host.data() + i * part_bytes);
    backend_.upload(t, host.data());
    backend_.synchronize();
    return t;
}

// Experts come either stacked (transformers-native: experts.gate_up_proj [E, 2I, H] and
// experts.down_proj [E, H, I]) or one tensor per expert and projection (hub checkpoints:
// experts.E.{gate,up,down}_proj.weight). Both end up stacked as the grouped-expert op wants.
void DecoderModel::load_experts(Checkpoint& checkpoint, const std::string& prefix, LayerWeights& w) {
    const int64_t n_experts = config_.n_experts, hidden = config_.hidden_size, inter = config_.moe_intermediate_size;
    const bool stacked = !options_.dummy && checkpoint.has(prefix + "gate_up_proj");
    // Names as stored: stacked (transformers-native) or per expert and projection (hub; dummy
    // weights use these names too, which is what modules_to_not_convert lists).
    std::vector<std::string> gate_up_names, down_names;
    if (stacked) {
        gate_up_names = {prefix + "gate_up_proj"};
        down_names = {prefix + "down_proj"};
    } else {
        for (int64_t e = 0; e < n_experts; ++e) {
            const std::string expert = prefix + std::to_string(e) + ".";
            gate_up_names.push_back(expert + "gate_proj.weight");
            gate_up_names.push_back(expert + "up_proj.weight");
            down_names.push_back(expert + "down_proj.weight");
        }
    }
    const std::initializer_list<int64_t> gate_up_shape = {n_experts, 2 * inter, hidden};
    const std::initializer_list<int64_t> down_shape = {n_experts, hidden, inter};
    const std::initializer_list<int64_t> gate_up_part = {inter, hidden}, down_part = {hidden, inter};
    const std::span<const int64_t> gate_up_parts = stacked ? std::span<const int64_t>(gate_up_shape)
                                                           : std::span<const int64_t>(gate_up_part);
    const std::span<const int64_t> down_parts = stacked ? std::span<const int64_t>(down_shape)
                                                        : std::span<const int64_t>(down_part);

    // FP8 experts stay e4m3 when both weights are FP8 and the backend takes them with one block height.
    const std::vector<Fp8ScaleGrid> gate_up_grids = fp8_grids(checkpoint, gate_up_names, gate_up_parts);
    const std::vector<Fp8ScaleGrid> down_grids = fp8_grids(checkpoint, down_names, down_parts);
    if (!gate_up_grids.empty() && !down_grids.empty()) {
        const int64_t block_rows =
            std::gcd(block_rows_of(gate_up_grids, stacked ? 1 : 2), block_rows_of(down_grids, 1));
        if (supports_fp8_moe(backend_, act_dtype_, n_experts, hidden, inter, config_.router.top_k, block_rows,
                             config_.fp8.block_cols)) {
            w.experts_gate_up = load_fp8(checkpoint, gate_up_names, gate_up_parts, gate_up_shape, gate_up_grids,
                                         block_rows, w.experts_gate_up_scale);
            w.experts_down =
                load_fp8(checkpoint, down_names, down_parts, down_shape, down_grids, block_rows, w.experts_down_scale);
            return;
        }
    }
    if (options_.dummy || stacked) {
        w.experts_gate_up = load(checkpoint, prefix + "gate_up_proj", gate_up_shape, false);
        w.experts_down = load(checkpoint, prefix + "down_proj", down_shape, false);
        return;
    }
    w.experts_gate_up = load_stacked(checkpoint, gate_up_names, gate_up_part, gate_up_shape);
    w.experts_down = load_stacked(checkpoint, down_names, down_part, down_shape);
}

std::vector<Fp8ScaleGrid> DecoderModel::fp8_grids(Checkpoint& checkpoint, const std::vector<std::string>& names,
                                                  std::span<const int64_t> part_shape) const {
    if (!keep_fp8_) return {};
    const Fp8WeightConfig& fp8 = config_.fp8;
    const size_t rank = part_shape.size();
    const int64_t rows = part_shape[rank - 2], cols = part_shape[rank - 1];
    std::vector<Fp8ScaleGrid> grids;
    for (const std::string& name : names) {
        if (options_.dummy) {
            if (!fp8.quantizes(name)) return {};
            grids.push_back({rows, cols, fp8.block_rows, fp8.block_cols, ceil_div(rows, fp8.block_rows),
                             ceil_div(cols, fp8.block_cols), 1});
            continue;
        }
        if (checkpoint.info(name).dtype != DType::f8_e4m3) return {};
        const std::string scale_name = name + "_scale_inv";
        if (!checkpoint.has(scale_name))
            fail("{}: fp8 tensor {} has no {} (block-scaled FP8 needs its scales)", checkpoint.dir().string(), name,
                 scale_name);
        const TensorInfo& scale = checkpoint.info(scale_name);
        const bool shape_ok = scale.shape.size() == rank && (rank == 2 || scale.shape[0] == part_shape[0]);
        std::optional<Fp8ScaleGrid> grid;
        if (shape_ok && scale.dtype == DType::f32)
            grid = fit_fp8_scale_grid(rows, cols, fp8.block_rows, fp8.block_cols, scale.shape[rank - 2],
                                      scale.shape[rank - 1]);
        if (!grid)
            fail("{}: fp8 tensor {} [{} rows, {} cols] has scale {} {} {}: expected f32 [{}, {}] with {}x{} blocks "
                 "(or a grid restarting per row shard)",
                 scale.file.string(), name, rows, cols, scale_name, dtype_name(scale.dtype), scale.shape_string(),
                 ceil_div(rows, fp8.block_rows), ceil_div(cols, fp8.block_cols), fp8.block_rows, fp8.block_cols);
        grids.push_back(*grid);
    }
    return grids;
}

Tensor DecoderModel::load_fp8(Checkpoint& checkpoint, const std::vector<std::string>& names,
                              std::span<const int64_t> part_shape, std::span<const int64_t> shape,
                              const std::vector<Fp8ScaleGrid>& grids, int64_t block_rows, BlockScales& scale) {
    const size_t rank = shape.size();
    const int64_t matrices = rank == 3 ? shape[0] : 1, rows = shape[rank - 2];
    const int64_t scale_cols = grids.front().scale_cols;
    Tensor w = shaped(DType::f8_e4m3, shape);
    buffers_.push_back(backend_.alloc(w.nbytes()));
    w.data = buffers_.back().data();
    const int64_t scale_rows = ceil_div(rows, block_rows);
    const std::vector<int64_t> scale_shape = rank == 3 ? std::vector<int64_t>{matrices, scale_rows, scale_cols}
                                                       : std::vector<int64_t>{scale_rows, scale_cols};
    scale.scale = shaped(DType::f32, scale_shape);
    buffers_.push_back(backend_.alloc(scale.scale.nbytes()));
    scale.scale.data = buffers_.back().data();
    scale.block_rows = int(block_rows);
    scale.block_cols = int(config_.fp8.block_cols);
    if (options_.dummy) {
        const uint64_t stream =
            options_.dummy_seed * 0x9e3779b97f4a7c15ull + (++dummy_counter_) * 0xbf58476d1ce4e5b9ull;
        fill_dummy_fp8_weights(backend_, w, scale.scale, stream);
        return w;
    }
    // The e4m3 bytes as stored, parts back to back (row-stacked parts may differ in rows: q, k, v).
    std::vector<uint8_t> host(w.nbytes());
    std::vector<std::vector<float>> stored(names.size());
    std::vector<int64_t> read_shape(part_shape.begin(), part_shape.end());
    size_t offset = 0;
    for (size_t i = 0; i < names.size(); ++i) {
        if (names.size() > 1) read_shape[read_shape.size() - 2] = grids[i].rows;
        checkpoint.read(names[i], read_shape, DType::f8_e4m3, host.data() + offset);
        offset += size_t(shaped(DType::f8_e4m3, read_shape).nbytes());
        const TensorInfo& info = checkpoint.info(names[i] + "_scale_inv");
        stored[i].resize(size_t(info.numel()));
        checkpoint.read(info.name, std::span<const int64_t>(info.shape), DType::f32, stored[i].data());
    }
    // One op grid per matrix: its parts are the names of that matrix, or one slice of a stacked name.
    std::vector<float> op_scales;
    op_scales.reserve(size_t(scale.scale.numel()));
    const size_t parts_per_matrix = names.size() == 1 ? 1 : names.size() / size_t(matrices);
    for (int64_t m = 0; m < matrices; ++m) {
        std::vector<Fp8Part> parts;
        if (names.size() == 1) {
            const Fp8ScaleGrid& grid = grids.front();
            parts.push_back({grid, stored.front().data() + m * grid.scale_rows * grid.scale_cols});
        } else {
            for (size_t j = 0; j < parts_per_matrix; ++j) {
                const size_t i = size_t(m) * parts_per_matrix + j;
                parts.push_back({grids[i], stored[i].data()});
            }
        }
        append_op_scales(parts, block_rows, op_scales);
    }
    XINFER_CHECK(int64_t(op_scales.size()) == scale.scale.numel(), "fp8 op scales: {} values for {}",
                 op_scales.size(), scale.scale.shape_string());
    backend_.upload(w, host.data());
    backend_.upload(scale.scale, op_scales.data());
    backend_.synchronize();  // the host copies die here; uploads may be stream-ordered
    return w;
}

Tensor DecoderModel::load_matrix(Checkpoint& checkpoint, const std::vector<std::string>& names,
                                 std::initializer_list<int64_t> part_shape, std::initializer_list<int64_t> shape,
                                 BlockScales& scale) {
    const std::vector<Fp8ScaleGrid> grids = fp8_grids(checkpoint, names, part_shape);
    if (!grids.empty()) {
        const int64_t block_rows = block_rows_of(grids, names.size());
        const int64_t n = *shape.begin(), k = *(shape.begin() + 1);
        if (supports_fp8_matmul(backend_, act_dtype_, n, k, block_rows, config_.fp8.block_cols))
            return load_fp8(checkpoint, names, part_shape, shape, grids, block_rows, scale);
    }
    if (names.size() == 1) return load(checkpoint, names.front(), shape, false);
    return load_stacked(checkpoint, names, part_shape, shape);
}

void DecoderModel::load_qkv(Checkpoint& checkpoint, const std::string& p, int64_t q_rows, int64_t k_rows,
                            int64_t v_rows, LayerWeights& w) {
    const int64_t hidden = config_.hidden_size;
    const std::string names[3] = {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                  p + "self_attn.v_proj.weight"};
    const int64_t rows[3] = {q_rows, k_rows, v_rows};
    const bool host_memory = backend_.props().host_memory != 0;
    bool apart = false;  // parts stored in different dtypes, or only some of them FP8 that stays e4m3
    DType dtype = dummy_matrix_dtype();
    std::vector<Fp8ScaleGrid> grids;  // of the parts that may stay e4m3
    for (int i = 0; i < 3; ++i) {
        const int64_t part_shape[2] = {rows[i], hidden};
        for (const Fp8ScaleGrid& grid : fp8_grids(checkpoint, {names[i]}, part_shape)) grids.push_back(grid);
        if (options_.dummy || !grids.empty()) continue;
        const DType stored = resident_dtype(checkpoint.info(names[i]).dtype, options_, host_memory, act_dtype_);
        apart = apart || (i > 0 && stored != dtype);
        dtype = stored;
    }
    const int64_t total_rows = q_rows + k_rows + v_rows;
    if (grids.size() == 3) {
        // All three FP8: one e4m3 matrix whose op scale grid is fine enough for every part
        // boundary (fp8_weights.h), so the parts' scales are row views of it.
        const int64_t block_rows = op_block_rows(grids);
        if (supports_fp8_matmul(backend_, act_dtype_, total_rows, hidden, block_rows, config_.fp8.block_cols)) {
            const int64_t part_shape[2] = {q_rows, hidden}, shape[2] = {total_rows, hidden};
            w.qkv_proj = load_fp8(checkpoint, {names[0], names[1], names[2]}, part_shape, shape, grids, block_rows,
                                  w.qkv_proj_scale);
            int64_t row = 0;
            Tensor* parts[3] = {&w.q_proj, &w.k_proj, &w.v_proj};
            BlockScales* scales[3] = {&w.q_proj_scale, &w.k_proj_scale, &w.v_proj_scale};
            for (int i = 0; i < 3; ++i) {
                *parts[i] = Tensor(static_cast<char*>(w.qkv_proj.data) + size_t(row * hidden), DType::f8_e4m3,
                                   {rows[i], hidden});
                *scales[i] = w.qkv_proj_scale;
                const Tensor& all = w.qkv_proj_scale.scale;
                scales[i]->scale = Tensor(static_cast<char*>(all.data) + size_t(row / block_rows) * all.row_bytes(),
                                          DType::f32, {ceil_div(rows[i], block_rows), all.dim(1)});
                row += rows[i];
            }
            return;
        }
    }
    if (!grids.empty()) apart = true;
    if (apart) {
        w.q_proj = load_matrix(checkpoint, {names[0]}, {q_rows, hidden}, {q_rows, hidden}, w.q_proj_scale);
        w.k_proj = load_matrix(checkpoint, {names[1]}, {k_rows, hidden}, {k_rows, hidden}, w.k_proj_scale);
        w.v_proj = load_matrix(checkpoint, {names[2]}, {v_rows, hidden}, {v_rows, hidden}, w.v_proj_scale);
        return;
    }
    w.qkv_proj = allocate(dtype, {q_rows + k_rows + v_rows, hidden});
    char* base = static_cast<char*>(w.qkv_proj.data);
    const size_t row_bytes = size_t(w.qkv_proj.row_bytes());
    w.q_proj = Tensor(base, dtype, {q_rows, hidden});
    w.k_proj = Tensor(base + size_t(q_rows) * row_bytes, dtype, {k_rows, hidden});
    w.v_proj = Tensor(base + size_t(q_rows + k_rows) * row_bytes, dtype, {v_rows, hidden});
    if (options_.dummy) {
        fill_dummy(w.qkv_proj, false);
        return;
    }
    std::vector<uint8_t> host(w.qkv_proj.nbytes());
    const Tensor* parts[3] = {&w.q_proj, &w.k_proj, &w.v_proj};
    for (int i = 0; i < 3; ++i) {
        const int64_t part_shape[2] = {rows[i], hidden};
        checkpoint.read(names[i], part_shape, dtype,
                        host.data() + (static_cast<char*>(parts[i]->data) - base));
    }
    backend_.upload(w.qkv_proj, host.data());
    backend_.synchronize();  // `host` dies here; uploads may be stream-ordered
}

void DecoderModel::load_weights(Checkpoint& checkpoint) {
    const int64_t hidden = config_.hidden_size, vocab = config_.vocab_size;
    if (!options_.dummy)
        for (const std::string& prefix : config_.speculative_prefixes) checkpoint.skip_prefix(prefix);

    embed_tokens_ = load(checkpoint, "model.embed_tokens.weight", {vocab, hidden}, false);
    final_norm_ = load(checkpoint, "model.norm.weight", {hidden}, true);
    if (config_.tie_word_embeddings) {
        lm_head_ = embed_tokens_;
        if (!options_.dummy) checkpoint.skip_prefix("lm_head.weight");  // some exporters write the tied copy anyway
    } else {
        lm_head_ = load(checkpoint, "lm_head.weight", {vocab, hidden}, false);
    }

    layers_.resize(config_.layers.size());
    for (size_t i = 0; i < config_.layers.size(); ++i) {
        const LayerSpec& spec = config_.layers[i];
        LayerWeights& w = layers_[i];
        const std::string p = "model.layers." + std::to_string(i) + ".";
        w.input_norm = load(checkpoint, p + "input_layernorm.weight", {hidden}, true);
        w.post_attn_norm = load(checkpoint, p + "post_attention_layernorm.weight", {hidden}, true);
        const int64_t q_rows = spec.n_q_heads * spec.head_dim_k, k_rows = spec.n_kv_heads * spec.head_dim_k,
                      v_rows = spec.n_kv_heads * spec.head_dim_v, o_cols = spec.n_q_heads * spec.head_dim_v;
        load_qkv(checkpoint, p, q_rows, k_rows, v_rows, w);
        w.o_proj = load_matrix(checkpoint, {p + "self_attn.o_proj.weight"}, {hidden, o_cols}, {hidden, o_cols},
                               w.o_proj_scale);
        if (config_.qk_norm) {
            w.q_norm = load(checkpoint, p + "self_attn.q_norm.weight", {spec.head_dim_k}, true);
            w.k_norm = load(checkpoint, p + "self_attn.k_norm.weight", {spec.head_dim_k}, true);
        }
        if (spec.has_sinks) {
            // Hub checkpoints name it attention_sink_bias; transformers-native ones sinks.
            const std::string hub_name = p + "self_attn.attention_sink_bias";
            const bool hub = !options_.dummy && checkpoint.has(hub_name);
            w.sinks = load(checkpoint, hub ? hub_name : p + "self_attn.sinks", {spec.n_q_heads}, true);
        }
        if (spec.ffn == FfnKind::dense) {
            const int64_t inter = config_.intermediate_size;
            w.gate_up = load_matrix(checkpoint, {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, {inter, hidden},
                                    {2 * inter, hidden}, w.gate_up_scale);
            w.down = load_matrix(checkpoint, {p + "mlp.down_proj.weight"}, {hidden, inter}, {hidden, inter},
                                 w.down_scale);
        } else {
            w.router = load(checkpoint, p + "mlp.gate.weight", {config_.n_experts, hidden}, true);
            if (config_.router_bias)
                w.router_bias = load(checkpoint, p + "mlp.gate.e_score_correction_bias", {config_.n_experts}, true);
            load_experts(checkpoint, p + "mlp.experts.", w);
        }
    }
    if (!options_.dummy) checkpoint.finish();
}

std::map<DType, uint64_t> DecoderModel::weight_bytes() const {
    std::map<DType, uint64_t> bytes;
    // Buffers do not record dtypes, so sum over the tensors (tied lm_head counted once).
    auto add = [&](const Tensor& t) {
        if (t.data) bytes[t.dtype] += t.nbytes();
    };
    add(embed_tokens_);
    add(final_norm_);
    if (!config_.tie_word_embeddings) add(lm_head_);
    for (const LayerWeights& w : layers_) {
        for (const Tensor* t : {&w.input_norm, &w.post_attn_norm, &w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj, &w.q_norm,
                                &w.k_norm, &w.sinks, &w.gate_up, &w.down, &w.router, &w.router_bias,
                                &w.experts_gate_up, &w.experts_down, &w.q_proj_scale.scale, &w.k_proj_scale.scale,
                                &w.v_proj_scale.scale, &w.o_proj_scale.scale, &w.gate_up_scale.scale,
                                &w.down_scale.scale, &w.experts_gate_up_scale.scale, &w.experts_down_scale.scale})
            add(*t);
    }
    return bytes;
}

namespace {
// Bytes of all the experts of one MoE layer (matrices and block scales); 0 for a dense layer.
uint64_t layer_expert_bytes(const LayerWeights& w) {
    if (!w.experts_gate_up.data) return 0;
    uint64_t bytes = w.experts_gate_up.nbytes() + w.experts_down.nbytes();
    if (!w.experts_gate_up_scale.empty())
        bytes += w.experts_gate_up_scale.scale.nbytes() + w.experts_down_scale.scale.nbytes();
    return bytes;
}
}  // namespace

uint64_t DecoderModel::weight_bytes_per_decode_token() const {
    uint64_t bytes = 0;
    for (const auto& [dtype, n] : weight_bytes()) bytes += n;
    // One embedding row instead of the table (unless the table is also the lm_head).
    if (!config_.tie_word_embeddings) bytes -= embed_tokens_.nbytes() - embed_tokens_.row_bytes();
    // Only top_k of the experts of each MoE layer.
    for (const LayerWeights& w : layers_)
        if (const uint64_t experts = layer_expert_bytes(w))
            bytes -= experts - experts * uint64_t(config_.router.top_k) / uint64_t(config_.n_experts);
    return bytes;
}

uint64_t DecoderModel::expert_weight_bytes() const {
    for (const LayerWeights& w : layers_)
        if (const uint64_t experts = layer_expert_bytes(w)) return experts / uint64_t(config_.n_experts);
    return 0;
}

void DecoderModel::forward(const ForwardBatch& batch, const Tensor& logits) {
    const int64_t n_tokens = batch.n_tokens, hidden = config_.hidden_size;
    XINFER_CHECK(batch.layer_group.size() == config_.layers.size() && batch.caches.size() == config_.layers.size(),
                 "batch has {} layer groups / {} caches for {} layers", batch.layer_group.size(), batch.caches.size(),
                 config_.layers.size());
    const float eps = config_.rms_norm_eps;
    workspace_.reset();
    Workspace& scratch = workspace_;
    const DType act = act_dtype_;
    auto tap = [&](std::string_view name, int layer, const Tensor& t) {
        if (batch.tap) batch.tap(name, layer, t);
    };

    Tensor residual = scratch.make(act, {n_tokens, hidden});  // the residual stream x
    Tensor normed = scratch.make(act, {n_tokens, hidden});    // RMSNorm(x), input of each block
    Tensor block_out = scratch.make(act, {n_tokens, hidden}); // output of the last block
    backend_.embedding(embed_tokens_, batch.token_ids, residual);
    tap("embedding", -1, residual);

    for (size_t il = 0; il < config_.layers.size(); ++il) {
        const LayerSpec& spec = config_.layers[il];
        const LayerWeights& w = layers_[il];
        const int layer = int(il);
        const int64_t n_q = spec.n_q_heads, n_kv = spec.n_kv_heads, dk = spec.head_dim_k, dv = spec.head_dim_v;
        backend_.set_layer(layer);  // tags every op of this layer (profiler, errors, fault injection)

        // ---- attention ----
        // The previous layer's FFN output is added to the residual stream here (fused with this
        // layer's norm), so that is where the previous layer's output becomes visible. One token
        // with the fused q|k|v projection: the norm and that projection are one op.
        const bool one_qkv_row = n_tokens == 1 && w.qkv_proj.data;
        Tensor qkv;  // [1, q + k + v] when one_qkv_row
        if (one_qkv_row) {
            qkv = scratch.make(act, {1, w.qkv_proj.dim(0)});
            backend_.add_rmsnorm_matmul(residual, il == 0 ? Tensor() : block_out, w.input_norm, eps, normed,
                                        w.qkv_proj, qkv, w.qkv_proj_scale);
        } else if (il == 0) {
            backend_.rmsnorm(residual, w.input_norm, eps, normed);
        } else {
            backend_.add_rmsnorm(residual, block_out, w.input_norm, eps, normed);
        }
        if (il > 0) tap("residual", layer - 1, residual);
        tap("attn_input", layer, normed);

        Tensor q, k, v;  // [n_tokens, n_q, dk], [n_tokens, n_kv, dk], [n_tokens, n_kv, dv]
        if (one_qkv_row) {
            // q, k and v are consecutive slices of the token's one row.
            char* row = static_cast<char*>(qkv.data);
            const size_t element = dtype_size(act);
            q = Tensor(row, act, {1, n_q, dk});
            k = Tensor(row + size_t(n_q * dk) * element, act, {1, n_kv, dk});
            v = Tensor(row + size_t((n_q + n_kv) * dk) * element, act, {1, n_kv, dv});
        } else {
            q = scratch.make(act, {n_tokens, n_q, dk});
            k = scratch.make(act, {n_tokens, n_kv, dk});
            v = scratch.make(act, {n_tokens, n_kv, dv});
            backend_.matmul(normed, w.q_proj, q.reshape({n_tokens, n_q * dk}), w.q_proj_scale);
            backend_.matmul(normed, w.k_proj, k.reshape({n_tokens, n_kv * dk}), w.k_proj_scale);
            backend_.matmul(normed, w.v_proj, v.reshape({n_tokens, n_kv * dv}), w.v_proj_scale);
        }
        if (config_.qk_norm) {
            backend_.rmsnorm(q.reshape({n_tokens * n_q, dk}), w.q_norm, eps, q.reshape({n_tokens * n_q, dk}));
            backend_.rmsnorm(k.reshape({n_tokens * n_kv, dk}), w.k_norm, eps, k.reshape({n_tokens * n_kv, dk}));
        }
        const AttentionBatch& group = batch.groups[size_t(batch.layer_group[il])];
        const LayerCache& cache = batch.caches[il];
        backend_.rope_kv_store(q, k, v, batch.positions, {spec.rotary_dim, spec.rope_theta}, config_.value_scale,
                               cache.k, cache.v, group);
        tap("q", layer, q);
        tap("k", layer, k);
        tap("v", layer, v);
        AttentionParams params;
        params.n_q_heads = spec.n_q_heads;
        params.n_kv_heads = spec.n_kv_heads;
        params.head_dim_k = spec.head_dim_k;
        params.head_dim_v = spec.head_dim_v;
        params.softmax_scale = float(1.0 / std::sqrt(double(dk)));
        params.window = spec.window;
        params.causal = true;
        params.page_size = int(cache.k.dim(1));
        Tensor attn = scratch.make(act, {n_tokens, n_q, dv});
        backend_.attention(q, cache.k, cache.v, w.sinks, group, params, attn);
        tap("attn_output", layer, attn);
        backend_.matmul(attn.reshape({n_tokens, n_q * dv}), w.o_proj, block_out, w.o_proj_scale);
        tap("attn_proj", layer, block_out);

        // ---- feed-forward ----
        // The norm and the one projection it feeds, as one op: the dense FFN's gate_up, or the router.
        const bool dense = spec.ffn == FfnKind::dense;
        const int64_t inter = config_.intermediate_size;
        const Tensor projected = dense ? scratch.make(act, {n_tokens, 2 * inter})                 // gate_up
                                       : scratch.make(DType::f32, {n_tokens, config_.n_experts});  // router logits
        backend_.add_rmsnorm_matmul(residual, block_out, w.post_attn_norm, eps, normed, dense ? w.gate_up : w.router,
                                    projected, dense ? w.gate_up_scale : BlockScales{});
        tap("ffn_input", layer, normed);
        if (dense) {
            const Tensor& gate_up = projected;
            Tensor activated = scratch.make(act, {n_tokens, inter});
            backend_.swiglu(gate_up, activated);
            backend_.matmul(activated, w.down, block_out, w.down_scale);
        } else {
            const Tensor& router_logits = projected;
            const int64_t top_k = config_.router.top_k;
            Tensor expert_ids = scratch.make(DType::i32, {n_tokens, top_k});
            Tensor expert_weights = scratch.make(DType::f32, {n_tokens, top_k});
            tap("router_logits", layer, router_logits);
            if (batch.tap) {  // the routing as its own op, so that its ids and weights can be tapped
                backend_.moe_route(router_logits, w.router_bias, config_.router, expert_ids, expert_weights);
                tap("expert_ids", layer, expert_ids);
                tap("expert_weights", layer, expert_weights);
                backend_.moe_experts(normed, expert_ids, expert_weights, w.experts_gate_up, w.experts_down, block_out,
                                     w.experts_gate_up_scale, w.experts_down_scale);
            } else {
                backend_.moe_route_experts(normed, router_logits, w.router_bias, config_.router, expert_ids,
                                           expert_weights, w.experts_gate_up, w.experts_down, block_out,
                                           w.experts_gate_up_scale, w.experts_down_scale);
            }
        }
        tap("ffn_output", layer, block_out);
    }

    // Final norm (after the last block's residual add), then logits for the requested rows.
    // The final add is still tagged with the last layer: it completes that layer's residual.
    backend_.add_rmsnorm(residual, block_out, final_norm_, eps, normed);
    tap("residual", int(config_.layers.size()) - 1, residual);
    backend_.set_layer(-1);
    tap("final_norm", -1, normed);
    const int64_t n_out = batch.logit_rows.numel();
    Tensor selected = scratch.make(act, {n_out, hidden});
    backend_.embedding(normed, batch.logit_rows, selected);  // row gather: same op as a table lookup
    backend_.matmul(selected, lm_head_, logits);
    tap("logits", -1, logits);
}

}  // namespace xinfer
