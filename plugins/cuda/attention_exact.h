// Exact f32 attention (plugins/cuda/attention_exact.cu): the path for f32 activations
// (`--dtype float32`, f32 checkpoints under `--dtype auto`), where the flash kernel's bf16
// tensor cores would round Q, K, V and P to 8 mantissa bits. CUDA cores, f32 throughout, the CPU
// reference's masks and sink rule; made for agreement with the CPU, not for speed.
#pragma once

#include "attention_common.cuh"
#include "common.h"

namespace xcuda {

// True when the exact path can take these dtypes (f32 q/out; float caches, or FP8 K and V).
bool exact_attention_supported(int q_dtype, int out_dtype, int k_dtype, int v_dtype);
int launch_exact_attention(Context* c, const AttnArgs& a);

}  // namespace xcuda
