// Tensor-core weight streams shared by the few-token kernels (moe.cu's grouped experts, gemm.cu's
// FP8 GEMV): the bf16 and f16 mma, 16-byte streaming loads, e4m3 → bf16 / f16 A fragments,
// activation fragments and their f16 staging, and the register / shared-memory-ring round pipelines.
//
// mma.sync m16n8k16: a warp owns 16 weight rows (lane (g, c) = (lane/4, lane%4) holds rows g and
// g + 8), and the 8 columns of B are 8 activation rows (tokens or pairs). The mma's k order is a
// permutation of the columns, the same for weights and activations: lane (g, c) loads columns
// [c·w, c·w + w) of each chunk of 4w (w = 8 bf16 or 16 e4m3 per 16-byte load), and so does its
// activation fragment.
#pragma once

#include "common.h"
#include "device_utils.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace xcuda {
namespace {

// d[16×8] += a[16×16] · b[16×8], bf16 (kF16: f16) in, f32 accumulate. a0/a2: row g, a1/a3: row
// g+8; a0/a1 and b0 hold k = 2c, 2c+1; a2/a3 and b1 hold k = 2c+8, 2c+9.
template <bool kF16 = false>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#define XCUDA_MMA_16816(AB)                                                                               \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
                 "{%8, %9}, {%0, %1, %2, %3};\n"                                                           \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                          \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
    if constexpr (kF16) XCUDA_MMA_16816("f16");
    else XCUDA_MMA_16816("bf16");
#undef XCUDA_MMA_16816
}

// 16 bytes of weights that are read once: no L1 allocation, so the activations stay cached.
// kWholeLine (the default): each lane's 16 bytes are a quarter of a 64-byte run of one weight row
// (8 rows per warp load), so the load asks L2 for the whole 128-byte line: the next load of the
// lane's quad finds the other half there. H200, 8 experts' 134 MB read in this pattern
// (cuda-stream-patterns, plugins/cuda/dev): 3.5 TB/s without the hint, 4.0 with it, as fast as whole
// 512-byte row segments (.L2::256B gained the same, .L2::64B nothing); the whole MoE op at T = 8 over
// 8 experts 131 -> 122 µs. Row-contiguous streams (a warp reads 512 bytes of one row) need no hint.
template <bool kWholeLine = true>
__device__ __forceinline__ uint4 load_stream16(const void* p) {
    uint4 v;
    if constexpr (kWholeLine)
        asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    else
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    return v;
}

// Two e4m3 values (the low 16 bits of v, or kHigh the high 16) to f16x2: one conversion
// instruction, exact. The 16-bit halves are named in PTX (mov.b32 {lo, hi}): written as v >> 16,
// the high pair cost a shift before each conversion (16 SHF per FP8 gate_up round, ncu SASS).
template <bool kHigh = false>
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
    uint32_t h;
    if constexpr (kHigh)
        asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, hi;\n\t}" : "=r"(h) : "r"(v));
    else
        asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, lo;\n\t}" : "=r"(h) : "r"(v));
    return h;
}

// Two e4m3 values (the low or kHigh the high 16 bits of v) to bf16x2, exactly (e4m3 ⊂ f16 ⊂
// f32, and bf16 holds every e4m3 value).
template <bool kHigh = false>
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t v) {
    const uint32_t hv = e4m3x2_to_f16x2<kHigh>(v);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hv));
    const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const uint32_t*>(&b);
}

