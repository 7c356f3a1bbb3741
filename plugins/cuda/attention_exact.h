// Exact f32 attention (plugins/cuda/attention_exact.cu): the path for f32 activations
// (`--dtype float32`, f32 checkpoints under `--dtype auto`), where the flash kernel's bf16
// tensor cores would round Q, K, V and P to 8 mantissa bits. CUDA cores, f32 throughout, the CPU
// reference's masks and sink rule; made for agreement with the CPU, not for speed.
#pragma once

#include "common.h"

namespace xcuda {

struct ExactAttentionArgs {
    const float* q;            // [T, nq, dk]
    const void* k_cache;       // pages of [page_size, nkv, dk] (f32/bf16/f16), k_page_stride elements apart
    const void* v_cache;       // pages of [page_size, nkv, dv], v_page_stride elements apart
    const float* sinks;        // [nq] or null
    float* out;                // [T, nq, dv]
    const int32_t* cu_q_lens;  // [n_seqs + 1]
    const int32_t* kv_lens;    // [n_seqs]
    const int32_t* positions;  // [T]
    const int32_t* page_table; // [n_seqs, max_pages]
    int64_t k_page_stride, v_page_stride, T;
    int k_dtype, v_dtype;
    int n_seqs, max_pages, page_size;
    int nq, nkv, dk, dv;
    float scale;
    int window, causal;
};

// True when the exact path can take these dtypes (f32 q/out, non-fp8 caches).
bool exact_attention_supported(int q_dtype, int out_dtype, int k_dtype, int v_dtype);
int launch_exact_attention(Context* c, const ExactAttentionArgs& a);

}  // namespace xcuda
