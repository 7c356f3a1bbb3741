// Mixture-of-experts on the device: the grouped expert FFN (MOE_EXPERTS); the router (MOE_ROUTE)
// is in moe_route.cu.
//
// MOE_EXPERTS never reads routing decisions on the host (so it can be captured in a graph):
//   1. count the (token, slot) pairs per expert                         counts[E]
//   2. one block turns counts into offsets and a list of ≤64-row tiles  tiles[max_tiles], n_tiles
//      (each tile = one expert's rows), sized by an upper bound known on the host:
//      max_tiles = ceil(P / 64) + min(E, P), P = T · top_k pairs
//   3. scatter pair ids into expert-sorted order                        sorted[P]
//   4. gate_up GEMM over the tiles, gathering x rows on the fly         gu[P, 2I] bf16 (sorted order)
//   5. swiglu                                                           h[P, I] bf16
//   6. down GEMM, scattering each row to its pair id                    dn[P, H] f32 (pair order)
//   7. combine: out[t] = Σ_slot weight[t, slot] · dn[t·k + slot]        fixed order → deterministic
// The order of rows inside an expert's block depends on atomics, but every row is computed
// independently and the combine sums in slot order, so results are bitwise reproducible.
//
// Prefill chunks (P ≥ 2,048 pairs, outside graph capture) take one cuBLASLt GEMM per expert
// instead, after reading the per-expert row counts on the host (moe_prefill.cu).
// Few tokens (decode, verification, small serving batches; bf16 or FP8 block-scaled experts) take
// the grouped path instead: two tensor-core weight streams that read each touched expert's weights
// once, whatever the number of tokens that chose it (see "few-token experts grouped by expert").
// A single bf16 token's gate_up runs on the per-pair stream kernel there (every pair has its own
// expert, and its loads are row-contiguous; see launch_stream_gate_up). bf16 serving batches whose
// busiest expert may see more than 8 pairs go through shared memory instead (moe_staged.cu), and
// with XINFER_CUDA_MOE_SPLIT_I=1 one FP8 token takes one kernel split by I (moe_split_i.cu).
// XINFER_CUDA_MOE_GROUPED=0
// keeps the paths from before it: per-pair bf16 streams and, for fp8, the GEMV kernel (gemm.cu:
// each pair's rows straight from ids, one warp per output column) for P ≤ kGemvMaxPairs;
// XINFER_CUDA_MOE_STREAM=0 turns both stream paths off.
#include "gemm.h"
#include "moe_common.cuh"
#include "moe_prefill.h"
#include "moe_route.cuh"
#include "moe_split_i.h"
#include "moe_staged.h"

#include "device_utils.cuh"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace xcuda {
namespace {

// Up to this many (token, slot) pairs the per-pair paths run when the grouped path does not
// (XINFER_CUDA_MOE_GROUPED=0, or shapes it refuses). Measured on H200, MiMo shapes, fp8: T=1
// 0.26 ms GEMV vs 0.33 ms tiled; T=32 (P=256) 7.0 ms GEMV vs 5.7 ms tiled, since each pair
// re-streams its expert's rows.
constexpr int64_t kGemvMaxPairs = 64;

// ---- grouped experts -----------------------------------------------------------------------------

// ---- few-pair bf16 experts: two fused weight streams ---------------------------------------------
// Decode and verification (P = T·top_k ≤ kGemvMaxPairs pairs) read each chosen expert's weights
// once per pair; the op is a pure weight stream, so the kernels are built to keep HBM busy:
//   gate_up_swiglu: one warp per (pair, i) streams gate row i and up row i of the pair's expert
//                   together (16-byte loads, kStreamUnroll of each in flight per lane) and
//                   writes h[p, i] = silu(g)·u; gate and up are rounded to bf16 first, as the
//                   tiled path stores them, and h is stored in bf16.
//   down_combine:   one warp per (token, output column n) streams down row n of each of the
//                   token's top_k experts (two slots at a time) and sums weight · (row · h) in
//                   slot order, so the weighted combine is fused and the result deterministic.
// Two launches instead of four, no f32 [P, H] intermediate. An expert id outside [0, E) makes its
// token's output NaN, as on the other paths.

constexpr int kStreamWarps = 8;
constexpr int kStreamUnroll = 8;  // 16-byte loads per weight row in flight per lane


__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
    const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
    const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 a = __bfloat1622float2(wp[e]), b = __bfloat1622float2(xp[e]);
        acc = fmaf(a.x, b.x, acc);
        acc = fmaf(a.y, b.y, acc);
    }
    return acc;
}

// Sixteen e4m3 weights (exact through f16) against sixteen bf16 activations, f32 sums.
__device__ __forceinline__ float dot16_e4m3(uint4 w, uint4 x0, uint4 x1) {
    const __nv_fp8x2_storage_t* wp = reinterpret_cast<const __nv_fp8x2_storage_t*>(&w);
    const __nv_bfloat162* xp0 = reinterpret_cast<const __nv_bfloat162*>(&x0);
    const __nv_bfloat162* xp1 = reinterpret_cast<const __nv_bfloat162*>(&x1);
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float2 a = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(wp[e], __NV_E4M3)));
        const float2 b = __bfloat1622float2(e < 4 ? xp0[e] : xp1[e - 4]);
        acc = fmaf(a.x, b.x, acc);
        acc = fmaf(a.y, b.y, acc);
    }
    return acc;
}

// The down stream reads bf16 weights (8 per 16-byte chunk) or e4m3 weights (16 per chunk, times the
// block scale of the chunk: block_cols % 16 == 0 puts a chunk inside one scale block).
template <bool kFp8>
struct StreamWeights {
    static constexpr int kBytes = kFp8 ? 1 : 2, kLaneCols = 16 / kBytes;
    // acc + the chunk w (columns [at, at + kLaneCols) of a row whose block scales start at
    // scale_row) dotted with x[at, at + kLaneCols) (bf16, 16-byte aligned).
    static __device__ __forceinline__ float dot(uint4 w, const __nv_bfloat16* x, int64_t at, const float* scale_row,
                                                int block_cols, float acc) {
        const uint4* xv = reinterpret_cast<const uint4*>(x + at);
        if constexpr (kFp8) return fmaf(__ldg(scale_row + at / block_cols), dot16_e4m3(w, xv[0], xv[1]), acc);
        else return dot8(w, xv[0], acc);
    }
};

// Block scales of an expert matrix [E, rows, cols] stored as [E, scale_rows, scale_cols] (e4m3 only).
struct ExpertScales {
    const float* scale = nullptr;
    int64_t rows = 0, cols = 0;
    int block_rows = 128, block_cols = 128;
    __device__ const float* row(int64_t e, int64_t r) const { return scale + (e * rows + r / block_rows) * cols; }
};

__global__ void __launch_bounds__(kStreamWarps * 32)
    moe_gate_up_swiglu_kernel(const __nv_bfloat16* x /*[T, H]*/, const int32_t* ids /*[P]*/, int top_k, int E,
                              const __nv_bfloat16* gate_up /*[E, 2I, H]*/, int64_t P, int64_t I, int64_t H,
                              __nv_bfloat16* h_out /*[P, I]*/) {
    pdl_begin();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t i = int64_t(blockIdx.x) * kStreamWarps + warp, p = blockIdx.y;
    if (i >= I) return;
    const int32_t e = ids[p];
    if (e < 0 || e >= E) {
        if (lane == 0) h_out[p * I + i] = __float2bfloat16_rn(__int_as_float(0x7fc00000));
        return;
    }
    const __nv_bfloat16* gate = gate_up + (int64_t(e) * 2 * I + i) * H;
    const __nv_bfloat16* up = gate + I * H;
    const __nv_bfloat16* xr = x + (p / top_k) * H;
    float g = 0.f, u = 0.f;
    for (int64_t base = 0; base < H; base += 32 * 8 * kStreamUnroll) {
        uint4 wg[kStreamUnroll], wu[kStreamUnroll];
#pragma unroll
        for (int k = 0; k < kStreamUnroll; ++k) {
            const int64_t at = base + (k * 32 + lane) * 8;
            if (at < H) {
                wg[k] = load_stream16<false>(gate + at);
                wu[k] = load_stream16<false>(up + at);
            }
        }
#pragma unroll
        for (int k = 0; k < kStreamUnroll; ++k) {
            const int64_t at = base + (k * 32 + lane) * 8;
            if (at < H) {
                const uint4 xv = *reinterpret_cast<const uint4*>(xr + at);
                g = dot8(wg[k], xv, g);
                u = dot8(wu[k], xv, u);
            }
        }
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) {
        g = round_to(XINFER_DTYPE_BF16, g);
        u = round_to(XINFER_DTYPE_BF16, u);
        h_out[p * I + i] = __float2bfloat16_rn(g / (1.f + expf(-g)) * u);
    }
}

