// One token over FP8 block-scaled experts (batch-1 decode): gate_up, swiglu and down in ONE
// weight-streaming kernel split by I, then a small kernel that sums the parts.
//
// Why: the grouped path (moe.cu) runs gate_up and down as two grids. Its one-token FP8 gate_up is
// one wave of 256 long blocks whose ends spread by several µs, and down waits for all of them (the
// PDL wait), so every layer pays that spread, the grid boundary and down's copy of h (H100, session
// 36: the FP8 expert op 12.3 µs a layer over its bytes; the bf16 one, whose gate_up runs in many
// waves of small blocks, 3.3).
//
// Block (ib, j) owns rows [64·ib, 64·ib + 64) of I of the token's j-th expert e:
//   1. it streams those 64 gate and 64 up rows (8 warps: 4 tiles of 16 rows × 2 halves of H, as the
//      grouped gate_up kernel, through the same shared-memory ring and f16 mma) and keeps
//      h[i] = silu(g)·u in shared memory (g and u rounded to bf16 first, h bf16, as there);
//   2. it streams columns [64·ib, 64·ib + 64) of down_e's H rows (a round: 16 rows × 64 bytes;
//      warp w takes row tiles w, w + 8, ...) against that h and writes
//      partial[j, ib, n] = scale · down_e[n, cols] · h[cols] in f32.
//   A warp issues its first down rounds as soon as its gate_up stream ends, before the block waits
//   for the partner warps' sums, so the swiglu barrier overlaps loads.
// The sum kernel: out[n] = Σ_j weight_j · Σ_ib partial[j, ib, n] in a fixed order (deterministic).
// An expert id outside [0, E) makes the token's output NaN, as on the other paths.
// With route.logits (MOE_ROUTE_EXPERTS) every block routes the token itself; blocks ib = 0 record
// the experts and weights for the sum kernel.
#include "moe_split_i.h"

#include "device_utils.cuh"
#include "weight_stream.cuh"

#include <algorithm>

namespace xcuda {
namespace {

constexpr int kTiles = 4, kWarps = 2 * kTiles, kRowsPerBlock = 16 * kTiles;  // 64 rows of I a block
// Gate_up's ring: 2 chunks (128 bytes of each of the tile's 32 rows) a round, 3 slots: the grouped
// gate_up kernel's one-token shape.
constexpr int kGateU = 2, kGateRing = 3;
constexpr int kGateRingVecs = kGateRing * 4 * kGateU * 32;  // 16-byte slots of one warp's ring
// Down's ring: one 16-row × 64-byte tile (1 KB a warp) a round, kDownRing slots in the warp's
// gate_up ring (8 by default; XINFER_CUDA_MOE_SPLIT_I_RING=4 / 12 for A/B).
constexpr int kMaxDownRing = kGateRingVecs / (2 * 32);
// x staged as f16 for the f16 mma (stage_act_f16) while it takes at most this much.
constexpr size_t kXSmemMaxBytes = 16 * 1024;
constexpr int kSumWarps = 8;

// One lane's loads of the down tiles: 16 bytes of rows n0 + g and n0 + g + 8 at the block's
// columns, for n0 = begin, begin + step, ... < end (H % 16 == 0: a tile is whole or past the
// end). The Loads of stream_rounds_ring.
struct DownTileRounds {
    static constexpr int kLoads = 2;
    const char* row;  // row n0 + g at the lane's 16 bytes
    int64_t n0, end, step, row_bytes;
    __device__ __forceinline__ void issue(uint4* ring /*[slots][2][32]*/, int lane, int slot) {
        uint4* dst = ring + slot * kLoads * 32 + lane;
        if (n0 < end) {
            cp_async16_stream(dst, row);
            cp_async16_stream(dst + 32, row + 8 * row_bytes);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        row += step * row_bytes;
        n0 += step;
    }
};

// The lane's h fragment (16 bf16 of the block's 64, in xw) as f16 times 2^shift, shift from the
// largest |h| of the 64 (the quad's lanes hold them all) as stage_act_f16 picks it; inv = 2^-shift.
__device__ __forceinline__ void hw_to_f16(uint32_t (&xw)[8], float& inv) {
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xw[i]));
        m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const int shift = stage_shift(__float_as_int(m));
    const float up = __int_as_float((127 + shift) << 23);
    inv = __int_as_float((127 - shift) << 23);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xw[i]));
        const __half2 h = __floats2half2_rn(f.x * up, f.y * up);
        xw[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
}

