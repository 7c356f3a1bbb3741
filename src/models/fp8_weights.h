// Block-scaled FP8 weights kept resident on accelerators (issue 6: the real MiMo-V2-Flash
// checkpoint read as e4m3, 17.0 GB per decode token instead of 29.5 GB of bf16).
//
// The ops take one contiguous scale grid per matrix, scale[r / block_rows, c / block_cols]
// (include/xinfer/backend_abi.h; one params.matmul for both MOE_EXPERTS weights). Checkpoints
// store one grid per tensor, and two things make that differ from what an op receives:
//  - row-stacked parts: gate_proj and up_proj become one gate_up matrix; each part's grid starts at
//    its own first row, so with I % 128 ≠ 0 the part boundary falls inside a 128-row block;
//  - grids that restart per row shard (TP-sharded exports, src/loader/fp8_block.h; MiMo's GA
//    k_proj [768, 4096] has scales [8, 32] = 4 × ceil(192 / 128)).
// Both are made exact by a finer row grid: block_rows = the gcd of the stored block height and
// every part and shard boundary (64 for that k_proj, 32 for gate/up parts of 96 rows), each fine
// block taking the scale of the stored block it lies in. For the real MiMo shapes only k_proj
// needs it; everything else keeps 128 × 128.
#pragma once

#include "backend/backend.h"
#include "loader/fp8_block.h"
#include "models/model.h"

#include <nlohmann/json_fwd.hpp>

#include <span>
#include <vector>

namespace xinfer {

// config.fp8 from config.json's quantization_config ("quant_method": "fp8"; block geometry,
// modules_to_not_convert or ignored_layers). Disabled when there is none.
Fp8WeightConfig read_fp8_weight_config(const nlohmann::json& config, const Fp8BlockConfig& blocks);

// One stored part of a row-stacked matrix: its grid (rows = the part's rows) and its scales
// [grid.scale_rows, grid.scale_cols], row-major.
struct Fp8Part {
    Fp8ScaleGrid grid;
    const float* scales = nullptr;
};

// The block height of the op grid for these row-stacked parts (see the header comment).
int64_t op_block_rows(std::span<const Fp8ScaleGrid> parts);
// Appends the op grid of the stacked parts at `block_rows` (which must divide op_block_rows of
// them): ceil(Σ rows / block_rows) rows of scale_cols scales. All parts share cols and block_cols.
void append_op_scales(std::span<const Fp8Part> parts, int64_t block_rows, std::vector<float>& out);

// Whether `backend` accepts MATMUL x [1, k] (`act`) · f8 w [n, k]ᵀ with scales
// [ceil(n / block_rows), ceil(k / block_cols)] into y [1, n] (`act`).
bool supports_fp8_matmul(Backend& backend, DType act, int64_t n, int64_t k, int64_t block_rows, int64_t block_cols);
// Whether it accepts MOE_EXPERTS over f8 gate_up [E, 2I, H] and down [E, H, I] with per-expert
// scale grids of the given blocks (x, out in `act`; one token, top_k experts).
bool supports_fp8_moe(Backend& backend, DType act, int64_t n_experts, int64_t hidden, int64_t inter, int top_k,
                      int64_t block_rows, int64_t block_cols);

// The residency rule for FP8 matrices: true when they stay e4m3 + scales on `backend`
// (options.fp8_weights "auto", the config quantized, an accelerator, and supports_op accepting
// representative MATMUL and, for MoE models, MOE_EXPERTS descriptions of the model's shapes),
// false when they are dequantized at load (host-memory backends — the oracle — or "dequantize").
bool keep_fp8_weights(const ModelConfig& config, const LoadOptions& options, Backend& backend, DType act);

}  // namespace xinfer
