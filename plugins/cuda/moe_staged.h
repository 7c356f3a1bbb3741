// MOE_EXPERTS for serving batches: bf16 experts staged through shared memory (moe_staged.cu).
#pragma once

#include "common.h"

#include <cuda_bf16.h>

namespace xcuda {

struct StagedMoe {
    const __nv_bfloat16* x = nullptr;  // [T, H]
    const int32_t* ids = nullptr;      // [T, top_k]
    const float* weights = nullptr;    // [T, top_k]
    int T = 0, top_k = 0, E = 0;
    const __nv_bfloat16* gate_up = nullptr;  // [E, 2I, H]
    const __nv_bfloat16* down = nullptr;     // [E, H, I]
    int64_t I = 0, H = 0;
    __nv_bfloat16* h = nullptr;  // scratch [T·top_k, I]
    float* dn = nullptr;         // scratch [T·top_k, H]
    void* out = nullptr;         // [T, H]
    int out_dtype = 0;
};

// XINFER_CUDA_MOE_STAGED=0 turns the path off.
bool moe_staged_enabled();
// Shapes the kernels take: P = T·top_k pairs whose in-block plan fits shared memory beside the
// ring, whole 64-column stages and row tiles (H % 128, I % 64), 16-byte aligned rows (the caller
// checks the pointers).
bool moe_staged_fits(int64_t P, int64_t E, int64_t H, int64_t I);
int launch_moe_staged(Context* c, const StagedMoe& a);

}  // namespace xcuda