// kF16Down: down's e4m3 weights widen to f16 (one conversion a pair instead of three through f32
// to bf16) for the f16 mma, against h scaled by a power of two into f16's range.
template <int kDownRing, bool kF16Down>
__global__ void __launch_bounds__(kWarps * 32, 2) moe_split_i_kernel(const SplitIMoe a) {
    static_assert(kDownRing <= kMaxDownRing, "down's ring fits in the warp's gate_up ring");
    extern __shared__ __align__(16) uint4 smem[];  // the warps' rings, then x as f16 [H] and its scale
    __shared__ float partner[kTiles][8][32];        // the H half of warps (tile, 1): gate and up sums
    __shared__ __align__(16) __nv_bfloat16 h_chunk[kRowsPerBlock];
    __shared__ int x_max[1], expert;
    pdl_begin();
    const int ib = blockIdx.x, j = blockIdx.y;
    if (a.route.logits) {
        const RouteScratch rs = route_scratch_at(reinterpret_cast<char*>(smem) + a.route.scratch_offset, a.E,
                                                 a.route.params.n_group, a.top_k);
        route_token(a.route.logits, a.route.bias, a.E, a.route.params, rs, ib == 0);
        if (threadIdx.x == 0) {
            expert = rs.chosen[j];
            if (ib == 0) {
                a.chosen[j] = rs.chosen[j];
                a.chosen_weight[j] = rs.weight[j];
            }
        }
    } else if (threadIdx.x == 0) {
        expert = a.ids[j];
        if (ib == 0) {
            a.chosen[j] = expert;
            a.chosen_weight[j] = a.weights[j];
        }
    }
    __syncthreads();  // also: the routing scratch (under the rings) is read before the rings fill
    const int e = expert;
    if (e < 0 || e >= a.E) return;  // block-uniform; the sum kernel poisons the token

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int tile = warp % kTiles, half = warp / kTiles;  // warps (t, 0) and (t, 1) split H
    const int64_t I = a.I, H = a.H, i0 = int64_t(ib) * kRowsPerBlock + tile * 16;
    uint4* ring = smem + warp * kGateRingVecs;
    __half* x_f16 = reinterpret_cast<__half*>(smem + kWarps * kGateRingVecs);
    float* x_inv = reinterpret_cast<float*>(x_f16 + H);

    // ---- 1. gate and up rows i0 + g, i0 + g + 8 of the tile over the warp's half of H ----
    constexpr int kChunk = 64;  // e4m3 columns of a chunk: 16 a lane
    constexpr int64_t kStep = int64_t(kChunk) * kGateU;
    const char* gu = reinterpret_cast<const char*>(a.gate_up) + int64_t(e) * 2 * I * H;
    const char* const rows[4] = {gu + (i0 + g) * H, gu + (i0 + g + 8) * H, gu + (I + i0 + g) * H,
                                 gu + (I + i0 + g + 8) * H};  // GateRound's member order
    const float* scale_g = a.gate_up_scale + (int64_t(e) * a.gu_scale_rows + i0 / a.block_rows) * a.gu_scale_cols;
    const float* scale_u = a.gate_up_scale + (int64_t(e) * a.gu_scale_rows + (I + i0) / a.block_rows) * a.gu_scale_cols;
    LaneRounds<4, kGateU, 1> gate_loads(rows, c, half * kStep, H, 2 * kStep);
    ring_issue_first<kGateRing>(gate_loads, ring, lane);  // in flight while x is staged
    stage_act_f16(a.x, 1, H, x_f16, x_inv, x_max);
    const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(x_f16);  // f16 bits, read as 16-byte words
    struct GateRound {
        uint4 g0[kGateU], g1[kGateU], u0[kGateU], u1[kGateU];
    };
    const ColBlock block_of(a.block_cols);
    float ag[4] = {0.f, 0.f, 0.f, 0.f}, au[4] = {0.f, 0.f, 0.f, 0.f};
    // The grouped gate_up kernel's round (moe.cu, one token tile, fp8, f16 mma) written out for one
    // token; left a copy while this kernel is opt-in, so the measured grouped kernel stays as it was.
    // If this kernel becomes the default, the two should share one helper in weight_stream.cuh.
    const auto use_gate = [&](const GateRound& w, int64_t kb) {
#pragma unroll
        for (int u = 0; u < kGateU; ++u) {
            const int64_t chunk = kb + u * kChunk;
            if (chunk >= H) break;  // warp-uniform
            AFrag<true, true> fg, fu;
            fg.set(w.g0[u], w.g1[u]);
            fu.set(w.u0[u], w.u1[u]);
            const int b = block_of(chunk);
            const float sg = __ldg(scale_g + b), su = __ldg(scale_u + b);
            uint32_t xw[8];
            load_x_frag<true, kActShared>(xw, xs, chunk + c * 16, true);
            float tg[4] = {0.f, 0.f, 0.f, 0.f}, tu[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int m = 0; m < AFrag<true, true>::kSteps; ++m) {  // two independent chains, interleaved
                fg.mma_step(tg, m, xw);
                fu.mma_step(tu, m, xw);
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                ag[r] = fmaf(tg[r], sg, ag[r]);
                au[r] = fmaf(tu[r], su, au[r]);
            }
        }
    };
    stream_rounds_ring<kGateRing, GateRound>(half * kStep, H, 2 * kStep, ring, lane, gate_loads, use_gate, true);

    // ---- 2. down's columns [col0, col0 + 64) of row tiles warp, warp + 8, ... ----
    // The ring is drained and each lane refills only its own slots, so the first down rounds go
    // out now, before the block waits for h.
    const int64_t col0 = int64_t(ib) * kRowsPerBlock;
    constexpr int kTileStep = kWarps * 16;  // rows between a warp's tiles
    const char* dn = reinterpret_cast<const char*>(a.down) + int64_t(e) * H * I;
    DownTileRounds down_loads{dn + (warp * 16 + g) * I + col0 + c * 16, warp * 16, H, kTileStep, I};
    ring_issue_first<kDownRing>(down_loads, ring, lane);
    // Down's scales: one per row tile, each round's in another scale row (a cache line apart), so
    // lane k fetches the warp's k-th now, while the block waits for h, and rounds take them by
    // shuffle; rounds past the 32nd load their own.
    const float* scale_dn = a.down_scale + int64_t(e) * a.dn_scale_rows * a.dn_scale_cols + col0 / a.block_cols;
    const ColBlock row_block_of(a.block_rows);
    const auto tile_scale = [&](int64_t n0) { return __ldg(scale_dn + int64_t(row_block_of(n0)) * a.dn_scale_cols); };
    const int64_t lane_tile = warp * 16 + int64_t(lane) * kTileStep;
    const float lane_scale = lane_tile < H ? tile_scale(lane_tile) : 0.f;

    // Accumulator r: row i0 + g (+8 for r ≥ 2), mma column 2c + (r & 1); every column is the token.
    if (half == 1) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            partner[tile][2 * r][lane] = ag[r];
            partner[tile][2 * r + 1][lane] = au[r];
        }
    }
    __syncthreads();
    if (half == 0 && c == 0) {
#pragma unroll
        for (int r = 0; r < 4; r += 2) {
            const float gv = round_to(XINFER_DTYPE_BF16, (ag[r] + partner[tile][2 * r][lane]) * x_inv[0]);
            const float uv = round_to(XINFER_DTYPE_BF16, (au[r] + partner[tile][2 * r + 1][lane]) * x_inv[0]);
            h_chunk[tile * 16 + g + (r >= 2 ? 8 : 0)] = __float2bfloat16_rn(gv / (1.f + expf(-gv)) * uv);
        }
    }
    __syncthreads();

    uint32_t hw[8];  // the lane's h fragment, the same in every round: h[16c .. 16c + 16)
    load_x_frag<true, kActShared>(hw, h_chunk, c * 16, true);
    float h_inv = 1.f;  // undoes the f16 fragment's scale on the sums
    if constexpr (kF16Down) hw_to_f16(hw, h_inv);
    float* part = a.partial + (int64_t(j) * (I / kRowsPerBlock) + ib) * H;
    struct DownRound {
        uint4 r0[1], r1[1];
    };
    const auto use_down = [&](const DownRound& w, int64_t n0) {
        AFrag<true, kF16Down> f;
        f.set(w.r0[0], w.r1[0]);
        float t[4] = {0.f, 0.f, 0.f, 0.f};
        f.mma(t, hw);
        const int round = int((n0 - warp * 16) / kTileStep);  // warp-uniform
        const float held = __shfl_sync(0xffffffffu, lane_scale, round & 31);
        const float s = round < 32 ? held : tile_scale(n0);
        if (c < 2) part[n0 + g + 8 * c] = (c == 0 ? t[0] : t[2]) * (s * h_inv);  // rows n0 + g and n0 + g + 8
    };
    stream_rounds_ring<kDownRing, DownRound>(warp * 16, H, kTileStep, ring, lane, down_loads, use_down, true);
}

