#include "models/fp8_weights.h"

#include "backend/op_desc.h"
#include "core/status.h"

#include <nlohmann/json.hpp>

#include <numeric>

namespace xinfer {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

xinfer_tensor abi_shape(DType dtype, std::initializer_list<int64_t> shape) {
    return to_abi(Tensor(nullptr, dtype, shape));
}

}  // namespace

bool Fp8WeightConfig::quantizes(std::string_view tensor) const {
    if (!enabled) return false;
    std::string_view module = tensor;
    if (module.ends_with(".weight")) module.remove_suffix(7);
    for (const std::string& entry : not_converted) {
        if (module == entry) return false;
        if (module.size() > entry.size() && module.starts_with(entry) && module[entry.size()] == '.') return false;
        if (module.size() > entry.size() && module.ends_with(entry) && module[module.size() - entry.size() - 1] == '.')
            return false;
    }
    return true;
}

Fp8WeightConfig read_fp8_weight_config(const nlohmann::json& config, const Fp8BlockConfig& blocks) {
    Fp8WeightConfig fp8;
    if (!blocks.enabled) return fp8;
    fp8.enabled = true;
    fp8.block_rows = blocks.block_rows;
    fp8.block_cols = blocks.block_cols;
    const nlohmann::json& quantization = config.at("quantization_config");
    for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
        if (!quantization.contains(key) || quantization.at(key).is_null()) continue;
        for (const nlohmann::json& entry : quantization.at(key)) {
            if (!entry.is_string()) fail("quantization_config.{}: expected a list of module names", key);
            fp8.not_converted.push_back(entry.get<std::string>());
        }
    }
    return fp8;
}

int64_t op_block_rows(std::span<const Fp8ScaleGrid> parts) {
    XINFER_CHECK(!parts.empty(), "op_block_rows of no parts");
    int64_t block = parts.front().block_rows, offset = 0;
    for (const Fp8ScaleGrid& part : parts) {
        block = std::gcd(block, offset);  // the part starts a block
        block = std::gcd(block, part.block_rows);
        if (part.shard_count > 1) block = std::gcd(block, part.shard_rows());  // shards restart the grid
        offset += part.rows;
    }
    return block;
}

void append_op_scales(std::span<const Fp8Part> parts, int64_t block_rows, std::vector<float>& out) {
    XINFER_CHECK(!parts.empty() && block_rows > 0, "append_op_scales: {} parts, block_rows {}", parts.size(),
                 block_rows);
    std::vector<Fp8ScaleGrid> grids;
    int64_t total_rows = 0;
    const int64_t scale_cols = parts.front().grid.scale_cols;
    for (const Fp8Part& part : parts) {
        XINFER_CHECK(part.grid.scale_cols == scale_cols && part.grid.cols == parts.front().grid.cols &&
                         part.grid.block_cols == parts.front().grid.block_cols,
                     "stacked fp8 parts disagree on columns: {} cols / {} scale cols vs {} / {}", part.grid.cols,
                     part.grid.scale_cols, parts.front().grid.cols, scale_cols);
        grids.push_back(part.grid);
        total_rows += part.grid.rows;
    }
    const int64_t natural = op_block_rows(grids);
    XINFER_CHECK(natural % block_rows == 0, "fp8 op grid of {} rows per block does not refine {}", block_rows, natural);
    size_t part = 0;
    int64_t part_start = 0;
    for (int64_t row = 0; row < total_rows; row += block_rows) {
        while (row >= part_start + parts[part].grid.rows) part_start += parts[part++].grid.rows;
        const Fp8ScaleGrid& grid = parts[part].grid;
        const float* scale_row = parts[part].scales + grid.scale_row_of(row - part_start) * scale_cols;
        out.insert(out.end(), scale_row, scale_row + scale_cols);
    }
}

bool supports_fp8_matmul(Backend& backend, DType act, int64_t n, int64_t k, int64_t block_rows, int64_t block_cols) {
    xinfer_op op = make_op(XINFER_OP_MATMUL, -1);
    op.name = "fp8 residency probe";
    op.src[0] = abi_shape(act, {1, k});
    op.src[1] = abi_shape(DType::f8_e4m3, {n, k});
    op.src[2] = abi_shape(DType::f32, {ceil_div(n, block_rows), ceil_div(k, block_cols)});
    op.dst[0] = abi_shape(act, {1, n});
    op.params.matmul.block_rows = int32_t(block_rows);
    op.params.matmul.block_cols = int32_t(block_cols);
    return backend.supports(op);
}

bool supports_fp8_moe(Backend& backend, DType act, int64_t n_experts, int64_t hidden, int64_t inter, int top_k,
                      int64_t block_rows, int64_t block_cols) {
    xinfer_op op = make_op(XINFER_OP_MOE_EXPERTS, -1);
    op.name = "fp8 residency probe";
    op.src[0] = abi_shape(act, {1, hidden});
    op.src[1] = abi_shape(DType::i32, {1, top_k});
    op.src[2] = abi_shape(DType::f32, {1, top_k});
    op.src[3] = abi_shape(DType::f8_e4m3, {n_experts, 2 * inter, hidden});
    op.src[4] = abi_shape(DType::f8_e4m3, {n_experts, hidden, inter});
    op.src[5] = abi_shape(DType::f32, {n_experts, ceil_div(2 * inter, block_rows), ceil_div(hidden, block_cols)});
    op.src[6] = abi_shape(DType::f32, {n_experts, ceil_div(hidden, block_rows), ceil_div(inter, block_cols)});
    op.dst[0] = abi_shape(act, {1, hidden});
    op.params.matmul.block_rows = int32_t(block_rows);
    op.params.matmul.block_cols = int32_t(block_cols);
    return backend.supports(op);
}

bool keep_fp8_weights(const ModelConfig& config, const LoadOptions& options, Backend& backend, DType act) {
    if (options.fp8_weights != "auto" && options.fp8_weights != "keep" && options.fp8_weights != "dequantize")
        fail("--fp8-weights \"{}\": expected auto, keep or dequantize", options.fp8_weights);
    if (options.fp8_weights == "dequantize" || !config.fp8.enabled || backend.props().host_memory) return false;
    // FP8 kernels widen the weights into bf16 math; under "auto", f32 activations (--dtype
    // float32, the exact mode the golden tests gate on) get exact f32 dequantized weights instead.
    if (act == DType::f32 && options.fp8_weights == "auto") return false;
    const int64_t hidden = config.hidden_size;
    const Fp8WeightConfig& fp8 = config.fp8;
    bool moe = false;
    for (const LayerSpec& l : config.layers) moe = moe || l.ffn == FfnKind::moe;
    const LayerSpec& first = config.layers.front();
    if (!supports_fp8_matmul(backend, act, int64_t(first.n_q_heads) * first.head_dim_k, hidden, fp8.block_rows,
                             fp8.block_cols))
        return false;
    if (moe) {
        // The op grid the loader builds for stacked gate/up parts of moe_intermediate rows.
        const int64_t inter = config.moe_intermediate_size;
        const Fp8ScaleGrid part{inter, hidden, fp8.block_rows, fp8.block_cols, ceil_div(inter, fp8.block_rows),
                                ceil_div(hidden, fp8.block_cols), 1};
        const Fp8ScaleGrid parts[] = {part, part};
        if (!supports_fp8_moe(backend, act, config.n_experts, hidden, config.moe_intermediate_size, config.router.top_k,
                              op_block_rows(parts), fp8.block_cols))
            return false;
    }
    return true;
}

}  // namespace xinfer
