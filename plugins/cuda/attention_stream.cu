// Decode ATTENTION as per-warp key streams: the kernel for decode-shaped batches (a block's query
// rows fit one 16-row tile: one token of a sequence and KV head, or a few tokens of a small
// group) of bf16 heads with MiMo's (192, 128) or Qwen3's (128, 128) dims over 16-token pages.
//
// Why not attention_decode.cu's kernel. That kernel shares each 64-key tile among a block's 8
// warps (8 keys each) behind two block barriers per tile, with 16-byte cp.async copies whose
// address arithmetic is a quarter of its instructions. At batch 1 a warp then walks a chain of
// ~600 dependent instructions per tile for 8 keys (ncu, H200, 32K keys: 4,930 instructions per
// warp, one issued every ~11 cycles, DRAM at 50%). Here every warp streams its own keys:
//   - a block owns the ≤ 16 query rows of one row tile and KV head and one split of their keys;
//     its warps take the split's pages round-robin, one page (16 keys) per tile;
//   - each warp keeps kStages pages of its own in flight in shared memory, each brought by one
//     lane with a TMA copy per 64-column box of the page's 16 rows for this KV head (MiMo: three
//     for K, two for V), 128-byte swizzled so that ldmatrix reads them without bank conflicts,
//     completing on the stage's mbarrier;
//   - the warp's Q fragments stay in registers; per tile it computes S = Q·Kᵀ (16 × 16), the online
//     softmax and O += P·V with mma.sync m16n8k16, and waits only on its own mbarrier - no block
//     barrier inside the key loop;
//   - at the end the block merges its warps' (m, l, O) and writes the output (one split) or the
//     unnormalised partials, which the split blocks then merge with the sink themselves when the
//     whole grid is resident (merge_splits_in_kernel), else attention_decode.cu's combine kernel.
// A page is copied whole: rows of keys no token of the block sees hold whatever the slot holds
// (unwritten slots past kv_len: anything), so their scores are masked and, in the two edge tiles
// of a block's range, their V rows zeroed (P = 0 times a NaN would not be 0). A needed key on a
// released page (-1) reads as NaN, as in attention_decode.cu, whose header describes the masking,
// the sinks and the early (pre-PDL-wait) loads of older keys. XINFER_CUDA_ATTN_STREAM=0 routes
// these batches back to attention_decode.cu (A/B).
#include "attention_common.cuh"
#include "attention_tiles.cuh"
#include "common.h"
#include "device_utils.cuh"
#include "tma.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace xcuda {
namespace {

constexpr int kKeys = 16;      // keys per warp tile: one page
constexpr int kTileRows = 16;  // query rows per block
constexpr int kBoxCols = 64;   // columns per TMA box: 128 bytes, the 128-byte swizzle's span
constexpr int kBoxBytes = kKeys * kBoxCols * 2;

// The caches as TMA sees them: [pages][page_size][n_kv][d] with the pages page_stride apart, in
// boxes of 64 columns × 1 head × 16 slots × 1 page.
struct PageMaps {
    CUtensorMap k, v;
};

// Shared memory (bytes, from a 1024-byte aligned base): per warp kStages stages of K [dk / 64
// boxes][16 rows][64] and V [dv / 64][16][64] bf16, 128-byte swizzled (a row's 16-byte chunk c at
// c ^ (row % 8)), whose first stages hold the warp's O [16][ldo] f32 after its key loop; Q [16][ldq]
// bf16 (rows padded by 8 elements for ldmatrix); the mbarriers [warps][kStages], the tokens' key
// ranges, each warp's row states (m, l) and the merge factors.
struct StreamSmem {
    int ldq, ldo, v_stage, stage, warp_bytes, q, bars, lo, hi, ml, fac, total;
};
template <int kDk, int kDv, int kWarps, int kStages>
__host__ __device__ constexpr StreamSmem stream_smem() {
    StreamSmem L{};
    L.ldq = kDk + 8;
    L.ldo = kDv + 4;
    L.v_stage = kDk / kBoxCols * kBoxBytes;
    L.stage = L.v_stage + kDv / kBoxCols * kBoxBytes;
    L.warp_bytes = kStages * L.stage;
    L.q = kWarps * L.warp_bytes;
    L.bars = L.q + kTileRows * L.ldq * 2;
    L.lo = L.bars + kWarps * kStages * 8;
    L.hi = L.lo + kTileRows * 4;
    L.ml = L.hi + kTileRows * 4;                // [warps][16 rows][2]
    L.fac = L.ml + kWarps * kTileRows * 2 * 4;  // [16 rows][warps + 2]
    L.total = L.fac + kTileRows * (kWarps + 2) * 4 + 1024;  // + the base's alignment
    return L;
}

// Byte offset in a swizzled stage of the 16-byte chunk holding columns [col, col + 8) of row r.
__device__ __forceinline__ int swizzled(int r, int col) {
    return (col / kBoxCols) * kBoxBytes + r * 128 + ((((col % kBoxCols) / 8) ^ (r % 8)) << 4);
}

// The output row (token · nq + query head) of the block's tile row r.
__device__ __forceinline__ int64_t out_row(const DecodeArgs& a, const BlockRows& b, int g, int r) {
    const int64_t flat = b.row0 + r;
    const int64_t t = b.token_base + (flat / a.group - b.tok_first);
    return t * a.nq + g * a.group + int(flat % a.group);
}

// The in-kernel merge of one (row tile, KV head)'s n_split partials. counters: [arrived,
// departed], zero between launches. Each split block has written its partials; it raises
// `arrived` and waits until all n_split blocks have (the pattern of cooperative groups' grid
// sync), then merges its own 1/n_split share of the tile's output columns: the combine kernel's
// work spread over blocks already resident, with no launch and no grid-wide wait in between.
// Launched only when every real block of the grid fits on the GPU at once, so that a waiting
// block never holds the slot an unstarted one needs. smem: the block's stage buffers (free now).
template <int kDv, int kThreads>
__device__ void merge_splits_in_kernel(const DecodeArgs& a, const BlockRows& b, int g, int split, int* counters,
                                       unsigned char* smem) {
    __syncthreads();  // the block's partials are written (and its warps' O in shared memory read)
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counters, 1);
        while (ld_acquire_gpu(counters) < a.n_split) __nanosleep(32);
        __threadfence();
    }
    __syncthreads();
    constexpr int kCols4 = kDv / 4;  // float4 columns a row
    const int n_split = a.n_split, n4 = b.rows * kCols4;
    const int per = (n4 + n_split - 1) / n_split;  // float4 columns each split block merges
    const int e_lo = min(n4, split * per), e_hi = min(n4, e_lo + per);
    const int r_lo = e_lo / kCols4;
    const int64_t part_rows = a.T * a.nq;  // rows of one split's partials
    auto* weight = reinterpret_cast<float*>(smem);  // [rows of the share][n_split]
    auto* sums = reinterpret_cast<float4*>(smem + kTileRows * kMaxDecodeSplits * 4);  // [kThreads]

    // A warp per row of the share: the splits' weights (as attention_decode.cu's combine kernel).
    for (int r = r_lo + int(threadIdx.x) / 32; e_lo < e_hi && r <= (e_hi - 1) / kCols4; r += kThreads / 32)
        split_weights(a.part_ml, n_split, part_rows, out_row(a, b, g, r), a.sinks, a.nq, weight + (r - r_lo) * n_split);
    __syncthreads();

    // tpe threads per float4 column, each summing splits zt, zt + tpe, ... (four loads in flight),
    // then the first of them adds the tpe sums and stores the bf16 output.
    const int tpe = max(1, kThreads / per), cols_per_pass = kThreads / tpe;
    for (int e0 = e_lo; e0 < e_hi; e0 += cols_per_pass) {
        const int e = e0 + int(threadIdx.x) / tpe, zt = int(threadIdx.x) % tpe;
        const bool mine = int(threadIdx.x) / tpe < cols_per_pass && e < e_hi;
        const int r = e / kCols4, d = (e % kCols4) * 4;
        const int64_t R = mine ? out_row(a, b, g, r) : 0;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int z0 = zt; mine && z0 < n_split; z0 += 4 * tpe) {
            float4 v[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int z = z0 + k * tpe;
                v[k] = z < n_split ? __ldcg(reinterpret_cast<const float4*>(a.part_o + (z * part_rows + R) * kDv + d))
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int z = z0 + k * tpe;
                const float w = z < n_split ? weight[(r - r_lo) * n_split + z] : 0.f;
                acc.x += v[k].x * w;
                acc.y += v[k].y * w;
                acc.z += v[k].z * w;
                acc.w += v[k].w * w;
            }
        }
        sums[threadIdx.x] = acc;
        __syncthreads();
        if (mine && zt == 0) {
            for (int k = 1; k < tpe; ++k) {
                const float4 o = sums[threadIdx.x + k];
                acc.x += o.x;
                acc.y += o.y;
                acc.z += o.z;
                acc.w += o.w;
            }
            const __nv_bfloat162 v[2] = {__floats2bfloat162_rn(acc.x, acc.y), __floats2bfloat162_rn(acc.z, acc.w)};
            *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(a.out) + R * kDv + d) = *reinterpret_cast<const uint2*>(v);
        }
        __syncthreads();
    }
    // The last block out leaves the counters at zero for the next launch, which touches them only
    // after its pdl_wait (this grid complete).
    if (threadIdx.x == 0 && atomicAdd(counters + 1, 1) == n_split - 1) {
        counters[0] = 0;
        counters[1] = 0;
    }
}