// out[n] = Σ_j weight_j · Σ_ib partial[j, ib, n]. A block takes 32 columns; warp w the slots w,
// w + 8, ... (each part in ib order), then the warps' sums are added in warp order.
__global__ void __launch_bounds__(kSumWarps * 32) moe_split_i_sum_kernel(const float* partial /*[top_k, parts, H]*/,
                                                                       const int32_t* chosen /*[top_k]*/,
                                                                       const float* weight /*[top_k]*/, int top_k,
                                                                       int E, int parts, int64_t H, void* out,
                                                                       int out_dtype) {
    __shared__ float by_warp[kSumWarps][32];
    __shared__ int bad;
    pdl_begin();  // (triggering the next grid before the wait lost in the small kernels: session 19)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t n = int64_t(blockIdx.x) * 32 + lane;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    float acc = 0.f;
    for (int s = warp; s < top_k; s += kSumWarps) {
        const int e = chosen[s];
        if (e < 0 || e >= E) {
            bad = 1;  // every writer stores the same value
            continue;
        }
        if (n >= H) continue;
        const float* p = partial + int64_t(s) * parts * H + n;
        float sum = 0.f;
#pragma unroll 32
        for (int q = 0; q < parts; ++q) sum += p[q * H];
        acc = fmaf(weight[s], sum, acc);
    }
    by_warp[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && n < H) {
        float total = 0.f;
        for (int w = 0; w < kSumWarps; ++w) total += by_warp[w][lane];
        store_f(out, out_dtype, n, bad ? __int_as_float(0x7fc00000) : total);
    }
}

}  // namespace

