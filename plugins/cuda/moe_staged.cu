// MOE_EXPERTS for serving batches (bf16 experts, ~16 to 64 tokens): each touched expert's weights
// stream through shared memory once per pass of up to 64 of its (token, slot) pairs.
//
// Why not the register-streaming grouped kernels of moe.cu: they read each pair's activations from
// global memory once per 16 weight rows and re-stream an expert's weights once per 32 pairs. With
// dummy-weight serving routing (a handful of experts picked by nearly every token: 24 of 32 experts
// touched by 64 tokens) the MoE op ran at 37% of copy bandwidth and took 76% of the step.
//
// A block owns one work item (an expert and a pass of ≤ 64 of its pairs) × one tile of output rows:
//   gate_up: 64 rows i of I; warp w's 16 mma rows are gate rows i0+8w .. +7 then up rows i0+8w .. +7,
//            so each lane holds gate and up of the same (i, pair) and applies swiglu in registers:
//            h[pair, i] = silu(bf16(gate)) · bf16(up), stored bf16 (as moe.cu's kernels round it);
//   down:    128 rows n of H (16 per warp): dn[pair, n] in f32, summed in slot order afterwards by
//            combine_kernel, so the result is deterministic.
// The tiles stream through shared memory and tensor cores as staged_mma.cuh describes.
// Work items are counted on the device from the ids (moe_block_plan), so the launch needs no host
// read: grid.y is an upper bound and blocks past the last item exit.
// XINFER_CUDA_MOE_STAGED=0 keeps moe.cu's grouped kernels for every batch.
#include "moe_staged.h"

#include "moe_common.cuh"
#include "staged_mma.cuh"

#include <algorithm>

namespace xcuda {
namespace {

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 2)
    moe_staged_kernel(const __nv_bfloat16* act /*gate_up: x [T, H]; down: h [P, I]*/, const int32_t* ids /*[P]*/,
                      int P, int top_k, int E, const __nv_bfloat16* w /*gate_up [E, 2I, H]; down [E, H, I]*/,
                      int64_t I, int64_t H, __nv_bfloat16* h_out /*[P, I] (gate_up)*/, float* dn /*[P, H] (down)*/) {
    extern __shared__ __align__(128) uint4 ring[];  // [kStages][kTileRows + kTileActs][kUnits], then the plan
    int* plan = reinterpret_cast<int*>(ring + kStages * kStageUnits);
    int *cnt = plan, *end = cnt + E, *list = end + E, *slot_expert = list + P;
    const int64_t K = kGateUp ? H : I;  // reduction length
    // gate_up reads the router's ids; down's plan reads them too (complete: the router finished
    // before gate_up's blocks passed their wait) but its activations come from gate_up.
    if constexpr (kGateUp) pdl_begin();
    const int nd = moe_block_plan(ids, P, E, cnt, end, list, slot_expert);
    int item = blockIdx.y, e = -1, first = 0, n_pass = 0;
    for (int j = 0; j < nd; ++j) {
        const int x = slot_expert[j], passes = (cnt[x] + kTileActs - 1) / kTileActs;
        if (item < passes) {
            e = x;
            first = item * kTileActs;
            n_pass = min(kTileActs, cnt[x] - first);
            break;
        }
        item -= passes;
    }
    if (e < 0) return;  // block-uniform: past the last work item
    const int* pairs = list + end[e] - cnt[e] + first;  // the pass's pair ids, [n_pass]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const int64_t row0 = int64_t(blockIdx.x) * (kGateUp ? kTileRows / 2 : kTileRows);  // first i (gate_up) or n
    // Per stage this thread copies 4 weight units and 2 activation units (column offset added per stage).
    const __nv_bfloat16* w_src[4];
    int w_dst[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int q = tid + kThreads * m, r = q / kUnits, u = q % kUnits;
        int64_t row = row0 + r;  // down: weight row n
        if constexpr (kGateUp) row = (r % 16 < 8 ? 0 : I) + row0 + 8 * (r / 16) + r % 8;
        w_src[m] = w + (int64_t(e) * (kGateUp ? 2 * I : H) + row) * K + u * 8;
        w_dst[m] = unit(r, u);
    }
    const __nv_bfloat16* a_src[2];
    int a_dst[2];
    bool a_ok[2];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const int q = tid + kThreads * m, p = q / kUnits, u = q % kUnits;
        a_ok[m] = p < n_pass;
        const int64_t src_row = a_ok[m] ? (kGateUp ? pairs[p] / top_k : pairs[p]) : 0;
        a_src[m] = act + src_row * K + u * 8;
        a_dst[m] = kTileRows * kUnits + unit(p, u);
    }
    const auto load_weights = [&](int slot, int64_t k0) {
#pragma unroll
        for (int m = 0; m < 4; ++m) cp_async16(ring + slot * kStageUnits + w_dst[m], w_src[m] + k0, true);
    };
    const auto load_acts = [&](int slot, int64_t k0) {
#pragma unroll
        for (int m = 0; m < 2; ++m) cp_async16(ring + slot * kStageUnits + a_dst[m], a_src[m] + k0, a_ok[m]);
    };