__global__ void __launch_bounds__(kStreamWarps * 32)
    moe_down_combine_kernel(const __nv_bfloat16* h /*[T·top_k, I]*/, const int32_t* ids /*[T, top_k]*/,
                            const float* weights /*[T, top_k]*/, int top_k, int E,
                            const __nv_bfloat16* down /*[E, H, I]*/, int64_t I, int64_t H, void* out /*[T, H]*/,
                            int out_dtype) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t n = int64_t(blockIdx.x) * kStreamWarps + warp, t = blockIdx.y;
    if (n >= H) return;
    float acc = 0.f;
    bool bad = false;
    for (int s0 = 0; s0 < top_k; s0 += 2) {
        const bool two = s0 + 1 < top_k;
        const int32_t e0 = ids[t * top_k + s0], e1 = two ? ids[t * top_k + s0 + 1] : 0;
        const bool ok0 = e0 >= 0 && e0 < E, ok1 = two && e1 >= 0 && e1 < E;
        bad |= !ok0 || (two && !ok1);
        const __nv_bfloat16* r0 = down + (int64_t(ok0 ? e0 : 0) * H + n) * I;
        const __nv_bfloat16* r1 = down + (int64_t(ok1 ? e1 : 0) * H + n) * I;
        const __nv_bfloat16* h0 = h + (t * top_k + s0) * I;
        const __nv_bfloat16* h1 = h0 + I;
        const float w0 = ok0 ? weights[t * top_k + s0] : 0.f, w1 = ok1 ? weights[t * top_k + s0 + 1] : 0.f;
        float d0 = 0.f, d1 = 0.f;
        for (int64_t base = 0; base < I; base += 32 * 8 * kStreamUnroll) {
            uint4 a0[kStreamUnroll], a1[kStreamUnroll];
#pragma unroll
            for (int k = 0; k < kStreamUnroll; ++k) {
                const int64_t at = base + (k * 32 + lane) * 8;
                if (at < I) {
                    if (ok0) a0[k] = load_stream16<false>(r0 + at);
                    if (ok1) a1[k] = load_stream16<false>(r1 + at);
                }
            }
#pragma unroll
            for (int k = 0; k < kStreamUnroll; ++k) {
                const int64_t at = base + (k * 32 + lane) * 8;
                if (at < I) {
                    if (ok0) d0 = dot8(a0[k], *reinterpret_cast<const uint4*>(h0 + at), d0);
                    if (ok1) d1 = dot8(a1[k], *reinterpret_cast<const uint4*>(h1 + at), d1);
                }
            }
        }
        acc = fmaf(w0, d0, acc);
        acc = fmaf(w1, d1, acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) store_f(out, out_dtype, t * H + n, bad ? __int_as_float(0x7fc00000) : acc);
}

// One token, bf16 or e4m3 down weights: one warp per (output row n, slot s) streams the 16-byte chunks of
// down[e_s][n, :] (a row of I values is contiguous: 512 bytes per load instruction) against
// h[s, :]; a block's 8 warps take its rows_per_block (max(1, 8 / top_k)) rows × top_k slots in
// turn, and the weighted sum over slots is taken in slot order from shared memory. The grouped
// down kernel reads 64 bytes of each of 16 rows per instruction and one expert per warp in turn
// (batch-1 MiMo, 8 experts: 43.9 µs for 134 MB under ncu, 72% of copy bandwidth, while the
// row-contiguous gate_up stream reaches 96%); this one took 36.2 µs. FP8 experts (67 MB): 31.6 µs
// against the grouped kernel's 32.7 — both only half of copy bandwidth: widening 16 e4m3 weights
// to f32 per load costs more instructions than the bytes leave time for.
// Needs I % 8 (e4m3: 16) == 0 and 16-byte aligned down and h rows. XINFER_CUDA_MOE_DOWN_SLOTS=0
// turns it off.
// 16-byte loads in flight per lane: 8 bf16 chunks; 4 e4m3 chunks (the widening needs the registers
// within __launch_bounds__(256, 4), and MiMo's 2,048-byte e4m3 rows are 4 chunks per lane).
template <bool kFp8>
constexpr int kSlotUnroll = kFp8 ? 4 : 8;

template <bool kFp8>
__global__ void __launch_bounds__(kStreamWarps * 32, 4)
    moe_down_slots_kernel(const __nv_bfloat16* h /*[top_k, I]*/, const int32_t* ids /*[top_k]*/,
                          const float* weights /*[top_k]*/, int top_k, int E,
                          const void* down /*[E, H, I] bf16 / e4m3*/, ExpertScales scales, int64_t I, int64_t H,
                          int rows_per_block, void* out /*[1, H]*/, int out_dtype, bool early) {
    using W = StreamWeights<kFp8>;
    constexpr int kU = kSlotUnroll<kFp8>;
    extern __shared__ float slot_dot[];  // [rows_per_block, top_k]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t n0 = int64_t(blockIdx.x) * rows_per_block;
    const int units = rows_per_block * top_k;
    // Unit u: output row n0 + u / top_k, slot u % top_k; its down row, or null (past H or a bad id).
    const auto row_of = [&](int unit) -> const char* {
        const int64_t n = n0 + unit / top_k;
        const int32_t e = n < H ? ids[unit % top_k] : -1;
        return e >= 0 && e < E ? static_cast<const char*>(down) + (int64_t(e) * H + n) * I * W::kBytes : nullptr;
    };
    const auto load_chunks = [&](const char* w, int64_t base, uint4 (&wv)[kU]) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int64_t at = base + (u * 32 + lane) * W::kLaneCols;
            if (at < I) wv[u] = load_stream16<false>(w + at * W::kBytes);
        }
    };
    // The ids are complete before this grid starts (the router finished before gate_up passed its
    // wait) and the weights are constant: each warp's first chunks load before it waits for h
    // (H200, bf16 batch-1 decode graph 8.417 -> 8.327-8.329 ms; early = false: after the wait, A/B).
    uint4 wv[kU];
    if (!early) pdl_wait();
    const char* first = warp < units ? row_of(warp) : nullptr;
    if (first) load_chunks(first, 0, wv);
    pdl_begin();  // h comes from the gate_up kernel
    for (int unit = warp; unit < units; unit += kStreamWarps) {
        const int64_t n = n0 + unit / top_k;
        const int s = unit % top_k;
        if (n >= H) break;  // units are row-major: every later unit is past H too
        const char* w = unit == warp ? first : row_of(unit);
        if (!w) {
            if (lane == 0) slot_dot[unit] = __int_as_float(0x7fc00000);
            continue;
        }
        const float* scale_row = kFp8 ? scales.row(ids[s], n) : nullptr;
        const __nv_bfloat16* hs = h + int64_t(s) * I;
        float d = 0.f;
        for (int64_t base = 0; base < I; base += 32 * W::kLaneCols * kU) {
            if (unit != warp || base != 0) load_chunks(w, base, wv);
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                const int64_t at = base + (u * 32 + lane) * W::kLaneCols;
                if (at < I) d = W::dot(wv[u], hs, at, scale_row, scales.block_cols, d);
            }
        }
        d = warp_sum(d);
        if (lane == 0) slot_dot[unit] = d;
    }
    __syncthreads();
    const int r = threadIdx.x;
    if (r < rows_per_block && n0 + r < H) {
        float acc = 0.f;  // a NaN slot (bad expert id) makes the row NaN, as on the other paths
        for (int s = 0; s < top_k; ++s) acc = fmaf(weights[s], slot_dot[r * top_k + s], acc);
        store_f(out, out_dtype, n0 + r, acc);
    }
}

bool moe_down_slots_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_MOE_DOWN_SLOTS", true);
    return enabled;
}

bool moe_stream_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_MOE_STREAM", true);
    return enabled;
}

// ---- few-token experts grouped by expert: tensor-core weight streams -----------------------------
// Decode, speculative verification and small serving batches (P = T·top_k ≤ kGroupedMaxPairs
// pairs, few pairs per expert): each chosen expert's weights are read ONCE per step, however many
// tokens chose it, and dotted against all of them on the tensor cores (mma.sync m16n8k16: a warp
// owns 16 weight rows, the 8 columns of B are 8 of the expert's pairs). Bytes read = the distinct
// experts' weights; FLOPs stay cheap (the tensor cores do them), so the op is a weight stream up
// to ≈ 32 pairs per expert.
//   gate_up_swiglu: grid (I / 64, min(P, E)); block y takes the y-th distinct expert (ascending
//                   id), each pair of its 8 warps 16 gate rows and the same 16 up rows, one warp
//                   per half of H (summed in shared memory, in a fixed order);
//                   h[p, i] = silu(g)·u with g and u rounded to bf16 first (as the tiled path
//                   stores them), h in bf16.
//   down_combine:   grid H / 16; a block owns 16 output columns for every expert: its warps take
//                   the distinct experts round-robin, write down_e[n] · h[p] per pair to shared
//                   memory, and the block sums weight · value in slot order per token
//                   (deterministic, and no f32 [P, H] intermediate).
// No host reads: every block derives the grouping (experts touched, each one's pairs) from the ids
// in shared memory; grids are sized from shapes only (graph-safe). Which pair lands in which mma
// column depends on atomics, but every column is computed independently, so results do not.
// Weights are read with 16-byte streaming loads: 8 bf16 or 16 fp8 per lane. The mma's k order is a
// permutation of the columns, the same for weights and activations: lane (g, c) = (lane/4, lane%4)
// loads columns [c·w, c·w + w) of each chunk of 4w, and so does its activation fragment.
// FP8 e4m3 weights (block scales, W = fp8 · scale[r / block_rows][c / block_cols]) are widened
// exactly to bf16 in registers; each 64-column chunk lies inside one scale block (block_cols % 64
// == 0, block_rows % 16 == 0), so its partial sums are multiplied by the scale once, in f32.
// An expert id outside [0, E) makes its token's output NaN, as on the other paths.

constexpr int kGroupedMaxPairs = 512;
constexpr int kGateTiles = 4;                // 16-row tiles of gate (and up) rows per block
constexpr int kGateWarps = 2 * kGateTiles;  // two warps per tile, each streaming half of H
constexpr int kDownWarps = 8;

// Where the cp.async rings start (after the plan, and the down kernel's [P, 16] partials): 16-byte aligned.
__host__ __device__ inline int64_t moe_ring_offset_ints(int64_t P, int64_t E) { return (moe_plan_ints(P, E) + 3) / 4 * 4; }

// Programmatic dependent launch (launch_pdl): gate_up waits for the router before it reads the
// ids and lets the down kernel launch at once; down builds its plan from the ids (complete: the
// router finished before gate_up passed its wait) and waits for gate_up's grid before reading h.