template <int kDk, int kDv, int kWarps, int kStages>
__global__ void __launch_bounds__(kWarps * 32, 1)
    attention_stream_kernel(DecodeArgs a, const __grid_constant__ PageMaps maps, int* merge_counters) {
    static_assert(kDk % kBoxCols == 0 && kDv == 128, "whole TMA boxes; the epilogue gives a lane 4 of 128 columns");
    constexpr StreamSmem L = stream_smem<kDk, kDv, kWarps, kStages>();
    constexpr int kThreads = kWarps * 32, kDkSteps = kDk / 16;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
    if (!a.early_kv) pdl_wait();
    auto* Qs = reinterpret_cast<__nv_bfloat16*>(smem + L.q);
    auto* bars = reinterpret_cast<uint64_t*>(smem + L.bars);
    auto* tok_lo = reinterpret_cast<int*>(smem + L.lo);
    auto* tok_hi = reinterpret_cast<int*>(smem + L.hi);
    auto* ml_s = reinterpret_cast<float*>(smem + L.ml);
    auto* fac = reinterpret_cast<float*>(smem + L.fac);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tid4 = lane % 4;
    const int g = blockIdx.y, split = blockIdx.z, G = a.group;
    const BlockRows b = block_rows(find_row_tile(a.cu_q_lens, a.n_seqs, G, kTileRows, gridDim.x - 1 - blockIdx.x),
                                   kTileRows, G, a.cu_q_lens, a.kv_lens);
    if (b.seq < 0) return;
    store_token_ranges(b, a.positions, a.causal, a.window, kThreads, tok_lo, tok_hi);
    uint64_t* my_bars = bars + warp * kStages;
    if (lane < kStages) mbar_init(my_bars + lane, 1);
    if (tid == 0) {
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&maps.k)) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&maps.v)) : "memory");
    }
    fence_mbarrier_init();
    __syncthreads();

    // The block's keys [union_lo, union_hi] (the union of its tokens' ranges, contiguous: the
    // tokens are consecutive positions), cut into n_split chunks of whole pages; this split's
    // keys [key_lo, key_hi] and pages first_page ..; this warp's tiles: the split's pages
    // warp, warp + kWarps, ... (local index i).
    int union_lo, union_hi;
    key_union(tok_lo, tok_hi, b.ntok, union_lo, union_hi);
    int key_lo = union_lo, key_hi = union_hi, n_tiles = 0, first_page = 0;
    if (union_lo <= union_hi) {
        const int page_lo = union_lo / kKeys, pages = union_hi / kKeys - page_lo + 1;
        const int per_split = (pages + a.n_split - 1) / a.n_split;
        first_page = page_lo + split * per_split;
        n_tiles = max(0, min(per_split, pages - split * per_split));
        key_lo = max(union_lo, first_page * kKeys);
        key_hi = min(union_hi, (first_page + n_tiles) * kKeys - 1);
    }
    const int n_mine = n_tiles > warp ? (n_tiles - warp + kWarps - 1) / kWarps : 0;
    const int fresh_page = a.early_kv ? (b.kv_len - b.q_len) / kKeys : INT_MIN;  // pages from here on hold this forward's keys
    const int32_t* page_row = a.page_table + int64_t(b.seq) * a.max_pages;
    const auto tile_page = [&](int i) { return first_page + warp + i * kWarps; };
    const auto stage_of = [&](int i) { return smem + warp * L.warp_bytes + (i % kStages) * L.stage; };

    // Tile i: lane 0 copies its page (or, on a released page, the warp fills K with NaN and V
    // with zeros); with early loads the pages before fresh_page go before pdl_wait.
    auto issue_tile = [&](int i, int page) {
        unsigned char* stage = stage_of(i);
        uint64_t* bar = my_bars + i % kStages;
        fence_proxy_async();  // this stage's earlier ldmatrix reads and fills before the copies' writes
        __syncwarp();
        if (page >= 0) {
            if (lane == 0) {
                mbar_arrive_expect_tx(bar, unsigned(L.stage));
#pragma unroll
                for (int c = 0; c < kDk / kBoxCols; ++c) tma_load_4d(stage + c * kBoxBytes, &maps.k, c * kBoxCols, g, 0, page, bar);
#pragma unroll
                for (int c = 0; c < kDv / kBoxCols; ++c)
                    tma_load_4d(stage + L.v_stage + c * kBoxBytes, &maps.v, c * kBoxCols, g, 0, page, bar);
            }
        } else {
            auto* fill = reinterpret_cast<uint4*>(stage);
            for (int c = lane; c < L.stage / 16; c += 32) {
                const uint32_t x = c * 16 < L.v_stage ? 0x7fc07fc0u : 0u;  // bf16 NaN pairs in K
                fill[c] = make_uint4(x, x, x, x);
            }
            if (lane == 0) mbar_arrive_expect_tx(bar, 0);
        }
    };
    int first_pages[kStages];
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
        first_pages[i] = i < n_mine ? page_row[tile_page(i)] : 0;
        if (i < n_mine && tile_page(i) < fresh_page) issue_tile(i, first_pages[i]);
    }
    pdl_wait();
    pdl_launch_dependents();