// One chunk's A fragments (rows g and g+8), ready for the mma: bf16 chunks are 32 columns (two
// k16 steps), fp8 chunks 64 columns (four). kF16 (fp8 only): the e4m3 weights become f16 (one
// conversion per pair instead of four through f32 to bf16) for the f16 mma, whose activations
// must then be f16 too (stage_act_f16).
template <bool kFp8, bool kF16 = false>
struct AFrag {
    static_assert(kFp8 || !kF16, "f16 fragments are for e4m3 weights");
    static constexpr int kSteps = kFp8 ? 4 : 2;
    uint32_t a[kSteps][4];
    template <bool kHigh = false>
    __device__ __forceinline__ static uint32_t widen(uint32_t v) {
        if constexpr (kF16) return e4m3x2_to_f16x2<kHigh>(v);
        else return e4m3x2_to_bf16x2<kHigh>(v);
    }
    __device__ __forceinline__ void set(uint4 r0, uint4 r1) {
        if constexpr (kFp8) {
            const uint32_t w0[4] = {r0.x, r0.y, r0.z, r0.w}, w1[4] = {r1.x, r1.y, r1.z, r1.w};
#pragma unroll
            for (int m = 0; m < 4; ++m) {  // step m: columns 16c + 4m .. 16c + 4m + 3
                a[m][0] = widen(w0[m]);
                a[m][1] = widen(w1[m]);
                a[m][2] = widen<true>(w0[m]);
                a[m][3] = widen<true>(w1[m]);
            }
        } else {  // step m: columns 8c + 4m .. 8c + 4m + 3
            a[0][0] = r0.x, a[0][1] = r1.x, a[0][2] = r0.y, a[0][3] = r1.y;
            a[1][0] = r0.z, a[1][1] = r1.z, a[1][2] = r0.w, a[1][3] = r1.w;
        }
    }
    // d += step m of A · X.
    __device__ __forceinline__ void mma_step(float (&d)[4], int m, const uint32_t* xw) const {
        mma_16816<kF16>(d, a[m][0], a[m][1], a[m][2], a[m][3], xw[2 * m], xw[2 * m + 1]);
    }
    // d += A · X for one 8-pair tile; xw = the lane's activations at its columns of the chunk
    // (8 bf16 in xw[0..3], fp8 chunks 16 in xw[0..7]).
    __device__ __forceinline__ void mma(float (&d)[4], const uint32_t* xw) const {
#pragma unroll
        for (int m = 0; m < kSteps; ++m) mma_step(d, m, xw);
    }
};

// Stages bf16 activations [rows, K] (row stride K, 16-byte aligned, K % 8 == 0) in shared memory
// as f16 for the f16 mma, row r times 2^s_r so that its largest magnitude lies in [2^14, 2^15):
// every value down to 2^-32 of the row's largest keeps all of its 8 significant bits (f16 holds 11
// down to 2^-14 and steps of 2^-24 below), smaller ones round to steps of 2^-38 of the largest,
// far below the f32 sums' own rounding. The products with e4m3 weights are exact in f32, as on the
// bf16 path; inv[r] = 2^-s_r undoes the scale on the sums. A row holding inf or NaN keeps s = 0
// (it poisons its sums as before). Block-wide: every thread calls it (it synchronizes). One pass:
// each thread holds at most kStageVecs 16-byte pieces in registers (rows · K ≤ 8 · kStageVecs ·
// blockDim), the rows' maxima meet in shared memory (row_max: ≥ rows ints, rows ≤ kStageMaxRows);
// loads go through L2 (the source may be the previous PDL grid's output).
constexpr int kStageVecs = 16, kStageMaxRows = 64;
// s for a row whose largest magnitude has the bits max_bits (0 for zero, inf or NaN rows).
__device__ __forceinline__ int stage_shift(int max_bits) {
    const float m = __int_as_float(max_bits);
    int exponent = 0;
    frexpf(m, &exponent);  // m in [2^(exponent - 1), 2^exponent)
    return m > 0.f && m <= 3.4e38f ? max(-120, min(120, 15 - exponent)) : 0;
}
template <bool kSharedSrc = false>  // src in shared memory (plain loads), else global (through L2)
__device__ __forceinline__ void stage_act_f16(const __nv_bfloat16* src, int rows, int64_t K, __half* dst, float* inv,
                                              int* row_max) {
    const int64_t vecs = K / 8, total = int64_t(rows) * vecs;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) row_max[r] = 0;
    __syncthreads();
    uint4 v[kStageVecs];