template <bool kFp8, int kNT, int kU, bool kPipe, int kRing, bool kF16 = false>
__global__ void __launch_bounds__(kGateWarps * 32, 2)
    moe_grouped_gate_up_kernel(const __nv_bfloat16* x /*[T, H]*/, const int32_t* ids /*[P]*/, int P, int top_k, int E,
                               const void* gate_up /*[E, 2I, H]*/, const float* scale /*[E, srows, scols] or null*/,
                               int64_t scale_rows, int64_t scale_cols, int block_rows, int block_cols, int64_t I,
                               int64_t H, __nv_bfloat16* h_out /*[P, I]*/, RouteArgs route) {
    extern __shared__ __align__(16) int plan_smem[];
    // The second half of the warps' partial sums (the half of H they streamed), per 16-row tile.
    __shared__ float partner[kGateTiles][kNT][8][32];
    int *cnt = plan_smem, *end = cnt + E, *list = end + E, *slot_expert = list + P;
    pdl_begin();
    const int T = P / top_k, j = blockIdx.y;
    int e, n_e;
    const int* pairs;
    if (kNT == 1 && T == 1) {
        // One token: block j takes pair j's expert itself, without the plan (its block barriers
        // and shared-memory atomics sat between the PDL wait and the first weight requests). A
        // token's experts are distinct; were two the same, each block would still compute its own pair.
        // With route.logits (MOE_ROUTE_EXPERTS) the block routes the token itself first.
        if (kNT == 1 && route.logits) {
            const RouteScratch rs = route_scratch_at(reinterpret_cast<char*>(plan_smem) + route.scratch_offset, E,
                                                     route.params.n_group, top_k);
            route_token(route.logits, route.bias, E, route.params, rs, false);
            e = rs.chosen[j];
        } else {
            e = ids[j];
        }
        if (e < 0 || e >= E) return;  // block-uniform; the down kernel poisons the token
        if (threadIdx.x == 0) list[0] = j;
        __syncthreads();
        n_e = 1;
        pairs = list;
    } else {
        const int nd = moe_block_plan(ids, P, E, cnt, end, list, slot_expert);
        if (j >= nd) return;  // block-uniform
        e = slot_expert[j];
        n_e = cnt[e];
        pairs = list + end[e] - n_e;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int tile = warp % kGateTiles, half = warp / kGateTiles;  // warps (t, 0) and (t, 1) split H
    const int64_t i0 = (int64_t(blockIdx.x) * kGateTiles + tile) * 16;
    const bool active = i0 < I;  // no early exit: the block synchronizes below

    constexpr int kBytes = kFp8 ? 1 : 2, kLaneCols = kFp8 ? 16 : 8, kChunk = 4 * kLaneCols;
    constexpr int64_t kStep = int64_t(kChunk) * kU;
    const char* base = static_cast<const char*>(gate_up) + int64_t(e) * 2 * I * H * kBytes;
    const int64_t r0 = min(i0 + g, I - 1), r1 = min(i0 + g + 8, I - 1);
    const char* gate0 = base + r0 * H * kBytes;
    const char* gate1 = base + r1 * H * kBytes;
    const char* up0 = base + (I + r0) * H * kBytes;
    const char* up1 = base + (I + r1) * H * kBytes;
    const float* scale_g = nullptr;
    const float* scale_u = nullptr;
    if constexpr (kFp8) {
        scale_g = scale + (int64_t(e) * scale_rows + min(i0, I - 1) / block_rows) * scale_cols;
        scale_u = scale + (int64_t(e) * scale_rows + (I + min(i0, I - 1)) / block_rows) * scale_cols;
    }
    // One round: kU chunks of the tile's 16 gate and 16 up rows (4 loads of 16 bytes each).
    struct Round {
        uint4 g0[kU], g1[kU], u0[kU], u1[kU];
    };
    const char* const rows[4] = {gate0, gate1, up0, up1};  // Round's member order
    const auto src = [&](int m, int64_t kb) -> const char* {  // load m = (row m / kU, chunk m % kU)
        const int64_t col = kb + (m % kU) * kChunk + c * kLaneCols;
        return col < H ? rows[m / kU] + col * kBytes : nullptr;
    };
    using Loads = LaneRounds<4, kU, kBytes>;
    Loads loads(rows, c, half * kStep, H, 2 * kStep);
    const ColBlock block_of(kFp8 ? block_cols : 64);
    uint4* ring = reinterpret_cast<uint4*>(plan_smem + moe_ring_offset_ints(P, E)) + warp * kRing * 4 * kU * 32;

    // kF16 (fp8 with the ring): x [T, H] as f16 rows after the ring, their scales x_inv [T] after
    // them (stage_act_f16), for the f16 mma. The first pass's first rounds go out before, so the
    // staging overlaps them.
    __shared__ int x_max[kF16 ? kStageMaxRows : 1];
    __half* x_f16 = reinterpret_cast<__half*>(reinterpret_cast<uint4*>(plan_smem + moe_ring_offset_ints(P, E)) +
                                              kGateWarps * kRing * 4 * kU * 32);
    float* x_inv = reinterpret_cast<float*>(x_f16 + int64_t(T) * H);
    if constexpr (kF16) {
        if (active) ring_issue_first<kRing>(loads, ring, lane);
        stage_act_f16(x, T, H, x_f16, x_inv, x_max);
        x = reinterpret_cast<const __nv_bfloat16*>(x_f16);
    }

    for (int pb = 0; pb < n_e; pb += 8 * kNT) {  // block-uniform
        const __nv_bfloat16* xr[kNT];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) xr[nt] = x + int64_t(pairs[min(pb + nt * 8 + g, n_e - 1)] / top_k) * H;
        float ag[kNT][4], au[kNT][4];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) ag[nt][r] = au[nt][r] = 0.f;

        const auto load_round = [&](Round& w, int64_t kb) { load_round_regs(w, src, kb); };
        const auto use_round = [&](const Round& w, int64_t kb) {
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                const int64_t chunk = kb + u * kChunk;
                if (chunk >= H) break;  // warp-uniform
                const int64_t col = chunk + c * kLaneCols;
                AFrag<kFp8, kF16> fg, fu;
                fg.set(w.g0[u], w.g1[u]);
                fu.set(w.u0[u], w.u1[u]);
                float sg = 1.f, su = 1.f;
                if constexpr (kFp8) {
                    // (Instances of several token tiles keep the division: the multiplier's register spilled them.)
                    const int b = kNT == 1 ? block_of(chunk) : int(chunk / block_cols);
                    sg = __ldg(scale_g + b);
                    su = __ldg(scale_u + b);
                }
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt) {
                    if (pb + nt * 8 >= n_e) break;  // warp-uniform
                    uint32_t xw[8];
                    if constexpr (kF16) load_x_frag<kFp8, kActShared>(xw, xr[nt], col, col < H);
                    else load_x_frag<kFp8>(xw, xr[nt], col, col < H);
                    if constexpr (kFp8) {
                        float tg[4] = {0.f, 0.f, 0.f, 0.f}, tu[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                        for (int m = 0; m < AFrag<kFp8>::kSteps; ++m) {  // two independent chains, interleaved
                            fg.mma_step(tg, m, xw);
                            fu.mma_step(tu, m, xw);
                        }
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            ag[nt][r] = fmaf(tg[r], sg, ag[nt][r]);
                            au[nt][r] = fmaf(tu[r], su, au[nt][r]);
                        }
                    } else {
                        fg.mma(ag[nt], xw);
                        fu.mma(au[nt], xw);
                    }
                }
            }
        };
        if constexpr (kRing > 0) {
            if (pb > 0) loads = Loads(rows, c, half * kStep, H, 2 * kStep);
            if (active)
                stream_rounds_ring<kRing, Round>(half * kStep, H, 2 * kStep, ring, lane, loads, use_round,
                                                 kF16 && pb == 0);
        } else if (active) {
            stream_rounds<kPipe, Round>(half * kStep, H, 2 * kStep, load_round, use_round);
        }
        if (half == 1) {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    partner[tile][nt][2 * r][lane] = ag[nt][r];
                    partner[tile][nt][2 * r + 1][lane] = au[nt][r];
                }
        }
        __syncthreads();
        // Accumulator r of tile nt: row i0 + g (+8 for r ≥ 2), pair column pb + 8·nt + 2c + (r & 1).
        if (half == 0 && active) {
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int64_t row = i0 + g + (r >= 2 ? 8 : 0);
                    const int q = pb + nt * 8 + 2 * c + (r & 1);
                    if (row < I && q < n_e) {
                        const float inv = kF16 ? x_inv[pairs[q] / top_k] : 1.f;
                        const float gv = round_to(XINFER_DTYPE_BF16, (ag[nt][r] + partner[tile][nt][2 * r][lane]) * inv);
                        const float uv =
                            round_to(XINFER_DTYPE_BF16, (au[nt][r] + partner[tile][nt][2 * r + 1][lane]) * inv);
                        h_out[int64_t(pairs[q]) * I + row] = __float2bfloat16_rn(gv / (1.f + expf(-gv)) * uv);
                    }
                }
            }
        }
        __syncthreads();  // `partner` is reused by the next pass
    }
}