#pragma unroll
    for (int i = 0; i < kStages; ++i)
        if (i < n_mine && tile_page(i) >= fresh_page) issue_tile(i, first_pages[i]);

    // Q rows as bf16 (rows past `rows` zero), then each warp's A fragments in registers.
    for (int i = tid; i < kTileRows * (kDk / 8); i += kThreads) {
        const int r = i / (kDk / 8), c = i % (kDk / 8);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < b.rows) {
            const int flat = int(b.row0) + r;
            const int64_t t = b.token_base + (flat / G - b.tok_first);
            v = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.q) +
                                                (t * a.nq + g * G + flat % G) * kDk + c * 8);
        }
        *reinterpret_cast<uint4*>(Qs + r * L.ldq + c * 8) = v;
    }
    __syncthreads();
    uint32_t qa[kDkSteps][4];
#pragma unroll
    for (int kk = 0; kk < kDkSteps; ++kk) ldmatrix_x4(qa[kk], Qs + (lane % 16) * L.ldq + kk * 16 + (lane / 16) * 8);

    // This thread's two rows (gid, gid + 8): visible keys within the split.
    int lo_r[2], hi_r[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) row_key_range(b, gid + 8 * h, G, tok_lo, tok_hi, key_lo, key_hi, lo_r[h], hi_r[h]);
    float o[kDv / 8][4];
