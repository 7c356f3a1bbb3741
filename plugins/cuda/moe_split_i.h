// One token's FP8 experts in one weight-streaming kernel, split by I (moe_split_i.cu).
#pragma once

#include "common.h"
#include "moe_route.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace xcuda {

struct SplitIMoe {
    const __nv_bfloat16* x = nullptr;  // [1, H]
    const int32_t* ids = nullptr;      // [top_k] (unused with route.logits)
    const float* weights = nullptr;    // [top_k] (unused with route.logits)
    int top_k = 0, E = 0;
    const uint8_t* gate_up = nullptr;  // [E, 2I, H] e4m3
    const float* gate_up_scale = nullptr;  // [E, gu_scale_rows, gu_scale_cols]
    int64_t gu_scale_rows = 0, gu_scale_cols = 0;
    const uint8_t* down = nullptr;     // [E, H, I] e4m3
    const float* down_scale = nullptr;     // [E, dn_scale_rows, dn_scale_cols]
    int64_t dn_scale_rows = 0, dn_scale_cols = 0;
    int block_rows = 0, block_cols = 0;  // of both weights' scale blocks
    int64_t I = 0, H = 0;
    float* partial = nullptr;   // scratch [top_k, I / 64, H]: each block's part of down · h
    int32_t* chosen = nullptr;  // scratch [top_k]: the experts the blocks used
    float* chosen_weight = nullptr;  // scratch [top_k]: their routing weights
    void* out = nullptr;        // [1, H]
    int out_dtype = 0;
    RouteArgs route{};  // logits null: ids and weights above
};

// XINFER_CUDA_MOE_SPLIT_I=0 keeps the two grouped ring kernels for one FP8 token.
bool moe_split_i_enabled();
// Shapes the kernel takes (the caller has checked what the grouped ring path needs: 16-byte
// aligned rows, block_cols % 64 == 0, block_rows % 16 == 0).
bool moe_split_i_fits(int64_t H, int64_t I, int block_rows, int block_cols);
// Scratch bytes for partial (the caller lays out partial, chosen and chosen_weight).
size_t moe_split_i_partial_bytes(int64_t top_k, int64_t H, int64_t I);
int launch_moe_split_i(Context* c, const SplitIMoe& a);

}  // namespace xcuda