    const int n_tiles = (n_pass + 7) / 8;
    float acc[8][4];
    staged_mma(ring, int(K / kBK), n_tiles, load_weights, load_acts,
               [] {
                   // The down kernel requests its first weight stages before waiting for gate_up's h.
                   if constexpr (!kGateUp) pdl_begin();
               },
               acc);

    // Accumulator r of tile t: mma row g (+8 for r ≥ 2), pair t·8 + 2c + (r & 1).
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        if (t >= n_tiles) break;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int q = t * 8 + 2 * c + r;
            if (q >= n_pass) continue;
            const int64_t pair = pairs[q];
            if constexpr (kGateUp) {
                const float gv = round_to(XINFER_DTYPE_BF16, acc[t][r]), uv = round_to(XINFER_DTYPE_BF16, acc[t][r + 2]);
                h_out[pair * I + row0 + 8 * warp + g] = __float2bfloat16_rn(gv / (1.f + expf(-gv)) * uv);
            } else {
                const int64_t n = row0 + 16 * warp + g;
                dn[pair * H + n] = acc[t][r];
                dn[pair * H + n + 8] = acc[t][r + 2];
            }
        }
    }
}

size_t staged_smem_bytes(int64_t P, int64_t E) { return kRingBytes + size_t(moe_plan_ints(P, E)) * 4; }

}  // namespace

bool moe_staged_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_MOE_STAGED", true);
    return enabled;
}

bool moe_staged_fits(int64_t P, int64_t E, int64_t H, int64_t I) {
    // Row tiles are whole 64-column stages too: kTileRows / 2 == kBK.
    static_assert(kTileRows % kBK == 0 && (kTileRows / 2) % kBK == 0);
    return P >= 1 && H % kTileRows == 0 && I % (kTileRows / 2) == 0 && staged_smem_bytes(P, E) <= 200 * 1024;
}

int launch_moe_staged(Context* c, const StagedMoe& a) {
    const int P = a.T * a.top_k;
    const size_t smem = staged_smem_bytes(P, a.E);
    const unsigned items = unsigned(ceil_div(int64_t(P), int64_t(kTileActs)) + std::min(P, a.E));
    for (auto kernel : {moe_staged_kernel<true>, moe_staged_kernel<false>})
        XCUDA_TRY(c, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    if (int rc = launch_pdl(c, "moe_staged_kernel<gate_up>", moe_staged_kernel<true>,
                            dim3(unsigned(a.I / (kTileRows / 2)), items), dim3(kThreads), smem, a.x, a.ids, P,
                            a.top_k, a.E, a.gate_up, a.I, a.H, a.h, static_cast<float*>(nullptr)))
        return rc;
    if (int rc = launch_pdl(c, "moe_staged_kernel<down>", moe_staged_kernel<false>,
                            dim3(unsigned(a.H / kTileRows), items), dim3(kThreads), smem,
                            static_cast<const __nv_bfloat16*>(a.h), a.ids, P, a.top_k, a.E, a.down, a.I, a.H,
                            static_cast<__nv_bfloat16*>(nullptr), a.dn))
        return rc;
    return launch_combine(c, a.dn, nullptr, a.ids, a.weights, a.top_k, a.E, a.T, a.H, a.out, a.out_dtype);
}

}  // namespace xcuda