#pragma unroll
    for (int j = 0; j < kDv / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
    // ldmatrix rows of this lane: K (non-transposed, keys (lane / 16)·8 + lane % 8, columns
    // +8 for lanes 8-15 and 24-31) and V (transposed, keys ((lane / 8) % 2)·8 + lane % 8, columns +8
    // for lanes 16-31).
    const int k_row = (lane / 16) * 8 + lane % 8, k_col = ((lane / 8) % 2) * 8;
    const int v_row = ((lane / 8) % 2) * 8 + lane % 8, v_col = (lane / 16) * 8;

    for (int i = 0; i < n_mine; ++i) {
        // The page this iteration's refill copies, requested now: its load is in flight during the
        // wait and the math (read at the refill, it stalled the warp there: 14% of the stall samples,
        // ncu, 32K keys).
        const bool refill = i + kStages < n_mine;
        const int refill_page = refill ? page_row[tile_page(i + kStages)] : 0;
        mbar_wait(my_bars + i % kStages, unsigned(i / kStages) & 1u);
        unsigned char* stage = stage_of(i);
        const int j0 = tile_page(i) * kKeys;
        // Edge tiles: zero the V rows of keys no token of the block sees (whatever their slots hold).
        if (j0 < union_lo || j0 + kKeys - 1 > union_hi) {
            if (lane < kKeys && (j0 + lane < union_lo || j0 + lane > union_hi))
#pragma unroll
                for (int c = 0; c < kDv; c += 8)
                    *reinterpret_cast<uint4*>(stage + L.v_stage + swizzled(lane, c)) = make_uint4(0, 0, 0, 0);
        }
        __syncwarp();
        bool any = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) any |= lo_r[h] <= j0 + kKeys - 1 && hi_r[h] >= j0 && lo_r[h] <= hi_r[h];
        if (__any_sync(0xffffffffu, any)) {
            // S[16 rows, 16 keys] = Q · Kᵀ (n-tile n: keys j0 + 8n ..), even and odd 16-column steps in
            // separate accumulators (two chains half as deep), summed after.
            float sc[2][4] = {}, sc_odd[2][4] = {};
#pragma unroll
            for (int kk = 0; kk < kDkSteps; ++kk) {
                uint32_t kb4[4];
                ldmatrix_x4(kb4, stage + swizzled(k_row, kk * 16 + k_col));
                float(&acc)[2][4] = kk % 2 == 0 ? sc : sc_odd;
                mma_bf16(acc[0], qa[kk], kb4[0], kb4[1]);
                mma_bf16(acc[1], qa[kk], kb4[2], kb4[3]);
            }
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[n][e] += sc_odd[n][e];
            // Scale to log2 units, mask (only tiles some row does not see whole), online softmax per row.
            bool whole = true;
#pragma unroll
            for (int h = 0; h < 2; ++h) whole &= lo_r[h] <= j0 && j0 + kKeys - 1 <= hi_r[h];
            whole = __all_sync(0xffffffffu, whole);
            float corr[2];
            online_softmax_step(sc, j0, tid4, a.scale_log2, whole, lo_r, hi_r, m_r, l_r, corr);
            rescale_rows(o, corr);
            // O[16 rows, dv] += P[16 rows, 16 keys] · V[16 keys, dv]; P from the S accumulators.
            const uint32_t pa[4] = {pack_bf16(sc[0][0], sc[0][1]), pack_bf16(sc[0][2], sc[0][3]),
                                    pack_bf16(sc[1][0], sc[1][1]), pack_bf16(sc[1][2], sc[1][3])};
#pragma unroll
            for (int jj = 0; jj < kDv / 16; ++jj) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, stage + L.v_stage + swizzled(v_row, jj * 16 + v_col));
                mma_bf16(o[2 * jj], pa, vb[0], vb[1]);
                mma_bf16(o[2 * jj + 1], pa, vb[2], vb[3]);
            }
        }
        // Refill this stage with the warp's tile i + kStages.
        if (refill) issue_tile(i + kStages, refill_page);
    }

    // Merge the warps' states per row and finish: normalise with the sink, or write partials.
    // Each warp's O goes to its own stages (its copies have all landed).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 1);
        l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 2);
    }
    static_assert(kTileRows * (kDv + 4) * 4 <= kStages * (kDk + kDv) * kKeys * 2, "a warp's O fits its stages");
    static_assert(kTileRows * kMaxDecodeSplits * 4 + kThreads * 16 <= L.q, "the in-kernel merge fits the stages");
    auto* Ow = reinterpret_cast<float*>(smem + warp * L.warp_bytes);  // [16][ldo]
