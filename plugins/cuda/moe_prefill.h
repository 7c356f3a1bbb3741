// MOE_EXPERTS for prefill-sized batches: one cuBLASLt GEMM per expert (moe_prefill.cu).
#pragma once

#include "common.h"

#include <cstdint>

namespace xcuda {

// The path runs from this many (token, slot) pairs on, outside graph capture.
constexpr int64_t kPerExpertGemmMinPairs = 2048;

// XINFER_CUDA_MOE_PER_EXPERT_GEMM=0 turns the path off.
bool moe_per_expert_gemm_enabled();

struct PerExpertArgs {
    const xinfer_tensor *x, *gate_up, *down, *gate_up_scale, *down_scale, *out;
    const int32_t* ids;
    const float* weights;
    int64_t T, H, I, E, top_k, block_rows, block_cols;
};

int moe_per_expert_gemm(Context* c, const PerExpertArgs& a);

}  // namespace xcuda