bool moe_split_i_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_MOE_SPLIT_I", false);
    return enabled;
}

bool moe_split_i_fits(int64_t H, int64_t I, int block_rows, int block_cols) {
    return H > 0 && I > 0 && H % 64 == 0 && I % kRowsPerBlock == 0 && size_t(H) * 2 <= kXSmemMaxBytes &&
           block_rows % 16 == 0 && block_cols % 64 == 0 && col_block_exact(H, block_cols) &&
           col_block_exact(H, block_rows);
}

size_t moe_split_i_partial_bytes(int64_t top_k, int64_t H, int64_t I) {
    return size_t(top_k) * size_t(I / kRowsPerBlock) * size_t(H) * 4;
}

int launch_moe_split_i(Context* c, const SplitIMoe& a) {
    SplitIMoe args = a;
    size_t smem = size_t(kWarps) * kGateRingVecs * 16 + size_t(a.H) * 2 + 16;
    if (args.route.logits) {  // the routing scratch lies under the rings, which fill after the routing
        args.route.scratch_offset = 0;
        smem = std::max(smem, route_smem_bytes(a.E, a.route.params));
    }
    static const int64_t ring = env_int("XINFER_CUDA_MOE_SPLIT_I_RING", 8);
    static const bool f16 = env_flag("XINFER_CUDA_MOE_SPLIT_I_F16", false);
    auto kernel = f16 ? moe_split_i_kernel<8, true>
                  : ring == 4 ? moe_split_i_kernel<4, false> : ring == 12 ? moe_split_i_kernel<12, false> : moe_split_i_kernel<8, false>;
    if (smem > 48 * 1024)
        XCUDA_TRY(c, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int parts = int(a.I / kRowsPerBlock);
    if (int rc = launch_pdl(c, "moe_split_i_kernel", kernel, dim3(unsigned(parts), unsigned(a.top_k)),
                            dim3(kWarps * 32), smem, args))
        return rc;
    return launch_pdl(c, "moe_split_i_sum_kernel", moe_split_i_sum_kernel, dim3(unsigned(ceil_div(a.H, 32))),
                      dim3(kSumWarps * 32), 0, static_cast<const float*>(a.partial),
                      static_cast<const int32_t*>(a.chosen), static_cast<const float*>(a.chosen_weight), a.top_k, a.E,
                      parts, a.H, a.out, a.out_dtype);
}

}  // namespace xcuda