#pragma unroll
    for (int j = 0; j < kDv / 8; ++j) {
        const int col = j * 8 + 2 * tid4;
        *reinterpret_cast<float2*>(Ow + gid * L.ldo + col) = make_float2(o[j][0], o[j][1]);
        *reinterpret_cast<float2*>(Ow + (gid + 8) * L.ldo + col) = make_float2(o[j][2], o[j][3]);
    }
    if (tid4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            ml_s[(warp * kTileRows + gid + 8 * h) * 2] = m_r[h];
            ml_s[(warp * kTileRows + gid + 8 * h) * 2 + 1] = l_r[h];
        }
    }
    __syncthreads();
    // Per row, by one thread: the warps' merge factors, then the row's scale (one split) or M, l.
    constexpr int kFac = kWarps + 2, kScale = kWarps;
    if (tid < b.rows) {
        float M = -INFINITY, l = 0.f;
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, ml_s[(w * kTileRows + tid) * 2]);
        for (int w = 0; w < kWarps; ++w) {
            const float m = ml_s[(w * kTileRows + tid) * 2];
            const float f = m == -INFINITY ? 0.f : exp2f(m - M);
            l += ml_s[(w * kTileRows + tid) * 2 + 1] * f;
            fac[tid * kFac + w] = f;
        }
        finish_row(a, g, b.row0 + tid, M, l, fac + tid * kFac + kScale);
    }
    __syncthreads();
    // A warp per row, each lane 4 adjacent columns.
    for (int r = warp; r < b.rows; r += kWarps) {
        const int64_t R = out_row(a, b, g, r);
        const float* f = fac + r * kFac;
        const int d = lane * 4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float4 v = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(smem + w * L.warp_bytes) +
                                                              r * L.ldo + d);
            acc.x += v.x * f[w];
            acc.y += v.y * f[w];
            acc.z += v.z * f[w];
            acc.w += v.w * f[w];
        }
        const int64_t P = int64_t(split) * a.T * a.nq + R;  // partial row (n_split > 1)
        store_out4(a, R, P, kDv, d, acc, f[kScale]);
        if (a.n_split > 1 && lane == 0) {
            a.part_ml[P * 2] = f[kScale];
            a.part_ml[P * 2 + 1] = f[kScale + 1];
        }
    }
    if (merge_counters)
        merge_splits_in_kernel<kDv, kThreads>(a, b, g, split,
                                              merge_counters + 2 * (int64_t(blockIdx.y) * gridDim.x + blockIdx.x), smem);
}