#pragma unroll
    for (int k = 0; k < kStageVecs; ++k) {
        const int64_t i = threadIdx.x + int64_t(k) * blockDim.x;
        if (i >= total) break;
        v[k] = kSharedSrc ? reinterpret_cast<const uint4*>(src)[i] : __ldcg(reinterpret_cast<const uint4*>(src) + i);
    }
#pragma unroll
    for (int k = 0; k < kStageVecs; ++k) {
        const int64_t i = threadIdx.x + int64_t(k) * blockDim.x;
        if (i >= total) break;
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[k]);
        float m = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(b[e]);
            m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
        atomicMax(row_max + i / vecs, __float_as_int(m));  // non-negative floats order as ints
    }
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += blockDim.x) inv[r] = __int_as_float((127 - stage_shift(row_max[r])) << 23);
#pragma unroll
    for (int k = 0; k < kStageVecs; ++k) {
        const int64_t i = threadIdx.x + int64_t(k) * blockDim.x;
        if (i >= total) break;
        const float up = __int_as_float((127 + stage_shift(row_max[i / vecs])) << 23);
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[k]);
        uint4 o;
        uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(b[e]);
            const __half2 h = __floats2half2_rn(f.x * up, f.y * up);
            ow[e] = *reinterpret_cast<const uint32_t*>(&h);
        }
        reinterpret_cast<uint4*>(dst)[i] = o;
    }
    __syncthreads();
}

// The lane's activation fragment of one chunk: columns [col, col + 8·(1 + kFp8)), zero past the end.
// Where the activations are read from:
//   kActReadOnly  the read-only path (x, reused from L1 by the block's other row tiles);
//   kActL2        through L2 only (`h`, which the gate_up grid writes while a PDL-launched down
//                 grid already runs, so it is not read-only for the reader's lifetime);
//   kActShared    a copy in shared memory (plain generic loads).
enum ActSource { kActReadOnly, kActL2, kActShared };
template <ActSource kSrc>
__device__ __forceinline__ uint4 load_act16(const __nv_bfloat16* p) {
    if constexpr (kSrc == kActL2) return __ldcg(reinterpret_cast<const uint4*>(p));
    else if constexpr (kSrc == kActShared) return *reinterpret_cast<const uint4*>(p);
    else return __ldg(reinterpret_cast<const uint4*>(p));
}
template <bool kFp8, ActSource kSrc = kActReadOnly>
__device__ __forceinline__ void load_x_frag(uint32_t (&xw)[8], const __nv_bfloat16* row, int64_t col, bool ok) {
    const uint4 z = make_uint4(0, 0, 0, 0);
    const uint4 v0 = ok ? load_act16<kSrc>(row + col) : z;
    xw[0] = v0.x, xw[1] = v0.y, xw[2] = v0.z, xw[3] = v0.w;
    if constexpr (kFp8) {
        const uint4 v1 = ok ? load_act16<kSrc>(row + col + 8) : z;
        xw[4] = v1.x, xw[5] = v1.y, xw[6] = v1.z, xw[7] = v1.w;
    }
}

// col / block_cols as one multiply-high by m = ceil(2^32 / block_cols): exact while col < 2^32 /
// block_cols (the fraction col·(m·d − 2^32) / (d·2^32) added to col/d stays below 1/d; checked
// exhaustively for every multiple of 64 up to 8,192), and beyond that only for powers of two —
// block width 192 fails from col = 2^25 on. The launchers check col_block_exact. A runtime int64
// division was ~19 instructions on its 32-bit fast path, once per round.
__host__ __device__ inline bool col_block_exact(int64_t cols, int64_t block_cols) {
    return block_cols > 0 && cols <= (int64_t(1) << 32) / block_cols;
}
struct ColBlock {
    uint32_t magic;
    __device__ __forceinline__ explicit ColBlock(int64_t block_cols)
        : magic(uint32_t((0x100000000ull + uint64_t(block_cols) - 1) / uint64_t(block_cols))) {}
    __device__ __forceinline__ int operator()(int64_t col) const { return int(__umulhi(uint32_t(col), magic)); }
};

