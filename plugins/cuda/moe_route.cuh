// One token's MoE routing by a whole block (route_token), for the router kernel (MOE_ROUTE) and
// for the expert kernels that route a token themselves (MOE_ROUTE_EXPERTS, moe.cu).
#pragma once

#include "common.h"
#include "device_utils.cuh"

#include <xinfer/backend_abi.h>

#include <cmath>

namespace xcuda {

// The top-k goes in two passes (route_token): each warp ranks a chunk of 32 experts among
// themselves with shuffles and keeps at most min(top_k, 32) of them as candidates; the candidates
// are then ranked against each other. Exact: an expert in the top k is beaten by fewer than k
// experts, each of which is a candidate of its own chunk.
__host__ __device__ inline int route_candidate_slots(int E, int top_k) {
    return (E + 31) / 32 * (top_k < 32 ? top_k : 32);
}
// The candidate arrays come first in the scratch, padded to whole 16-byte vectors.
__host__ __device__ inline int route_candidate_words(int E, int top_k) { return (route_candidate_slots(E, top_k) + 3) / 4 * 4; }

// Shared memory route_token needs, in 4-byte words: scores and selection [E], group scores and
// flags [n_group], candidates' values and ids, the chosen ids and weights [top_k], a reduction's 32.
// (top_k is at most 64: check_route.)
__host__ __device__ inline int route_scratch_words(int E, int n_group, int top_k) {
    return 2 * route_candidate_words(E, top_k) + 2 * E + 2 * n_group + 2 * top_k + 32;
}

struct RouteScratch {
    float* cand_value;  // 16-byte aligned, as cand_expert
    int* cand_expert;
    float *scores, *selection, *group_score;
    int* keep_group;
    int* chosen;     // [top_k] the token's experts, best first (-1: none left, NaN scores)
    float* weight;   // [top_k] their routing weights
    float* reduce;   // [32]
};

__device__ inline RouteScratch route_scratch_at(void* base /*16-byte aligned*/, int E, int n_group, int top_k) {
    RouteScratch s;
    s.cand_value = static_cast<float*>(base);
    s.cand_expert = reinterpret_cast<int*>(s.cand_value + route_candidate_words(E, top_k));
    s.scores = reinterpret_cast<float*>(s.cand_expert + route_candidate_words(E, top_k));
    s.selection = s.scores + E;
    s.group_score = s.selection + E;
    s.keep_group = reinterpret_cast<int*>(s.group_score + n_group);
    s.chosen = s.keep_group + n_group;
    s.weight = reinterpret_cast<float*>(s.chosen + top_k);
    s.reduce = s.weight + top_k;
    return s;
}

// Routes one token: every thread of the block calls it (it synchronizes the block), and on return
// s.chosen[0..top_k) and, with `weights`, s.weight[0..top_k) hold the result. Semantics match the
// CPU oracle (src/backend/cpu/moe.cpp): scores by softmax or sigmoid in f32; selection = scores +
// bias; DeepSeek group limit (group score = sum of the group's top-2 selection scores, keep
// topk_group groups, others -inf); top_k by selection descending, ties to the lower index, NaN
// never chosen; weights from the unbiased scores, optionally renormalised by (sum + 1e-20), times
// routed_scaling_factor.
__device__ inline void route_token(const float* row /*[E]*/, const float* bias /*[E] or null*/, int E,
                                   const xinfer_route_params& p, const RouteScratch& s, bool weights) {
    const int tid = threadIdx.x, nthreads = blockDim.x, lane = tid & 31, warp = tid >> 5, n_warps = nthreads >> 5;
    for (int i = tid; i < p.top_k; i += nthreads) s.chosen[i] = -1;
    const int kk = min(p.top_k, 32), n_chunks = (E + 31) / 32, n_slots = n_chunks * kk;
    const int n_words = route_candidate_words(E, p.top_k);
    for (int i = n_slots + tid; i < n_words; i += nthreads) s.cand_expert[i] = -1;  // the padding
    if (p.scoring == 0) {
        float m = -INFINITY;
        for (int e = tid; e < E; e += nthreads) m = fmaxf(m, row[e]);
        m = warp_max(m);
        if (lane == 0) s.reduce[warp] = m;
        __syncthreads();
        float max_logit = -INFINITY;
        for (int w = 0; w < n_warps; ++w) max_logit = fmaxf(max_logit, s.reduce[w]);
        float partial = 0.f;
        for (int e = tid; e < E; e += nthreads) {
            s.scores[e] = expf(row[e] - max_logit);
            partial += s.scores[e];
        }
        const float sum = block_sum(partial, s.reduce);
        for (int e = tid; e < E; e += nthreads) s.scores[e] /= sum;
        for (int e = tid; e < E; e += nthreads) s.selection[e] = s.scores[e] + (bias ? bias[e] : 0.f);
    } else {
        // One pass, the logit and bias loads in flight together (this is on the expert kernels'
        // path from their PDL wait to their first weight request).
        for (int e = tid; e < E; e += nthreads) {
            const float logit = row[e], b = bias ? bias[e] : 0.f;
            const float score = 1.f / (1.f + expf(-logit));
            s.scores[e] = score;
            s.selection[e] = score + b;
        }
    }
    __syncthreads();

    if (p.topk_group < p.n_group) {
        const int group_size = E / p.n_group;
        for (int g = tid; g < p.n_group; g += nthreads) {
            float best = -INFINITY, second = -INFINITY;
            for (int i = 0; i < group_size; ++i) {
                const float v = s.selection[g * group_size + i];
                if (v > best) {
                    second = best;
                    best = v;
                } else if (v > second) {
                    second = v;
                }
            }
            s.group_score[g] = group_size >= 2 ? best + second : best;
            s.keep_group[g] = 0;
        }
        __syncthreads();
        if (tid == 0) {
            for (int i = 0; i < p.topk_group; ++i) {
                int best = -1;
                for (int g = 0; g < p.n_group; ++g)
                    if (!s.keep_group[g] && (best < 0 || s.group_score[g] > s.group_score[best])) best = g;
                s.keep_group[best] = 1;
            }
        }
        __syncthreads();
        for (int e = tid; e < E; e += nthreads)
            if (!s.keep_group[e / group_size]) s.selection[e] = -INFINITY;
        __syncthreads();
    }

    // Candidates: an expert's rank in its chunk of 32 is the number of chunk experts that beat it
    // (selection descending, ties to the lower index; a NaN never beats). Ranks of the non-NaN
    // experts are distinct, so those ranked below kk fill the chunk's first slots; lanes mark the
    // slots left over with -1. With a single chunk these ranks are the final ones.
    for (int ch = warp; ch < n_chunks; ch += n_warps) {
        const int e = ch * 32 + lane;
        const float v = e < E ? s.selection[e] : __int_as_float(0x7fc00000);
        int rank = 0;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const float u = __shfl_sync(0xffffffffu, v, i);
            rank += u > v || (u == v && i < lane);  // false for a NaN u or v
        }
        if (n_chunks == 1) {
            if (!isnan(v) && rank < p.top_k) s.chosen[rank] = e;
            continue;
        }
        const int n_valid = __popc(__ballot_sync(0xffffffffu, !isnan(v)));
        if (!isnan(v) && rank < kk) {
            s.cand_value[ch * kk + rank] = v;
            s.cand_expert[ch * kk + rank] = e;
        }
        if (lane >= n_valid && lane < kk) s.cand_expert[ch * kk + lane] = -1;
    }
    __syncthreads();
    // The candidates' ranks among themselves are their ranks among all experts below top_k: a
    // thread per candidate, reading the others four at a time (broadcast vector loads).
    if (n_chunks > 1) {
        for (int slot = tid; slot < n_slots; slot += nthreads) {
            const int e = s.cand_expert[slot];
            if (e < 0) continue;
            const float v = s.cand_value[slot];
            int rank = 0;
#pragma unroll 4
            for (int o = 0; o < n_words; o += 4) {
                const float4 u = *reinterpret_cast<const float4*>(s.cand_value + o);
                const int4 f = *reinterpret_cast<const int4*>(s.cand_expert + o);
                rank += f.x >= 0 && (u.x > v || (u.x == v && f.x < e));
                rank += f.y >= 0 && (u.y > v || (u.y == v && f.y < e));
                rank += f.z >= 0 && (u.z > v || (u.z == v && f.z < e));
                rank += f.w >= 0 && (u.w > v || (u.w == v && f.w < e));
            }
            if (rank < p.top_k) s.chosen[rank] = e;
        }
        __syncthreads();
    }
    if (weights && warp == 0) {
        float w[2], sum = 0.f;  // top_k <= 64: two per lane
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = lane + 32 * r;
            const int e = i < p.top_k ? s.chosen[i] : -1;
            w[r] = e >= 0 ? s.scores[e] : 0.f;
            sum += w[r];
        }
        sum = warp_sum(sum);
        const float factor = p.routed_scaling_factor / (p.norm_topk_prob ? sum + 1e-20f : 1.f);
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (lane + 32 * r < p.top_k) s.weight[lane + 32 * r] = w[r] * factor;
    }
    if (weights) __syncthreads();
}

// A token's routing inside the expert kernels (MOE_ROUTE_EXPERTS): logits null means the kernel
// reads ids and weights given by MOE_ROUTE instead.
struct RouteArgs {
    const float* logits;  // [T, E] f32
    const float* bias;    // [E] f32 or null
    xinfer_route_params params;
    int scratch_offset;   // bytes into the kernel's dynamic shared memory (16-byte aligned)
};

// MOE_EXPERTS (moe.cu); with `route`, each token routed inside the grouped kernels instead of read
// from op->src[1..2], which then only give the ids' and weights' shapes (MOE_ROUTE_EXPERTS).
int run_moe_experts(Context* c, const xinfer_op* op, bool run, const RouteArgs* route);

}  // namespace xcuda