// ---- host ---------------------------------------------------------------------------------------------

// Warps per block (XINFER_CUDA_ATTN_STREAM: "0" = off, "4" or "8" = that many, A/B; default: 8
// when the batch's (row tile, KV head) blocks fit one wave of 8-warp blocks (one per SM), else 4
// (two per SM). Both give 8 warps per SM, each with two pages in flight; the choice is the block
// granularity. Measured on H200 (ops-test --perf, µs, 4 / 8 warps): batch-1 32K keys 32.4 / 30.1,
// 32 × 8K 178 / 176, serving 32 × 640 keys 23.8 / 17.0 (one split instead of two: no combine),
// serving 64 × 640 30.7 / 33.7 (one wave instead of two), sliding serving 64 17.8 / 28.4.
int stream_warps_setting() {
    static const int setting = [] {
        const char* v = std::getenv("XINFER_CUDA_ATTN_STREAM");
        if (!v || !*v) return -1;
        if (std::strcmp(v, "0") == 0 || std::strcmp(v, "4") == 0 || std::strcmp(v, "8") == 0) return std::atoi(v);
        std::fprintf(stderr, "xinfer cuda: XINFER_CUDA_ATTN_STREAM=%s is not one of 0, 4, 8; using the default\n", v);
        return -1;
    }();
    return setting;
}