template <bool kFp8, int kNT, int kU, bool kPipe, int kRing>
__global__ void __launch_bounds__(kDownWarps * 32, 2)
    moe_grouped_down_kernel(const __nv_bfloat16* h /*[P, I]*/, const int32_t* ids /*[T, top_k]*/,
                            const float* weights /*[T, top_k]*/, int T, int top_k, int E,
                            const void* down /*[E, H, I]*/, const float* scale /*[E, srows, scols] or null*/,
                            int64_t scale_rows, int64_t scale_cols, int block_rows, int block_cols, int64_t I,
                            int64_t H, int k_parts, bool h_in_smem, void* out /*[T, H]*/, int out_dtype,
                            RouteArgs route) {
    extern __shared__ __align__(16) int plan_smem[];
    const int P = T * top_k;
    if (route.logits) {  // MOE_ROUTE_EXPERTS, one token: route it here (the logits are complete, as ids are below)
        const RouteScratch rs = route_scratch_at(reinterpret_cast<char*>(plan_smem) + route.scratch_offset, E,
                                                 route.params.n_group, top_k);
        route_token(route.logits, route.bias, E, route.params, rs, true);
        ids = rs.chosen;
        weights = rs.weight;
    }
    int *cnt = plan_smem, *end = cnt + E, *list = end + E, *slot_expert = list + P;
    float* part = reinterpret_cast<float*>(plan_smem + moe_plan_ints(P, E));  // [k_parts, P, 16]
    uint4* ring_base = reinterpret_cast<uint4*>(plan_smem + moe_ring_offset_ints(P, E) + k_parts * P * 16);
    const int nd = route.logits ? routed_token_plan(ids, top_k, cnt, end, list, slot_expert)
                                : moe_block_plan(ids, P, E, cnt, end, list, slot_expert);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int64_t n0 = int64_t(blockIdx.x) * 16;
    const int64_t r0 = min(n0 + g, H - 1), r1 = min(n0 + g + 8, H - 1);
    constexpr int kBytes = kFp8 ? 1 : 2, kLaneCols = kFp8 ? 16 : 8, kChunk = 4 * kLaneCols;
    // A warp's unit of work: one expert's 16 rows over one of k_parts ranges of I, whole rounds
    // each (a round never crosses into the next range).
    constexpr int64_t kRound = int64_t(kChunk) * kU;
    const int64_t part_len = ((I + k_parts - 1) / k_parts + kRound - 1) / kRound * kRound;
    struct Unit {
        int64_t k_begin, k_end;
        const char *w0, *w1;  // rows r0 and r1 of the unit's expert
    };
    const auto unit_at = [&](int unit) {
        const int j = unit / k_parts, kq = unit % k_parts;
        const char* base = static_cast<const char*>(down) + int64_t(slot_expert[j]) * H * I * kBytes;
        return Unit{kq * part_len, min(I, kq * part_len + part_len), base + r0 * I * kBytes, base + r1 * I * kBytes};
    };
    struct Round {  // kU chunks of the tile's rows g and g + 8
        uint4 r0[kU], r1[kU];
    };
    const auto src_of = [&](const Unit& u) {  // load m = (row m / kU, chunk m % kU)
        return [u, c](int m, int64_t kb) -> const char* {
            const int64_t col = kb + (m % kU) * kChunk + c * kLaneCols;
            return col < u.k_end ? (m < kU ? u.w0 : u.w1) + col * kBytes : nullptr;
        };
    };
    const ColBlock block_of(kFp8 ? block_cols : 64);
    using Loads = LaneRounds<2, kU, kBytes>;
    const auto loads_of = [&](const Unit& u) {
        const char* const rows[2] = {u.w0, u.w1};
        return Loads(rows, c, u.k_begin, u.k_end, kRound);
    };
    uint4* ring = ring_base + warp * kRing * 2 * kU * 32;
    // The weights are constant and the plan is complete (the router finished before gate_up passed
    // its wait): the warp's first unit starts streaming before this grid waits for h.
    const bool early = kRing > 0 && warp < nd * k_parts;
    Loads loads = loads_of(unit_at(min(warp, max(nd * k_parts - 1, 0))));
    if constexpr (kRing > 0)
        if (early) ring_issue_first<kRing>(loads, ring, lane);
    pdl_begin();  // h comes from the gate_up kernel
    // h_in_smem: the block copies h [P, I] into shared memory once (after the ring), so the
    // activation fragments are shared-memory reads instead of an L2 round trip per chunk. (Staged
    // as f16 for the f16 mma, as gate_up stages x, it was slower: H200, 8 experts, T = 1, 68.6
    // against 65.3 µs for the whole op, the staging's maximum pass sitting between the PDL wait
    // and the first h fragment.)
    const __nv_bfloat16* hb = h;
    if (h_in_smem) {
        uint4* hs = ring_base + kRing * kDownWarps * 2 * kU * 32;
        copy_to_shared(hs, reinterpret_cast<const uint4*>(h), int64_t(P) * I / 8);
        __syncthreads();
        hb = reinterpret_cast<const __nv_bfloat16*>(hs);
    }

    for (int unit = warp; unit < nd * k_parts; unit += kDownWarps) {
        const int j = unit / k_parts, kq = unit % k_parts;
        const Unit u = unit_at(unit);
        float* part_q = part + kq * P * 16;
        const int e = slot_expert[j], n_e = cnt[e];
        const int* pairs = list + end[e] - n_e;
        const float* scale_row = nullptr;
        if constexpr (kFp8) scale_row = scale + (int64_t(e) * scale_rows + n0 / block_rows) * scale_cols;
        const auto src = src_of(u);
        for (int pb = 0; pb < n_e; pb += 8 * kNT) {
            const __nv_bfloat16* hr[kNT];
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) hr[nt] = hb + int64_t(pairs[min(pb + nt * 8 + g, n_e - 1)]) * I;
            float acc[kNT][4];
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[nt][r] = 0.f;
            const auto load_round = [&](Round& w, int64_t kb) { load_round_regs(w, src, kb); };
            // One fp8 token tile: the round's chunks as interleaved mma chains (fp8_round_mma).
            const auto use_round_fp8 = [&](const Round& w, int64_t kb) {
                const auto load_h = [&](uint32_t(&xw)[8], int64_t col, bool ok) {
                    if (h_in_smem) load_x_frag<true, kActShared>(xw, hr[0], col, ok);
                    else load_x_frag<true, kActL2>(xw, hr[0], col, ok);
                };
                fp8_round_mma<kU, false>(w.r0, w.r1, kb, I, c, RowScales{scale_row, block_of}, load_h, acc[0]);
            };
            const auto use_round = [&](const Round& w, int64_t kb) {
                if constexpr (kFp8 && kNT == 1) {
                    use_round_fp8(w, kb);
                } else {
#pragma unroll
                    for (int u = 0; u < kU; ++u) {
                        const int64_t chunk = kb + u * kChunk;
                        if (chunk >= I) break;  // warp-uniform
                        const int64_t col = chunk + c * kLaneCols;
                        AFrag<kFp8> f;
                        f.set(w.r0[u], w.r1[u]);
                        float s = 1.f;
                        if constexpr (kFp8) s = __ldg(scale_row + chunk / block_cols);
#pragma unroll
                        for (int nt = 0; nt < kNT; ++nt) {
                            if (pb + nt * 8 >= n_e) break;  // warp-uniform
                            uint32_t xw[8];
                            if (h_in_smem) load_x_frag<kFp8, kActShared>(xw, hr[nt], col, col < I);
                            else load_x_frag<kFp8, kActL2>(xw, hr[nt], col, col < I);
                            if constexpr (kFp8) {
                                float t[4] = {0.f, 0.f, 0.f, 0.f};
                                f.mma(t, xw);
#pragma unroll
                                for (int r = 0; r < 4; ++r) acc[nt][r] = fmaf(t[r], s, acc[nt][r]);
                            } else {
                                f.mma(acc[nt], xw);
                            }
                        }
                    }
                }
            };
            if constexpr (kRing > 0) {
                const bool first_issued = early && unit == warp && pb == 0;
                if (!first_issued) loads = loads_of(u);
                stream_rounds_ring<kRing, Round>(u.k_begin, u.k_end, kRound, ring, lane, loads, use_round, first_issued);
            } else {
                stream_rounds<kPipe, Round>(u.k_begin, u.k_end, kRound, load_round, use_round);
            }
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int q = pb + nt * 8 + 2 * c + (r & 1);
                    if (q < n_e)
                        part_q[pairs[q] * 16 + g + (r >= 2 ? 8 : 0)] = acc[nt][r];
                }
            }
        }
    }
    __syncthreads();
    // out[t, n] = Σ_slot weight · Σ_kq part, in slot and range order.
    for (int idx = threadIdx.x; idx < T * 16; idx += blockDim.x) {
        const int t = idx / 16, r = idx % 16;
        const int64_t n = n0 + r;
        if (n >= H) continue;
        float acc = 0.f;
        bool bad = false;
        for (int s = 0; s < top_k; ++s) {
            const int32_t e = ids[t * top_k + s];
            if (e < 0 || e >= E) bad = true;
            else {
                const int pair = t * top_k + s;
                float sum = part[pair * 16 + r];
                for (int kq = 1; kq < k_parts; ++kq) sum += part[(kq * P + pair) * 16 + r];
                acc = fmaf(weights[pair], sum, acc);
            }
        }
        store_f(out, out_dtype, int64_t(t) * H + n, bad ? __int_as_float(0x7fc00000) : acc);
    }
}

// XINFER_CUDA_MOE_GROUPED=0: the per-pair stream kernels above (bf16) / the GEMV (fp8) instead.
bool moe_grouped_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_MOE_GROUPED", true);
    return enabled;
}
// The grouped path runs while pairs per touched expert (P / min(E, P), the FLOPs per weight byte
// of the step up to the dtype's size) stay at or below this; more go to the tiled GEMM.
// XINFER_CUDA_MOE_GROUPED_PAIRS_PER_EXPERT overrides it (0: grouped only for P ≤ 64).
// Measured on H200, MiMo shapes, bf16 (docs/perf/2026-11-30-h200-moe.md): 32 experts, 16 tokens
// 434 µs grouped vs 878 µs tiled, 64 tokens (16 pairs per expert) 609 µs vs 907 µs.
int64_t moe_grouped_pairs_per_expert() {
    static const int64_t value = env_int("XINFER_CUDA_MOE_GROUPED_PAIRS_PER_EXPERT", 32);
    return value;
}

// With at most 8 pairs per expert (one token tile: batch-1 decode and verification), the grouped
// kernels keep the next round of weight loads in flight while they use the current one
// (stream_rounds). H200, ops-test --perf, same run: 8 tokens over 8 experts 122.4 -> 113.8 µs
// (bf16) and 83.3 -> 74.3 µs (fp8), one token fp8 76.3 -> 72.1 µs; DFlash verify step 13.53 ->
// 12.88 ms; FP8 batch-1 decode 108.9 -> 112.1 tokens/s. With more token tiles it lost (64 tokens
// over 32 experts, bf16: 589 -> 623 µs), so those keep whole rounds.
// XINFER_CUDA_MOE_PIPELINE=0 turns it off.
bool moe_pipeline_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_MOE_PIPELINE", true);
    return enabled;
}