// A chunk's scale for fp8_round_mma, two ways. RowScales loads it (through L1) in every round.
// WarpScales holds the row block's scales in the warp's lanes — lane l keeps scale_row[l + 32·s]
// in slot s — so a chunk's scale is a shuffle, not a load the round's last FMAs wait on. In
// mma_gemv_kernel that pays (H200, ops-test --perf, the FP8 q|k|v [14848, 4096] at
// T = 1: 17.8 -> 17.3 µs, 81 -> 83.5% of copy). The expert kernels keep RowScales: there the
// shuffles cost more than they saved (FP8 experts T = 1 56.5 -> 57.0 µs, T = 8 68.2 -> 70.3 µs;
// docs/perf/2026-12-01-h200-session20.md). Rows with more than 32·kSlots scale blocks load the
// rest. Constructed by the whole warp; the scales are weights, so this may run before the PDL wait.
struct RowScales {
    const float* row;
    ColBlock block_of;
    __device__ __forceinline__ float at(int64_t chunk) const { return __ldg(row + block_of(chunk)); }
};
template <int kSlots>
struct WarpScales {
    const float* row;
    ColBlock block_of;
    float held[kSlots];
    // scale_cols: the scale blocks in the row.
    __device__ __forceinline__ WarpScales(const float* scale_row, int64_t scale_cols, int64_t block_cols, int lane)
        : row(scale_row), block_of(block_cols) {
#pragma unroll
        for (int s = 0; s < kSlots; ++s) held[s] = lane + 32 * s < int(scale_cols) ? __ldg(row + lane + 32 * s) : 0.f;
    }
    // The scale of the chunk starting at column `chunk` (warp-uniform).
    __device__ __forceinline__ float at(int64_t chunk) const {
        const int b = block_of(chunk);
        if (b >= 32 * kSlots) return __ldg(row + b);  // warp-uniform
        float v = held[0];
#pragma unroll
        for (int s = 1; s < kSlots; ++s)
            if (b >= 32 * s) v = held[s];
        return __shfl_sync(0xffffffffu, v, b % 32);
    }
};

// acc += Σ_u scale(chunk u) · A_u · X_u over one round of kU e4m3 chunks (64 columns each, rows g
// and g + 8 of a 16-row tile in r0 / r1) at columns kb + 64u, against one 8-column activation tile.
// load_x(xw, col, ok) loads the lane's activation fragment at column col (zero when !ok); scales
// (RowScales or WarpScales) gives a chunk's scale. The chunks' mma chains are independent and run
// interleaved: one chain of 4 dependent mmas per chunk left the warps waiting on the tensor core (a
// third of the FP8 mma_gemv_kernel's stall samples, ncu). Chunks at or past `end` are zero and
// skipped; a chunk lies in one scale block (block_cols % 64 == 0).
template <int kU, bool kF16, typename Scales, typename LoadX>
__device__ __forceinline__ void fp8_round_mma(const uint4 (&r0)[kU], const uint4 (&r1)[kU], int64_t kb, int64_t end,
                                              int c, const Scales& scales, const LoadX& load_x, float (&acc)[4]) {
    constexpr int kChunk = 64;
    AFrag<true, kF16> f[kU];
    uint32_t xw[kU][8];
    float t[kU][4];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int64_t col = kb + u * kChunk + c * 16;
        f[u].set(r0[u], r1[u]);
        load_x(xw[u], col, col < end);
#pragma unroll
        for (int i = 0; i < 4; ++i) t[u][i] = 0.f;
    }
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int u = 0; u < kU; ++u) f[u].mma_step(t[u], m, xw[u]);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int64_t chunk = kb + u * kChunk;
        if (chunk >= end) break;  // warp-uniform
        const float s = scales.at(chunk);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = fmaf(t[u][i], s, acc[i]);
    }
}