// One cache's tensor map: [pages][16 slots][n_kv][d] bf16, pages page_stride elements apart.
// L2 promotion to 128 bytes, a box row's size: MiMo's K rows are 384 bytes a head, so a 256-byte
// promotion fetched 128 bytes of the next head with every third box row (H200, ops-test --perf:
// 32 × 8K keys 171 → 159 µs, 93 → 100% of copy; 32K keys 30.0 → 29.2 µs; 64 bytes and none as 128).
bool encode_page_map(CUtensorMap* map, const void* cache, int64_t pages, int nkv, int d, int64_t page_stride) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (!encode) return false;
    const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(nkv), cuuint64_t(kKeys), cuuint64_t(pages)};
    const cuuint64_t strides[3] = {cuuint64_t(d) * 2, cuuint64_t(nkv) * d * 2, cuuint64_t(page_stride) * 2};
    const cuuint32_t box[4] = {kBoxCols, 1, kKeys, 1}, element_strides[4] = {1, 1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(cache), dims, strides, box,
                  element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Splits of each (row tile, KV head) block's keys: the fewest that fill the GPU's block slots to
// 90% in whole waves (each block pays its prologue and epilogue once), each split at least two
// pages per warp, at most kMaxDecodeSplits. Short key ranges (a sliding window) stay in one
// block: no partials, no combine launch.
constexpr int64_t kOneSplitKeys = 3 * 64;
int stream_splits(int64_t est_blocks, int64_t slots, int64_t key_span, int warps) {
    if (key_span <= kOneSplitKeys) return 1;
    const int64_t most = std::clamp<int64_t>(ceil_div(key_span, int64_t(2 * warps * kKeys)), 1, kMaxDecodeSplits);
    int best = 1;
    double best_fill = 0;
    for (int64_t s = 1; s <= most; ++s) {
        const int64_t blocks = est_blocks * s;
        const double fill = double(blocks) / double(ceil_div(blocks, slots) * slots);
        if (fill >= 0.9) return int(s);
        if (fill > best_fill) best_fill = fill, best = int(s);
    }
    return best;
}

// XINFER_CUDA_ATTN_SPLIT_MERGE=0: the combine kernel merges every split launch (A/B of the
// in-kernel merge).
bool split_merge_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_ATTN_SPLIT_MERGE", true);
    return enabled;
}

// Row tiles that hold rows, at most (the grid's x is a looser bound): a sequence of q_len ≥ 1
// rows has ceil(q_len · G / 16) ≤ (q_len · G + 15) / 16 of them (an empty one none), and at most
// min(n_seqs, T) sequences are not empty.
int64_t real_row_tiles(int64_t T, int64_t n_seqs, int G) {
    return (T * G + (kTileRows - 1) * std::min(n_seqs, T)) / kTileRows;
}

