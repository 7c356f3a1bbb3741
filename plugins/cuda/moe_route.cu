// The MoE router on the device (MOE_ROUTE): scores, group-limited top-k and the routing weights.
#include "common.h"
#include "device_utils.cuh"

#include <algorithm>
#include <cmath>

namespace xcuda {
namespace {

// ---- router --------------------------------------------------------------------------------------

// One block per token. Semantics match the CPU oracle (src/backend/cpu/moe.cpp): scores by
// softmax or sigmoid in f32; selection = scores + bias; DeepSeek group limit (group score = sum
// of the group's top-2 selection scores, keep topk_group groups, others -inf); top_k by
// selection descending, ties to the lower index; weights from the unbiased scores, optionally
// renormalised by (sum + 1e-20), times routed_scaling_factor.
__global__ void route_kernel(const float* logits /*[T, E]*/, const float* bias /*[E] or null*/, int E, int scoring,
                             int top_k, int n_group, int topk_group, int norm_topk_prob, float scaling,
                             int32_t* ids /*[T, top_k]*/, float* weights /*[T, top_k]*/) {
    extern __shared__ float smem[];
    float* scores = smem;                                          // [E]
    float* selection = scores + E;                                 // [E]
    float* group_score = selection + E;                            // [n_group]
    unsigned char* keep_group = reinterpret_cast<unsigned char*>(group_score + n_group);  // [n_group]
    __shared__ float reduce[32];
    __shared__ int32_t chosen[64];
    pdl_begin();

    const int64_t t = blockIdx.x;
    const float* row = logits + t * E;
    if (scoring == 0) {
        float m = -INFINITY;
        for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, row[e]);
        m = warp_max(m);
        if ((threadIdx.x & 31) == 0) reduce[threadIdx.x >> 5] = m;
        __syncthreads();
        float max_logit = -INFINITY;
        for (int w = 0; w < int((blockDim.x + 31) >> 5); ++w) max_logit = fmaxf(max_logit, reduce[w]);
        float partial = 0.f;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            scores[e] = expf(row[e] - max_logit);
            partial += scores[e];
        }
        const float sum = block_sum(partial, reduce);
        for (int e = threadIdx.x; e < E; e += blockDim.x) scores[e] /= sum;
    } else {
        for (int e = threadIdx.x; e < E; e += blockDim.x) scores[e] = 1.f / (1.f + expf(-row[e]));
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) selection[e] = scores[e] + (bias ? bias[e] : 0.f);
    __syncthreads();

    if (topk_group < n_group) {
        const int group_size = E / n_group;
        for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
            float best = -INFINITY, second = -INFINITY;
            for (int i = 0; i < group_size; ++i) {
                const float v = selection[g * group_size + i];
                if (v > best) {
                    second = best;
                    best = v;
                } else if (v > second) {
                    second = v;
                }
            }
            group_score[g] = group_size >= 2 ? best + second : best;
            keep_group[g] = 0;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int i = 0; i < topk_group; ++i) {
                int best = -1;
                for (int g = 0; g < n_group; ++g)
                    if (!keep_group[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
                keep_group[best] = 1;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (!keep_group[e / group_size]) selection[e] = -INFINITY;
        __syncthreads();
    }

    // Top-k by rank, in one pass (a loop of top_k block-wide argmax reductions cost ~5 µs of
    // barriers per decode step and layer): an expert's rank is the number of experts that beat
    // it, by selection descending, ties to the lower index; NaN never beats and is never chosen.
    // Ranks of the non-NaN experts are distinct, so chosen[rank] = e fills slots 0..min(k, n)-1;
    // the rest stay -1.
    for (int i = threadIdx.x; i < top_k; i += blockDim.x) chosen[i] = -1;
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float v = selection[e];
        if (isnan(v)) continue;
        int rank = 0;
        for (int f = 0; f < E; ++f) {
            const float u = selection[f];
            rank += u > v || (u == v && f < e);  // false for a NaN u
        }
        if (rank < top_k) chosen[rank] = e;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int i = 0; i < top_k; ++i) sum += chosen[i] >= 0 ? scores[chosen[i]] : 0.f;
        const float factor = scaling / (norm_topk_prob ? sum + 1e-20f : 1.f);
        for (int i = 0; i < top_k; ++i) {
            ids[t * top_k + i] = chosen[i];
            weights[t * top_k + i] = (chosen[i] >= 0 ? scores[chosen[i]] : 0.f) * factor;
        }
    }
}

}  // namespace

int op_moe_route(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &logits = op->src[0], &bias = op->src[1], &ids = op->dst[0], &weights = op->dst[1];
    const xinfer_route_params& rp = op->params.route;
    if (logits.dtype != XINFER_DTYPE_F32 || logits.rank != 2)
        return unsupported(c, op, "logits %s must be f32 [T, E]", shape_str(logits).c_str());
    const int64_t T = logits.shape[0], E = logits.shape[1];
    if (!absent(bias) && (bias.dtype != XINFER_DTYPE_F32 || numel(bias) != E))
        return unsupported(c, op, "bias %s must be f32 [%lld]", shape_str(bias).c_str(), (long long)E);
    if (ids.dtype != XINFER_DTYPE_I32 || weights.dtype != XINFER_DTYPE_F32 || ids.rank != 2 || weights.rank != 2 ||
        ids.shape[0] != T || ids.shape[1] != rp.top_k || weights.shape[0] != T || weights.shape[1] != rp.top_k)
        return unsupported(c, op, "ids %s / weights %s must be i32 / f32 [T=%lld, top_k=%d]", shape_str(ids).c_str(),
                           shape_str(weights).c_str(), (long long)T, rp.top_k);
    if (rp.scoring != 0 && rp.scoring != 1) return unsupported(c, op, "scoring %d (0 softmax, 1 sigmoid)", rp.scoring);
    if (rp.n_group < 1 || E % rp.n_group != 0 || rp.topk_group < 1 || rp.topk_group > rp.n_group)
        return unsupported(c, op, "n_group %d must divide E=%lld and topk_group %d be in [1, n_group]", rp.n_group,
                           (long long)E, rp.topk_group);
    if (rp.top_k < 1 || rp.top_k > 64 || rp.top_k > rp.topk_group * (E / rp.n_group))
        return unsupported(c, op, "top_k %d must be in [1, min(64, topk_group x experts per group = %lld)]", rp.top_k,
                           (long long)(rp.topk_group * (E / rp.n_group)));
    const size_t smem = size_t(2 * E + rp.n_group) * sizeof(float) + size_t(rp.n_group);
    if (smem > 48 * 1024) return unsupported(c, op, "E=%lld experts exceed the router's shared memory", (long long)E);
    if (!run || T == 0) return XINFER_OK;
    const int threads = int(std::min<int64_t>(256, std::max<int64_t>(32, ceil_div(E, 32) * 32)));
    return launch_pdl(c, "route_kernel", route_kernel, dim3(unsigned(T)), dim3(threads), smem,
                      static_cast<const float*>(logits.data),
                      absent(bias) ? nullptr : static_cast<const float*>(bias.data), int(E), rp.scoring, rp.top_k,
                      rp.n_group, rp.topk_group, rp.norm_topk_prob, rp.routed_scaling_factor,
                      static_cast<int32_t*>(ids.data), static_cast<float*>(weights.data));
}

}  // namespace xcuda