// acc[u] += A_u · X_u over one round of kU bf16 chunks (32 columns each, rows g and g + 8 of a
// 16-row tile in r0 / r1) at columns kb + 32u: the loaded words are the A fragments as they are.
// One accumulator per chunk keeps the chunks' mma chains independent. Chunks at or past `end`
// hold zero weights and get zero activations.
template <int kU, typename LoadX>
__device__ __forceinline__ void bf16_round_mma(const uint4 (&r0)[kU], const uint4 (&r1)[kU], int64_t kb, int64_t end,
                                               int c, const LoadX& load_x, float (&acc)[kU][4]) {
    constexpr int kChunk = 32;
    AFrag<false> f[kU];
    uint32_t xw[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
        const int64_t col = kb + u * kChunk + c * 8;
        f[u].set(r0[u], r1[u]);
        load_x(xw[u], col, col < end);
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int u = 0; u < kU; ++u) f[u].mma_step(acc[u], m, xw[u]);
}

// The register path's load_round: a Round of 16-byte loads (load m from src(m, kb), zero where
// src gives null) into registers.
template <typename Round, typename Src>
__device__ __forceinline__ void load_round_regs(Round& w, const Src& src, int64_t kb) {
    static_assert(sizeof(Round) % 16 == 0, "a round is 16-byte loads");
    uint4* wv = reinterpret_cast<uint4*>(&w);
#pragma unroll
    for (int m = 0; m < int(sizeof(Round) / 16); ++m) {
        const char* p = src(m, kb);
        wv[m] = p ? load_stream16(p) : make_uint4(0, 0, 0, 0);
    }
}

// Streams the rounds at kb = begin, begin + step, ... < end: load_round(w, kb) issues a round's
// weight loads into registers, use_round(w, kb) consumes them. kPipe: the next round's loads are
// issued before the current round is used (two register sets of half the size), so a warp always
// has loads in flight; without it a warp alternates between waiting for a whole round and computing.
template <bool kPipe, typename Round, typename Load, typename Use>
__device__ __forceinline__ void stream_rounds(int64_t begin, int64_t end, int64_t step, const Load& load_round,
                                              const Use& use_round) {
    if constexpr (kPipe) {
        Round a, b;
        if (begin < end) load_round(a, begin);
        for (int64_t kb = begin; kb < end; kb += 2 * step) {
            if (kb + step < end) load_round(b, kb + step);
            use_round(a, kb);
            if (kb + step >= end) break;
            if (kb + 2 * step < end) load_round(a, kb + 2 * step);
            use_round(b, kb + step);
        }
    } else {
        for (int64_t kb = begin; kb < end; kb += step) {
            Round a;
            load_round(a, kb);
            use_round(a, kb);
        }
    }
}