struct GroupedArgs {
    const __nv_bfloat16* x;
    const int32_t* ids;
    const float* weights;
    int T, top_k, E;
    const void *gate_up, *down;
    const float *gate_up_scale, *down_scale;
    int64_t gu_scale_rows, gu_scale_cols, dn_scale_rows, dn_scale_cols;
    int block_rows, block_cols;
    int64_t I, H;
    __nv_bfloat16* h;
    void* out;
    int out_dtype;
    RouteArgs route;  // logits null: ids and weights above (MOE_ROUTE_EXPERTS sets it for one FP8 token)
};

// Where a kernel that routes keeps one token's routing scratch: `at` bytes into its dynamic shared
// memory (rounded up to 16), which grows to hold it.
RouteArgs with_route_scratch(const GroupedArgs& a, size_t& smem, size_t at) {
    RouteArgs route = a.route;
    if (route.logits) {
        at = (at + 15) / 16 * 16;
        route.scratch_offset = int(at);
        smem = std::max(smem, at + route_smem_bytes(a.E, route.params));
    }
    return route;
}

// FP8 experts with one token tile (batch-1 decode, verification) stream through the shared-memory
// rings (stream_rounds_ring): H200, ops-test --perf, 8 experts, one run: T = 1 80.9 -> 69.0 µs,
// T = 2 81.5 -> 72.0 µs, T = 8 83.5 -> 79.0 µs; FP8 batch-1 decode 44.1 -> 45.4% of copy. bf16 lost
// (T = 1 111 -> 129 µs: its rounds are twice the bytes), and so did several token tiles (serving
// batches; docs/perf/2026-11-30-h200-session7.md): those keep the register paths.
// XINFER_CUDA_MOE_RING=0 turns the rings off.
bool moe_ring_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_MOE_RING", true);
    return enabled;
}

// The ring down kernel copies h into shared memory when it is at most this big (one token over
// MiMo's I = 2,048: 8 pairs, 32 KB; two blocks still fit per SM). XINFER_CUDA_MOE_H_SMEM=0: h
// fragments straight from L2.
constexpr size_t kDownHSmemMaxBytes = 48 * 1024;
bool moe_h_in_smem_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_MOE_H_SMEM", true);
    return enabled;
}

template <typename Kernel>
int allow_smem(Context* c, Kernel kernel, size_t smem) {
    if (smem > 48 * 1024) XCUDA_TRY(c, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    return XINFER_OK;
}

// The fp8 ring gate_up kernel stages x as f16 in shared memory (the f16 mma: one conversion per
// pair of weights instead of four) while it takes at most this much: one token over MiMo's
// H = 4,096 is 8 KB. H200, 8 experts, T = 1: 66.8 -> 65.3 µs for the whole op.
constexpr size_t kGateUpXSmemMaxBytes = 16 * 1024;

// FP8 ring shapes: kU chunks per round, kRing slots per warp; 8-12 KB of ring per warp, so that two
// blocks of 8 warps fit an SM.
template <int U, int Ring>
struct GateUpRingShape {
    static constexpr int kU = U, kRing = Ring;
    static constexpr size_t kBytes = size_t(kGateWarps) * kRing * 4 * kU * 32 * 16;
};
// The ring's shape, chunks per round × slots: 2 × 3 for one token (128 bytes of each row a round
// instead of 64), else 1 × 4. H200, same call (docs/perf/2026-12-02-h200-session24.md): FP8 experts
// T = 1 58.3 -> 57.7 µs and FP8 batch-1 decode graph 5.747 -> 5.689-5.696 ms, but T = 2 / 8
// 63.6 -> 69.5 / 67.6 -> 72.3 µs (the verify shapes keep 1 × 4); 2 × 2 matched 1 × 4.
// XINFER_CUDA_MOE_GATE_RING=1x4 / 2x3 / 2x2 forces one (A/B). Returns U·10 + slots.
int gate_up_ring_shape(int T) {
    static const int forced = env_ring_shape("XINFER_CUDA_MOE_GATE_RING", {14, 23, 22});
    return forced ? forced : T == 1 ? 23 : 14;
}
// The down ring: 2 × 4 (2 × 3 read 16 µs more a FP8 step, H200 session 24; 4 × 2 spills registers).
struct DownRing {
    static constexpr int kU = 2, kRing = 4;
    static constexpr size_t kBytes = size_t(kDownWarps) * kRing * 2 * kU * 32 * 16;
};

template <bool kFp8, int kNT>
int launch_grouped_gate_up(Context* c, const GroupedArgs& a) {
    constexpr int kU = kNT == 1 || (kNT == 2 && !kFp8) ? 4 : 2;  // 16-byte loads per row in flight (registers)
    const int P = a.T * a.top_k;
    size_t smem = size_t(moe_plan_ints(P, a.E)) * 4;
    const dim3 grid(unsigned(ceil_div(a.I, 16 * kGateTiles)), unsigned(std::min(P, a.E)));
    auto kernel = moe_grouped_gate_up_kernel<kFp8, kNT, kU, false, 0>;
    if constexpr (kNT == 1) {
        if (kFp8 && moe_ring_enabled()) {
            const auto ring = [&](auto shape) {
                using R = decltype(shape);
                kernel = moe_grouped_gate_up_kernel<kFp8, kNT, R::kU, false, R::kRing>;
                smem = size_t(moe_ring_offset_ints(P, a.E)) * 4 + R::kBytes;
                const size_t x_bytes = size_t(a.T) * size_t(a.H) * 2;
                if (fp8_f16_mma_enabled(kF16MmaGateUp) && x_bytes <= kGateUpXSmemMaxBytes && a.H % 8 == 0 &&
                    a.T <= kStageMaxRows) {
                    kernel = moe_grouped_gate_up_kernel<kFp8, kNT, R::kU, false, R::kRing, kFp8>;
                    smem += x_bytes + size_t(a.T) * 4;
                }
            };
            switch (gate_up_ring_shape(a.T)) {
                case 23: ring(GateUpRingShape<2, 3>{}); break;
                case 22: ring(GateUpRingShape<2, 2>{}); break;
                default: ring(GateUpRingShape<1, 4>{}); break;
            }
        } else if (moe_pipeline_enabled()) {
            // Pipelined (see moe_pipeline_enabled): two register sets of half the loads; fp8's
            // widening needs registers of its own, so it keeps one chunk per round.
            kernel = moe_grouped_gate_up_kernel<kFp8, kNT, kFp8 ? 1 : kU / 2, true, 0>;
        }
    }
    // The routing scratch overlays the ring, which is first written after the block has routed. Two
    // blocks of the 2 x 3 ring nearly fill a SM's shared memory: 256 experts' 2.7 KB of scratch after
    // the ring left one block a SM (docs/perf/2026-12-03-h200-session31.md).
    const RouteArgs route = with_route_scratch(a, smem, size_t(moe_ring_offset_ints(P, a.E)) * 4);
    if (int rc = allow_smem(c, kernel, smem)) return rc;
    return launch_pdl(c, "moe_grouped_gate_up_kernel", kernel, grid,
                      dim3(kGateWarps * 32), smem, a.x, a.ids, P, a.top_k, a.E, a.gate_up, a.gate_up_scale,
                      a.gu_scale_rows, a.gu_scale_cols, a.block_rows, a.block_cols, a.I, a.H, a.h, route);
}

// How many ranges of I the down kernel's warps split each expert into. A block's 8 warps take
// the touched experts in turn, so 18 experts (a concurrency-8 serving step over 32) took 3 rounds
// where the average warp had 2.25 (ncu: down at 2.7 TB/s against gate_up's 3.6). The number
// touched is known only on the device; the host sees the most it can be, min(P, E). The partials
// take k_parts · P · 64 bytes of shared memory, hence the cap on P. H200, serving concurrency 8
// (e32 bench model), one run each: 1 range 69.3%, 2 ranges 70.3%, 4 ranges 69.5% of the roofline.
int grouped_down_parts(int P, int E) { return std::min(P, E) <= kDownWarps || P > 128 ? 1 : 2; }

template <bool kFp8, int kNT>
int launch_grouped_down(Context* c, const GroupedArgs& a) {
    constexpr int kU = kNT == 1 ? 8 : kNT == 2 ? 4 : 2;
    const int P = a.T * a.top_k, k_parts = grouped_down_parts(P, a.E);
    size_t smem = size_t(moe_plan_ints(P, a.E)) * 4 + size_t(k_parts) * P * 16 * 4;
    auto kernel = moe_grouped_down_kernel<kFp8, kNT, kU, false, 0>;
    bool h_in_smem = false;
    if constexpr (kNT == 1) {
        if (kFp8 && moe_ring_enabled()) {
            using R = DownRing;
            kernel = moe_grouped_down_kernel<kFp8, kNT, R::kU, false, R::kRing>;
            smem = size_t(moe_ring_offset_ints(P, a.E)) * 4 + size_t(k_parts) * P * 16 * 4 + R::kBytes;
            const size_t h_bytes = size_t(P) * size_t(a.I) * 2;
            h_in_smem = moe_h_in_smem_enabled() && h_bytes <= kDownHSmemMaxBytes;
            if (h_in_smem) smem += h_bytes;
        } else if (moe_pipeline_enabled()) {
            kernel = moe_grouped_down_kernel<kFp8, kNT, kU / (kFp8 ? 4 : 2), true, 0>;
        }
    }
    const RouteArgs route = with_route_scratch(a, smem, smem);  // after everything: the chosen ids and weights live on
    if (int rc = allow_smem(c, kernel, smem)) return rc;
    return launch_pdl(c, "moe_grouped_down_kernel", kernel,
                      dim3(unsigned(ceil_div(a.H, 16))), dim3(kDownWarps * 32), smem,
                      static_cast<const __nv_bfloat16*>(a.h), a.ids, a.weights, a.T, a.top_k, a.E, a.down,
                      a.down_scale, a.dn_scale_rows, a.dn_scale_cols, a.block_rows, a.block_cols, a.I, a.H, k_parts,
                      h_in_smem, a.out, a.out_dtype, route);
}

// One token, bf16 experts: every pair has its own expert (a token picks an expert once), so the
// per-pair stream kernel reads the same bytes as the grouped one, with 512 contiguous bytes of a
// row per load instruction instead of 64 bytes of 8 rows. MiMo's 8 experts (268 MB) on H200
// (ncu): 67-70 µs against 77 µs. FP8 experts keep the grouped kernel: an e4m3 version of this one
// (16 weights widened to f32 per load) took 51.6 µs for 134 MB against the grouped 41.3 µs.
int launch_stream_gate_up(Context* c, const GroupedArgs& a) {
    const int64_t P = int64_t(a.T) * a.top_k;
    return launch_pdl(c, "moe_gate_up_swiglu_kernel", moe_gate_up_swiglu_kernel,
                      dim3(unsigned(ceil_div(a.I, kStreamWarps)), unsigned(P)), dim3(kStreamWarps * 32), 0, a.x,
                      a.ids, a.top_k, a.E, static_cast<const __nv_bfloat16*>(a.gate_up), P, a.I, a.H, a.h);
}

// One token's down projection on moe_down_slots_kernel: a block covers max(1, 8 / top_k) rows.
template <bool kFp8>
int launch_down_slots(Context* c, const GroupedArgs& a) {
    const int rows = std::max(1, kStreamWarps / a.top_k);
    const ExpertScales scales{a.down_scale, a.dn_scale_rows, a.dn_scale_cols, a.block_rows, a.block_cols};
    return launch_pdl(c, "moe_down_slots_kernel", moe_down_slots_kernel<kFp8>, dim3(unsigned(ceil_div(a.H, rows))),
                      dim3(kStreamWarps * 32), size_t(rows) * a.top_k * 4, static_cast<const __nv_bfloat16*>(a.h),
                      a.ids, a.weights, a.top_k, a.E, a.down, scales, a.I, a.H, rows, a.out, a.out_dtype,
                      early_reads());
}

template <int kNT>
int launch_grouped(Context* c, const GroupedArgs& a, bool gate_up_fp8, bool down_fp8) {
    const int rc = a.T == 1 && !gate_up_fp8 ? launch_stream_gate_up(c, a)
                   : gate_up_fp8            ? launch_grouped_gate_up<true, kNT>(c, a)
                                            : launch_grouped_gate_up<false, kNT>(c, a);
    if (rc) return rc;
    // fp8: the caller checked I % 16, block_cols % 64 and 16-byte alignment. One token's fp8 down
    // projection goes to the ring kernel (h in shared memory, first rounds before the PDL wait):
    // H200, ops-test --perf, 8 experts, T = 1: 67.2 µs against 71.6 µs with the slots kernel; FP8
    // batch-1 decode 57.9-58.2 -> 59.8% of copy.
    const bool slots_fp8 = !moe_ring_enabled();
    if (a.T == 1 && moe_down_slots_enabled() && (!down_fp8 || slots_fp8) && a.I % 8 == 0 &&
        pointer_alignment(a.down) >= 16)
        return down_fp8 ? launch_down_slots<true>(c, a) : launch_down_slots<false>(c, a);
    return down_fp8 ? launch_grouped_down<true, kNT>(c, a) : launch_grouped_down<false, kNT>(c, a);
}

// ---- f32 experts ---------------------------------------------------------------------------------
// Checkpoints that run in f32 (tiny golden fixtures, --dtype float32) keep f32 expert weights.
// This path is for exactness, not speed: one warp per (pair, output row) dot product in f32.

// act[p, i] = silu(x_t · gate_e[i]) * (x_t · up_e[i]) for pair p = (t, slot), e = ids[p].
__global__ void f32_gate_up_kernel(const void* x /*[T, H]*/, int x_dtype, const int32_t* ids /*[P]*/, int top_k, int E,
                                   const float* gate_up /*[E, 2I, H]*/, int64_t P, int64_t I, int64_t H,
                                   float* act /*[P, I]*/) {
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (warp >= P * I) return;
    const int64_t p = warp / I, i = warp % I, t = p / top_k;
    const int32_t e = ids[p];
    if (e < 0 || e >= E) {
        if (lane == 0) act[p * I + i] = __int_as_float(0x7fc00000);
        return;
    }
    const float* gate = gate_up + (int64_t(e) * 2 * I + i) * H;
    const float* up = gate_up + (int64_t(e) * 2 * I + I + i) * H;
    float g = 0.f, u = 0.f;
    for (int64_t j = lane; j < H; j += 32) {
        const float xv = load_f(x, x_dtype, t * H + j);
        g += xv * gate[j];
        u += xv * up[j];
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) act[p * I + i] = g / (1.f + expf(-g)) * u;
}

// dn[p, j] = down_e[j] · act[p] for pair p, e = ids[p] (combined afterwards in slot order).
__global__ void f32_down_kernel(const float* act /*[P, I]*/, const int32_t* ids /*[P]*/, int E,
                                const float* down /*[E, H, I]*/, int64_t P, int64_t I, int64_t H,
                                float* dn /*[P, H]*/) {
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (warp >= P * H) return;
    const int64_t p = warp / H, j = warp % H;
    const int32_t e = ids[p];
    if (e < 0 || e >= E) return;  // act already holds NaN for this pair; combine reports it
    const float* row = down + (int64_t(e) * H + j) * I;
    float acc = 0.f;
    for (int64_t i = lane; i < I; i += 32) acc += row[i] * act[p * I + i];
    acc = warp_sum(acc);
    if (lane == 0) dn[p * H + j] = acc;
}

bool expert_weight_ok(const xinfer_tensor& w, const xinfer_tensor& scale, int64_t E, int64_t rows, int64_t cols,
                      int64_t br, int64_t bc) {
    if (w.rank != 3 || w.shape[0] != E || w.shape[1] != rows || w.shape[2] != cols) return false;
    if (w.dtype == XINFER_DTYPE_BF16 || w.dtype == XINFER_DTYPE_F32) return absent(scale);
    if (w.dtype != XINFER_DTYPE_F8_E4M3) return false;
    return scale.dtype == XINFER_DTYPE_F32 && scale.rank == 3 && scale.shape[0] == E &&
           scale.shape[1] == ceil_div(rows, br) && scale.shape[2] == ceil_div(cols, bc);
}

}  // namespace