struct StreamLaunch {
    int64_t key_span, est_blocks, row_tiles;
    const PageMaps* maps;
    bool* merged;
};

template <int kDk, int kDv, int kWarps, int kStages>
int launch_stream(Context* c, DecodeArgs& a, const StreamLaunch& s) {
    constexpr StreamSmem L = stream_smem<kDk, kDv, kWarps, kStages>();
    const auto kernel = attention_stream_kernel<kDk, kDv, kWarps, kStages>;
    if (size_t(L.total) > c->smem_optin) return XINFER_UNSUPPORTED;
    XCUDA_TRY(c, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L.total));
    static int blocks_per_sm = 0;  // per instance: the same on every device of a process's kind
    if (blocks_per_sm == 0)
        XCUDA_TRY(c, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kWarps * 32, L.total));
    if (blocks_per_sm == 0) return XINFER_UNSUPPORTED;
    a.n_split = stream_splits(s.est_blocks, int64_t(blocks_per_sm) * c->sm_count, s.key_span, kWarps);
    // A/B of the split rule, where it applies (not to a sliding window's one split).
    static const int64_t forced = env_int("XINFER_CUDA_ATTN_STREAM_SPLITS", 0);
    if (forced > 0 && s.key_span > kOneSplitKeys) a.n_split = int(std::min<int64_t>(forced, kMaxDecodeSplits));
    if (int rc = decode_partials(c, a)) return rc;
    // The splits merge in the kernel (no combine launch) when every real block fits at once.
    const int64_t real_blocks = std::min(s.row_tiles, real_row_tiles(a.T, a.n_seqs, a.group)) * a.nkv * a.n_split;
    int* merge_counters = nullptr;
    if (a.n_split > 1 && split_merge_enabled() && s.row_tiles * a.nkv <= kMaxSplitGroups &&
        real_blocks <= int64_t(blocks_per_sm) * c->sm_count)
        merge_counters = c->arrivals + kSplitArrivals;
    *s.merged = merge_counters != nullptr;
    const dim3 grid{unsigned(s.row_tiles), unsigned(a.nkv), unsigned(a.n_split)};
    return launch_pdl(c, "attention_stream_kernel", kernel, grid, dim3(kWarps * 32), size_t(L.total), a, *s.maps,
                      merge_counters);
}

template <int kDk, int kDv>
int launch_stream_warps(Context* c, DecodeArgs& a, const StreamLaunch& s) {
    int warps = stream_warps_setting();
    if (warps < 0) warps = s.est_blocks <= c->sm_count ? 8 : 4;
    return warps == 8 ? launch_stream<kDk, kDv, 8, 2>(c, a, s) : launch_stream<kDk, kDv, 4, 2>(c, a, s);
}

}  // namespace

int attention_stream(Context* c, DecodeArgs& a, int64_t cache_pages, int64_t key_span, int64_t est_blocks,
                     int64_t row_tiles, bool* merged) {
    *merged = false;
    if (a.tile_rows != kTileRows || a.page_size != kKeys || cache_pages <= 0 || cache_pages > INT_MAX ||
        stream_warps_setting() == 0)
        return XINFER_UNSUPPORTED;
    const bool mimo = a.dk == 192 && a.dv == 128, qwen = a.dk == 128 && a.dv == 128;
    if (!mimo && !qwen) return XINFER_UNSUPPORTED;
    PageMaps maps;
    if (!encode_page_map(&maps.k, a.k_cache, cache_pages, a.nkv, a.dk, a.k_page_stride) ||
        !encode_page_map(&maps.v, a.v_cache, cache_pages, a.nkv, a.dv, a.v_page_stride))
        return XINFER_UNSUPPORTED;
    const StreamLaunch s{key_span, est_blocks, row_tiles, &maps, merged};
    return mimo ? launch_stream_warps<192, 128>(c, a, s) : launch_stream_warps<128, 128>(c, a, s);
}

}  // namespace xcuda