// The same stream staged through shared memory: a round is M 16-byte loads per lane (Round is
// uint4[M]); cp.async copies them into the warp's ring of kRing slots, laid out [slot][m][lane] so
// that a lane's read-back is conflict-free, and the lane reads back only what it copied itself (no
// barrier). kRing - 1 rounds stay in flight per warp without holding registers: the register
// paths above keep at most two rounds, and their warps sat on long-scoreboard stalls at a quarter
// occupancy (ncu, FP8 experts, session 6).
// 16 bytes of a weight stream into shared memory (L2 asked for the whole 128-byte line, as load_stream16).
__device__ __forceinline__ void cp_async16_stream(uint4* dst, const void* src) {
    const uint32_t d = uint32_t(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async16_or_zero(uint4* dst, const void* src) {
    if (src) cp_async16_stream(dst, src);
    else *dst = make_uint4(0, 0, 0, 0);  // read back by this lane only: ordered after this store
}
// Where one lane's rounds come from: load m of a round (m = row · kU + u) reads the 16 bytes at
// column kb + u·kChunk + lane_col of weight row `row`, zero at or past `end`; rounds start at
// columns begin, begin + step, ... The lane's row addresses advance with the rounds (a
// loop-carried value stays in registers): computed from the row indices at every round instead,
// the compiler rematerialized them with 64-bit multiplies, ~100 of the grouped gate_up kernel's
// ~280 instructions per round (ncu source counters, H200, FP8 experts at batch 1).
template <int kRows, int kU, int kBytes>
struct LaneRounds {
    static constexpr int kLoads = kRows * kU, kLaneCols = 16 / kBytes, kChunk = 4 * kLaneCols;
    const char* row[kRows];  // the current round's address of the lane's first column in each row
    int64_t kb, end, step;
    int lane_col;
    __device__ __forceinline__ LaneRounds(const char* const (&rows)[kRows], int c, int64_t begin, int64_t end_,
                                          int64_t step_)
        : kb(begin), end(end_), step(step_), lane_col(c * kLaneCols) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) row[r] = rows[r] + (begin + lane_col) * kBytes;
    }
    // Load m of the current round, or null (zero) past the end.
    __device__ __forceinline__ const char* address(int m) const {
        const int u = m % kU;
        return kb + u * kChunk + lane_col < end ? row[m / kU] + u * kChunk * kBytes : nullptr;
    }
    __device__ __forceinline__ void advance() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) row[r] += step * kBytes;
        kb += step;
    }
    // Issues the current round into ring slot `slot` as one cp.async group (an empty group past the
    // end), then moves to the next round. A round wholly before `end` skips the per-load checks.
    __device__ __forceinline__ void issue(uint4* ring /*[slots][kLoads][32]*/, int lane, int slot) {
        uint4* dst = ring + slot * kLoads * 32 + lane;
        if (kb + kU * kChunk <= end) {
#pragma unroll
            for (int m = 0; m < kLoads; ++m) cp_async16_stream(dst + m * 32, row[m / kU] + (m % kU) * kChunk * kBytes);
        } else if (kb < end) {
#pragma unroll
            for (int m = 0; m < kLoads; ++m) cp_async16_or_zero(dst + m * 32, address(m));
        }
        asm volatile("cp.async.commit_group;\n" ::);
        advance();
    }
};
// The ring's first kRing - 1 rounds. A kernel may issue them before its PDL wait (the weights are
// constant) and pass first_issued = true to stream_rounds_ring: the stream then starts with its
// loads already in flight while the previous kernel finishes.
template <int kRing, typename Loads>
__device__ __forceinline__ void ring_issue_first(Loads& loads, uint4* ring, int lane) {
#pragma unroll
    for (int d = 0; d < kRing - 1; ++d) loads.issue(ring, lane, d);
}
// Consumes the rounds at kb = begin, begin + step, ... < end (`loads` starts at the same round)
// through the warp's ring of kRing slots: round i lives in slot i % kRing, and round i + kRing - 1
// is issued before round i is used.
template <int kRing, typename Round, typename Loads, typename Use>
__device__ __forceinline__ void stream_rounds_ring(int64_t begin, int64_t end, int64_t step, uint4* ring /*[kRing][M][32]*/,
                                                   int lane, Loads& loads, const Use& use_round,
                                                   bool first_issued = false) {
    constexpr int M = Loads::kLoads;
    static_assert(sizeof(Round) == M * 16, "a round is M 16-byte loads");
    if (!first_issued) ring_issue_first<kRing>(loads, ring, lane);
    int slot = 0;
    for (int64_t kb = begin; kb < end; kb += step) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kRing - 2));  // round i has landed
        // Round i + kRing - 1 into the slot that round i - 1 used (read back last iteration).
        loads.issue(ring, lane, slot == 0 ? kRing - 1 : slot - 1);
        Round w;
        uint4* wv = reinterpret_cast<uint4*>(&w);
#pragma unroll
        for (int m = 0; m < M; ++m) wv[m] = ring[(slot * M + m) * 32 + lane];
        use_round(w, kb);
        slot = slot + 1 == kRing ? 0 : slot + 1;
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
}

}  // namespace
}  // namespace xcuda