// MOE_EXPERTS, or MOE_ROUTE_EXPERTS' experts with `route` (see moe_route.cuh).
int run_moe_experts(Context* c, const xinfer_op* op, bool run, const RouteArgs* route) {
    const xinfer_tensor &x = op->src[0], &ids = op->src[1], &weights = op->src[2], &gate_up = op->src[3],
                        &down = op->src[4], &gate_up_scale = op->src[5], &down_scale = op->src[6], &out = op->dst[0];
    const auto shapes = [&] {
        return str_format("x %s, ids %s, weights %s, gate_up %s, down %s, gate_up_scale %s, down_scale %s, out %s",
                          shape_str(x).c_str(), shape_str(ids).c_str(), shape_str(weights).c_str(),
                          shape_str(gate_up).c_str(), shape_str(down).c_str(), shape_str(gate_up_scale).c_str(),
                          shape_str(down_scale).c_str(), shape_str(out).c_str());
    };
    if (x.rank != 2 || ids.rank != 2 || gate_up.rank != 3 || !is_float(x.dtype) || !is_float(out.dtype) ||
        ids.dtype != XINFER_DTYPE_I32 || weights.dtype != XINFER_DTYPE_F32)
        return unsupported(c, op, "%s: expected x [T, H] f32/bf16/f16, ids [T, k] i32, weights [T, k] f32",
                           shapes().c_str());
    const int64_t T = x.shape[0], H = x.shape[1], k = ids.shape[1], E = gate_up.shape[0], I = gate_up.shape[1] / 2;
    const int64_t br = op->params.matmul.block_rows > 0 ? op->params.matmul.block_rows : 128;
    const int64_t bc = op->params.matmul.block_cols > 0 ? op->params.matmul.block_cols : 128;
    if (ids.shape[0] != T || weights.rank != 2 || weights.shape[0] != T || weights.shape[1] != k ||
        rows_of(out) != T || cols_of(out) != H || gate_up.shape[1] != 2 * I ||
        !expert_weight_ok(gate_up, gate_up_scale, E, 2 * I, H, br, bc) ||
        !expert_weight_ok(down, down_scale, E, H, I, br, bc))
        return unsupported(c, op, "%s: expected gate_up [E, 2I, H], down [E, H, I], f32, bf16 or f8_e4m3 with f32 scales "
                           "[E, ceil(rows/%lld), ceil(cols/%lld)]",
                           shapes().c_str(), (long long)br, (long long)bc);
    const int64_t P = T * k;
    const int64_t max_tiles = ceil_div(P, kGemmTileM) + std::min(E, P);
    const auto* id_data = static_cast<const int32_t*>(ids.data);
    const bool convert_x = x.dtype != XINFER_DTYPE_BF16;

    // Few tokens (decode, verification, small serving batches), bf16 or fp8 experts: grouped by
    // expert, each touched expert's weights read once. Chosen while pairs per touched expert stay
    // few enough for the step to be a weight stream (see moe_grouped_pairs_per_expert).
    const bool gu_fp8 = gate_up.dtype == XINFER_DTYPE_F8_E4M3, dn_fp8 = down.dtype == XINFER_DTYPE_F8_E4M3;
    const bool any_fp8 = gu_fp8 || dn_fp8;
    const int64_t touched = std::min(E, P);
    const bool grouped = [&] {
        const bool dtypes_ok = (gate_up.dtype == XINFER_DTYPE_BF16 || gu_fp8) && (down.dtype == XINFER_DTYPE_BF16 || dn_fp8);
        const int64_t align = any_fp8 ? 16 : 8;  // elements per 16-byte load of the narrowest operand
        const bool few = P <= kGemvMaxPairs || (touched > 0 && ceil_div(P, touched) <= moe_grouped_pairs_per_expert());
        const size_t smem_down = size_t(moe_plan_ints(P, E)) * 4 + size_t(P) * 16 * 4;
        return moe_grouped_enabled() && moe_stream_enabled() && dtypes_ok && few && P <= kGroupedMaxPairs &&
               H % align == 0 && I % align == 0 &&
               (!any_fp8 || (br % 16 == 0 && bc % 64 == 0 && col_block_exact(std::max(H, I), bc))) &&
               pointer_alignment(gate_up.data) >= 16 && pointer_alignment(down.data) >= 16 &&
               (convert_x || pointer_alignment(x.data) >= 16) && smem_down <= 48 * 1024 &&
               moe_plan_ints(P, E) * 4 + 16 * 1024 <= 48 * 1024;
    }();
    // Routing inside the kernels: one token over FP8 experts on the ring kernels (launch_grouped<1>).
    if (route && !(T == 1 && gu_fp8 && dn_fp8 && grouped && moe_ring_enabled() && I > 0 && E > 0))
        return unsupported(c, op, "%s: routing inside the experts takes one token over FP8 experts on the grouped "
                           "ring kernels", shapes().c_str());
    if (!run || T == 0) return XINFER_OK;
    if (P == 0 || E == 0 || I == 0) {
        XCUDA_TRY(c, cudaMemsetAsync(out.data, 0, size_t(T * H) * dtype_size(out.dtype), c->stream));
        return XINFER_OK;
    }

    if (gate_up.dtype == XINFER_DTYPE_F32 || down.dtype == XINFER_DTYPE_F32) {
        if (gate_up.dtype != down.dtype)
            return unsupported(c, op, "%s: f32 experts need both gate_up and down in f32", shapes().c_str());
        ScratchPlan plan;
        const size_t off_act = plan.add(size_t(P * I) * 4), off_dn = plan.add(size_t(P * H) * 4);
        if (int rc = ensure_scratch(c, plan.total)) return rc;
        float* act = reinterpret_cast<float*>(c->scratch + off_act);
        float* dn = reinterpret_cast<float*>(c->scratch + off_dn);
        const auto* id_ptr = static_cast<const int32_t*>(ids.data);
        f32_gate_up_kernel<<<unsigned(ceil_div(P * I * 32, 256)), 256, 0, c->stream>>>(
            x.data, x.dtype, id_ptr, int(k), int(E), static_cast<const float*>(gate_up.data), P, I, H, act);
        XCUDA_CHECK_LAUNCH(c, "f32_gate_up_kernel");
        f32_down_kernel<<<unsigned(ceil_div(P * H * 32, 256)), 256, 0, c->stream>>>(
            act, id_ptr, int(E), static_cast<const float*>(down.data), P, I, H, dn);
        XCUDA_CHECK_LAUNCH(c, "f32_down_kernel");
        return launch_combine(c, dn, nullptr, id_ptr, static_cast<const float*>(weights.data), int(k), int(E), T, H,
                              out.data, out.dtype);
    }

    if (grouped) {
        // 8-pair mma tiles per pass over an expert's weights: enough for the expected busiest
        // expert (a token picks an expert once, so ≤ T; ~3× the mean otherwise). An expert
        // with more pairs takes further passes. Beyond one tile, bf16 experts go through
        // shared memory (moe_staged.cu) in passes of up to 64 pairs.
        const int64_t busiest = std::min(T, 3 * ceil_div(P, touched));
        const bool staged = !any_fp8 && busiest > 8 && moe_staged_enabled() && moe_staged_fits(P, E, H, I);
        // One FP8 token: gate_up and down in one kernel split by I (moe_split_i.cu).
        const bool split_i = T == 1 && gu_fp8 && dn_fp8 && moe_ring_enabled() && moe_split_i_enabled() &&
                             moe_split_i_fits(H, I, int(br), int(bc));
        ScratchPlan plan;
        const size_t off_x = convert_x ? plan.add(size_t(T * H) * 2) : 0;
        const size_t off_h = plan.add(size_t(P * I) * 2);
        const size_t off_dn = staged ? plan.add(size_t(P * H) * 4) : 0;
        const size_t off_part = split_i ? plan.add(moe_split_i_partial_bytes(k, H, I)) : 0;
        const size_t off_chosen = split_i ? plan.add(size_t(k) * 8) : 0;  // [top_k] ids, then [top_k] weights
        if (int rc = ensure_scratch(c, plan.total)) return rc;
        char* s = c->scratch;
        GroupedArgs a{};
        a.x = static_cast<const __nv_bfloat16*>(x.data);
        if (convert_x) {
            if (int rc = launch_convert(c, x.data, x.dtype, s + off_x, XINFER_DTYPE_BF16, T * H)) return rc;
            a.x = reinterpret_cast<const __nv_bfloat16*>(s + off_x);
        }
        a.ids = id_data;
        a.weights = static_cast<const float*>(weights.data);
        a.T = int(T);
        a.top_k = int(k);
        a.E = int(E);
        a.gate_up = gate_up.data;
        a.down = down.data;
        if (gu_fp8) {
            a.gate_up_scale = static_cast<const float*>(gate_up_scale.data);
            a.gu_scale_rows = gate_up_scale.shape[1];
            a.gu_scale_cols = gate_up_scale.shape[2];
        }
        if (dn_fp8) {
            a.down_scale = static_cast<const float*>(down_scale.data);
            a.dn_scale_rows = down_scale.shape[1];
            a.dn_scale_cols = down_scale.shape[2];
        }
        a.block_rows = int(br);
        a.block_cols = int(bc);
        a.I = I;
        a.H = H;
        a.h = reinterpret_cast<__nv_bfloat16*>(s + off_h);
        a.out = out.data;
        a.out_dtype = out.dtype;
        if (route) a.route = *route;
        if (staged)
            return launch_moe_staged(c, {.x = a.x,
                                         .ids = a.ids,
                                         .weights = a.weights,
                                         .T = a.T,
                                         .top_k = a.top_k,
                                         .E = a.E,
                                         .gate_up = static_cast<const __nv_bfloat16*>(a.gate_up),
                                         .down = static_cast<const __nv_bfloat16*>(a.down),
                                         .I = I,
                                         .H = H,
                                         .h = a.h,
                                         .dn = reinterpret_cast<float*>(s + off_dn),
                                         .out = a.out,
                                         .out_dtype = a.out_dtype});
        if (split_i)
            return launch_moe_split_i(c, {.x = a.x,
                                          .ids = a.ids,
                                          .weights = a.weights,
                                          .top_k = a.top_k,
                                          .E = a.E,
                                          .gate_up = static_cast<const uint8_t*>(a.gate_up),
                                          .gate_up_scale = a.gate_up_scale,
                                          .gu_scale_rows = a.gu_scale_rows,
                                          .gu_scale_cols = a.gu_scale_cols,
                                          .down = static_cast<const uint8_t*>(a.down),
                                          .down_scale = a.down_scale,
                                          .dn_scale_rows = a.dn_scale_rows,
                                          .dn_scale_cols = a.dn_scale_cols,
                                          .block_rows = a.block_rows,
                                          .block_cols = a.block_cols,
                                          .I = I,
                                          .H = H,
                                          .partial = reinterpret_cast<float*>(s + off_part),
                                          .chosen = reinterpret_cast<int32_t*>(s + off_chosen),
                                          .chosen_weight = reinterpret_cast<float*>(s + off_chosen) + k,
                                          .out = a.out,
                                          .out_dtype = a.out_dtype,
                                          .route = a.route});
        if (busiest <= 8) return launch_grouped<1>(c, a, gu_fp8, dn_fp8);
        if (busiest <= 16) return launch_grouped<2>(c, a, gu_fp8, dn_fp8);
        return launch_grouped<4>(c, a, gu_fp8, dn_fp8);
    }

    // Many pairs (prefill chunks), bf16 or fp8 experts: one cuBLASLt GEMM per expert.
    {
        const auto wide_ok = [](const xinfer_tensor& w) {
            return w.dtype == XINFER_DTYPE_F8_E4M3 || (w.dtype == XINFER_DTYPE_BF16 && pointer_alignment(w.data) >= 16);
        };
        if (P >= kPerExpertGemmMinPairs && moe_per_expert_gemm_enabled() && wide_ok(gate_up) && wide_ok(down) &&
            H % 8 == 0 && I % 8 == 0 && !stream_capturing(c)) {
            const PerExpertArgs a{&x, &gate_up, &down, &gate_up_scale, &down_scale, &out, id_data,
                                  static_cast<const float*>(weights.data), T, H, I, E, k, br, bc};
            return moe_per_expert_gemm(c, a);
        }
    }

    // Few pairs, bf16 experts: the two fused weight-stream kernels (the path before grouping;
    // XINFER_CUDA_MOE_GROUPED=0).
    if (P <= kGemvMaxPairs && moe_stream_enabled() && gate_up.dtype == XINFER_DTYPE_BF16 &&
        down.dtype == XINFER_DTYPE_BF16 && H % 8 == 0 && I % 8 == 0 && pointer_alignment(gate_up.data) >= 16 &&
        pointer_alignment(down.data) >= 16 && (convert_x || pointer_alignment(x.data) >= 16) && T <= 65535 &&
        P <= 65535) {
        ScratchPlan plan;
        const size_t off_x = convert_x ? plan.add(size_t(T * H) * 2) : 0;
        const size_t off_h = plan.add(size_t(P * I) * 2);
        if (int rc = ensure_scratch(c, plan.total)) return rc;
        char* s = c->scratch;
        const __nv_bfloat16* xb = static_cast<const __nv_bfloat16*>(x.data);
        if (convert_x) {
            if (int rc = launch_convert(c, x.data, x.dtype, s + off_x, XINFER_DTYPE_BF16, T * H)) return rc;
            xb = reinterpret_cast<const __nv_bfloat16*>(s + off_x);
        }
        auto* hb = reinterpret_cast<__nv_bfloat16*>(s + off_h);
        moe_gate_up_swiglu_kernel<<<dim3(unsigned(ceil_div(I, kStreamWarps)), unsigned(P)), kStreamWarps * 32, 0,
                                    c->stream>>>(xb, id_data, int(k), int(E),
                                                 static_cast<const __nv_bfloat16*>(gate_up.data), P, I, H, hb);
        XCUDA_CHECK_LAUNCH(c, "moe_gate_up_swiglu_kernel");
        moe_down_combine_kernel<<<dim3(unsigned(ceil_div(H, kStreamWarps)), unsigned(T)), kStreamWarps * 32, 0,
                                  c->stream>>>(hb, id_data, static_cast<const float*>(weights.data), int(k), int(E),
                                               static_cast<const __nv_bfloat16*>(down.data), I, H, out.data,
                                               out.dtype);
        XCUDA_CHECK_LAUNCH(c, "moe_down_combine_kernel");
        return XINFER_OK;
    }

    // Few pairs: GEMV straight from the ids.
    if (P <= kGemvMaxPairs) {
        ScratchPlan plan;
        const size_t off_x = convert_x ? plan.add(size_t(T * H) * 2) : 0;
        const size_t off_gu = plan.add(size_t(P * 2 * I) * 2), off_h = plan.add(size_t(P * I) * 2),
                     off_dn = plan.add(size_t(P * H) * 4);
        Gemv up, dn;
        up.w.a = static_cast<const __nv_bfloat16*>(x.data);
        up.w.lda = H;
        up.w.a_row_div = int(k);
        up.w.b = gate_up.data;
        up.w.b_dtype = gate_up.dtype;
        up.w.n = 2 * I;
        up.w.k = H;
        up.w.b_group_stride = 2 * I * H;
        if (gate_up.dtype == XINFER_DTYPE_F8_E4M3) {
            up.w.b_scale = static_cast<const float*>(gate_up_scale.data);
            up.w.scale_cols = gate_up_scale.shape[2];
            up.w.scale_group_stride = gate_up_scale.shape[1] * gate_up_scale.shape[2];
            up.w.block_rows = br;
            up.w.block_cols = bc;
        }
        up.w.c_dtype = XINFER_DTYPE_BF16;
        up.w.ldc = 2 * I;
        up.rows = P;
        up.rows_per_group = 1;
        up.group_of = id_data;
        up.n_groups = int(E);
        dn = up;
        dn.w.lda = I;
        dn.w.a_row_div = 1;
        dn.w.b = down.data;
        dn.w.b_dtype = down.dtype;
        dn.w.n = H;
        dn.w.k = I;
        dn.w.b_group_stride = H * I;
        dn.w.b_scale = nullptr;
        dn.w.scale_cols = dn.w.scale_group_stride = 0;
        if (down.dtype == XINFER_DTYPE_F8_E4M3) {
            dn.w.b_scale = static_cast<const float*>(down_scale.data);
            dn.w.scale_cols = down_scale.shape[2];
            dn.w.scale_group_stride = down_scale.shape[1] * down_scale.shape[2];
        }
        dn.w.c_dtype = XINFER_DTYPE_F32;
        dn.w.ldc = H;
        // Fit is decided on shapes and strides; scratch pointers are 256-byte aligned.
        const bool x_aligned = convert_x || pointer_alignment(x.data) >= 16;
        if (x_aligned && gemv_fits(dn) && (up.w.k % (gate_up.dtype == XINFER_DTYPE_F8_E4M3 ? 16 : 8)) == 0 &&
            (up.w.b_group_stride * int64_t(dtype_size(gate_up.dtype))) % 16 == 0 && pointer_alignment(gate_up.data) >= 16) {
            if (int rc = ensure_scratch(c, plan.total)) return rc;
            char* s = c->scratch;
            if (convert_x) {
                if (int rc = launch_convert(c, x.data, x.dtype, s + off_x, XINFER_DTYPE_BF16, T * H)) return rc;
                up.w.a = reinterpret_cast<const __nv_bfloat16*>(s + off_x);
            }
            up.w.c = s + off_gu;
            dn.w.a = reinterpret_cast<const __nv_bfloat16*>(s + off_h);
            dn.w.c = s + off_dn;
            if (int rc = launch_gemv(c, up)) return rc;
            if (int rc = launch_swiglu(c, s + off_gu, XINFER_DTYPE_BF16, s + off_h, XINFER_DTYPE_BF16, P, I)) return rc;
            if (int rc = launch_gemv(c, dn)) return rc;
            return launch_combine(c, reinterpret_cast<const float*>(s + off_dn), nullptr, id_data,
                                  static_cast<const float*>(weights.data), int(k), int(E), T, H, out.data, out.dtype);
        }
    }

    ScratchPlan plan;
    const size_t off_x = convert_x ? plan.add(size_t(T * H) * 2) : 0;
    const size_t off_counts = plan.add(size_t(E) * 4), off_cursor = plan.add(size_t(E) * 4),
                 off_tile_offset = plan.add(size_t(E) * 4), off_n_tiles = plan.add(4),
                 off_tiles = plan.add(size_t(max_tiles) * sizeof(int4)), off_sorted = plan.add(size_t(P) * 4),
                 off_gu = plan.add(size_t(P * 2 * I) * 2), off_h = plan.add(size_t(P * I) * 2),
                 off_dn = plan.add(size_t(P * H) * 4);
    if (int rc = ensure_scratch(c, plan.total)) return rc;
    char* s = c->scratch;
    const __nv_bfloat16* xb = static_cast<const __nv_bfloat16*>(x.data);
    if (convert_x) {
        if (int rc = launch_convert(c, x.data, x.dtype, s + off_x, XINFER_DTYPE_BF16, T * H)) return rc;
        xb = reinterpret_cast<const __nv_bfloat16*>(s + off_x);
    }
    auto* counts = reinterpret_cast<int32_t*>(s + off_counts);
    auto* cursor = reinterpret_cast<int32_t*>(s + off_cursor);
    auto* tile_offset = reinterpret_cast<int32_t*>(s + off_tile_offset);
    auto* n_tiles = reinterpret_cast<int32_t*>(s + off_n_tiles);
    auto* tiles = reinterpret_cast<int4*>(s + off_tiles);
    auto* sorted = reinterpret_cast<int32_t*>(s + off_sorted);
    void* gu = s + off_gu;
    void* h = s + off_h;
    auto* dn = reinterpret_cast<float*>(s + off_dn);

    const int threads = 256;
    const int blocks = int(std::max<int64_t>(1, std::min<int64_t>(ceil_div(P, threads), c->sm_count * 4)));
    XCUDA_TRY(c, cudaMemsetAsync(counts, 0, size_t(E) * 4, c->stream));
    count_kernel<<<blocks, threads, 0, c->stream>>>(id_data, P, int(E), counts);
    XCUDA_CHECK_LAUNCH(c, "count_kernel");
    plan_kernel<<<1, 256, 0, c->stream>>>(counts, int(E), cursor, tile_offset, tiles, n_tiles);
    XCUDA_CHECK_LAUNCH(c, "plan_kernel");
    scatter_kernel<<<blocks, threads, 0, c->stream>>>(id_data, P, int(E), cursor, sorted);
    XCUDA_CHECK_LAUNCH(c, "scatter_kernel");

    GroupedGemm g;
    g.a = xb;
    g.lda = H;
    g.a_rows = sorted;
    g.a_row_div = int(k);
    g.b = gate_up.data;
    g.b_dtype = gate_up.dtype;
    g.n = 2 * I;
    g.k = H;
    g.b_group_stride = 2 * I * H;
    if (gate_up.dtype == XINFER_DTYPE_F8_E4M3) {
        g.b_scale = static_cast<const float*>(gate_up_scale.data);
        g.scale_cols = gate_up_scale.shape[2];
        g.scale_group_stride = gate_up_scale.shape[1] * gate_up_scale.shape[2];
        g.block_rows = br;
        g.block_cols = bc;
    }
    g.c = gu;
    g.c_dtype = XINFER_DTYPE_BF16;
    g.ldc = 2 * I;
    g.tiles = tiles;
    g.n_tiles = n_tiles;
    if (int rc = launch_grouped_gemm(c, g, max_tiles)) return rc;

    if (int rc = launch_swiglu(c, gu, XINFER_DTYPE_BF16, h, XINFER_DTYPE_BF16, P, I)) return rc;

    GroupedGemm d = g;
    d.a = static_cast<const __nv_bfloat16*>(h);
    d.lda = I;
    d.a_rows = nullptr;
    d.a_row_div = 1;
    d.b = down.data;
    d.b_dtype = down.dtype;
    d.n = H;
    d.k = I;
    d.b_group_stride = H * I;
    d.b_scale = nullptr;
    d.scale_cols = d.scale_group_stride = 0;
    d.shard_rows = d.blocks_per_shard = 0;
    if (down.dtype == XINFER_DTYPE_F8_E4M3) {
        d.b_scale = static_cast<const float*>(down_scale.data);
        d.scale_cols = down_scale.shape[2];
        d.scale_group_stride = down_scale.shape[1] * down_scale.shape[2];
    }
    d.c = dn;
    d.c_dtype = XINFER_DTYPE_F32;
    d.ldc = H;
    d.c_rows = sorted;
    if (int rc = launch_grouped_gemm(c, d, max_tiles)) return rc;

    return launch_combine(c, dn, nullptr, id_data, static_cast<const float*>(weights.data), int(k), int(E), T, H,
                          out.data, out.dtype);
}

int op_moe_experts(Context* c, const xinfer_op* op, bool run) { return run_moe_experts(c, op, run, nullptr); }

}  // namespace xcuda
