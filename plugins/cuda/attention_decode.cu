// Split-KV ("flash-decoding") ATTENTION: built for few query tokens per sequence (decode, speculative
// verification up to 32, DFlash blocks) and, since it also beats the older 64×32 wmma flash kernel
// of attention.cu on prefill (H200, MiMo shapes, 4,096 tokens: full layer 20.9 → 3.7 ms, sliding
// 2.5 → 0.8 ms), the kernel for every bf16/f32/f16 cache with dk ≤ 256 and dv ≤ 128 — except long
// bf16 query tiles with MiMo's or Qwen3's head dims, which attention_decode() hands to the wgmma
// prefill kernel (attention_prefill.cu; the same full layer in 0.82 ms) and decode-shaped batches
// of those heads over 16-token pages, which it hands to the per-warp key streams of
// attention_stream.cu (batch-1 decode over 32K keys 36.0 → 30.0 µs). attention.cu keeps its flash
// kernel for FP8 caches and wider heads.
//
// Why a separate kernel. Decode is a stream over the KV cache: for one KV head the G = n_q/n_kv
// query heads of a token read the same keys, so each key must be loaded once per (token tile,
// KV head) and the loads must keep enough bytes in flight to cover HBM latency. Here:
//   - a block owns up to 64 query rows (row = token·G + head, token-major, as attention.cu) of
//     one sequence and one KV head, and one of n_split contiguous chunks of their key range;
//   - K/V tiles of 64 keys go global → shared with 16-byte cp.async, double-buffered, so the
//     next tile is in flight while the current one is used;
//   - each warp owns 16 rows and computes S = Q·Kᵀ and O += P·V with mma.sync m16n8k16 (bf16 in,
//     f32 accumulation); scores, softmax state and the O accumulator stay in registers (P is
//     reused from the S accumulators as the A operand, as FlashAttention-2 does);
//   - with fewer than 64 rows (decode: G = 8 or 16 rows) the idle warps split the tile's keys
//     instead, and the block merges the warps' (m, l, O) at the end; decode-shaped batches take
//     16-row tiles on 8-warp blocks, each warp 8 keys of every tile (see the kernel);
//   - n_split > 1 writes unnormalised partials (m, l in log2 units, O) that a combine kernel
//     merges with the sink. n_split is chosen on the host from upper bounds only (T, n_seqs,
//     max_pages · page_size), never from device values, so a captured graph stays valid.
//
// Masking is the CPU reference's (src/backend/cpu/attention.cpp): query at position p sees keys
// [lo, hi], hi = min(kv_len - 1, p) when causal, lo = p - window + 1 with a window (non-causal:
// hi = p + window - 1). A key is loaded only if some token of the block may see it, so released
// pages (-1) and unwritten slots are never read; a key some token needs whose page is -1 is
// loaded as NaN (the CPU reference raises an error there). Sinks enter as one extra logit per
// head in the units of the scaled scores.
//
// Caches: bf16 rows with 16-byte alignment take the cp.async path; f32/f16 (tests, f32
// checkpoints) and odd head dims are converted element by element into the same bf16 tiles.
// FP8 caches are left to attention.cu (its flash kernel dequantizes them).
#include "attention_common.cuh"
#include "attention_tiles.cuh"
#include "common.h"
#include "device_utils.cuh"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace xcuda {
namespace {

constexpr int kRows = 64;       // query rows per block: 4 warps × 16
constexpr int kTileKeys = 64;   // keys per shared-memory tile
constexpr int kMaxWarps = 8;    // blocks have 4 warps, or 8 for 16-row tiles (see the kernel)
constexpr int kMaxDv = 128;     // O lives in registers: dv_pad / 8 n-tiles of 4 floats
constexpr int kMaxDk = 256;

// Shared memory (bytes): Q [64][ldk], two stages of K [64][ldk] and V [64][ldv] (bf16; rows
// padded by 8 elements so ldmatrix's 8 row addresses fall in different banks), token ranges.
// After the key loop the K/V region holds each warp's O [warps][16][dv_pad + 4] f32 and the
// per-row merge factors [64][kFactors] (with 8 warps and dk = dv = 128 that is more than the
// two stages, hence the max).
constexpr int kFactors = kMaxWarps + 2;  // a factor per key part, then the scale (or M and l)
struct DecodeSmem {
    int ldk, ldv, ldo, q, kv, k_stage, v_stage, stage, factors, ml, lo, hi, total;
};
__host__ __device__ inline DecodeSmem decode_smem(int dk_pad, int dv_pad, int warps) {
    DecodeSmem L;
    L.ldk = dk_pad + 8;
    L.ldv = dv_pad + 8;
    L.ldo = dv_pad + 4;
    L.q = 0;
    L.kv = kRows * L.ldk * 2;
    L.k_stage = 0;                         // offsets inside one stage
    L.v_stage = kTileKeys * L.ldk * 2;
    L.stage = L.v_stage + kTileKeys * L.ldv * 2;
    L.factors = warps * 16 * L.ldo * 4;    // offset inside the K/V region, after the warps' O
    const int kv_bytes = std::max(2 * L.stage, L.factors + kRows * kFactors * 4);
    L.ml = L.kv + kv_bytes;                // [warps][16 rows][2]
    L.lo = L.ml + warps * 16 * 2 * 4;      // [64] first visible key per token of the block
    L.hi = L.lo + kRows * 4;               // [64] last visible key
    L.total = L.hi + kRows * 4;
    return L;
}

// Which rows of a tile issue_tile copies: all of them, or (early K/V loads) the part that may be
// read before pdl_wait and then the rest.
enum TileRows { kAllRows, kOlderKeys, kFreshKeys };

// kBf16: q, caches and out are bf16 with 16-byte rows (the model's case), fixed at compile time so
// the element-by-element conversion paths drop out of the code a block runs once (at batch 1 a
// block handles one or two key tiles; session 10 found such launches dominated by instruction
// fetch in rope_kv_store and rmsnorm).
//
// kWarps = 8 is the instance for 16-row tiles (decode, short verification): the tile's 64 keys are
// cut into 8 parts of 8 keys instead of 4 of 16, so twice the warps share a tile and each walks
// half as long a chain of dependent instructions per tile. ncu (H200, 4 warps) found these blocks
// issuing an instruction every ~6 cycles per warp with 2 warps per scheduler, mostly waiting on
// fixed-latency dependencies: a latency chain, which more warps per SM overlap.
template <bool kBf16, int kWarps, int kDk = 0, int kDv = 0>
__global__ void __launch_bounds__(kWarps * 32, 2) attention_decode_kernel(DecodeArgs a) {
    // kDk, kDv > 0 (multiples of 16, bf16 only): the head dims fixed at compile time, so the
    // loader, the mma loops and the shared-memory layout unroll with constant offsets. ncu (H200,
    // 32K keys, runtime dims): 7,700 instructions per warp, a fifth of them IMAD and an eighth
    // ISETP - address and loop arithmetic - against 4% HMMA.
    static_assert((kDk == 0) == (kDv == 0) && kDk % 16 == 0 && kDv % 16 == 0 && (kDk == 0 || kBf16));
    const int dk = kDk > 0 ? kDk : a.dk, dv = kDv > 0 ? kDv : a.dv;
    const int dk_pad = kDk > 0 ? kDk : a.dk_pad, dv_pad = kDv > 0 ? kDv : a.dv_pad;
    constexpr int kThreads = kWarps * 32;
    constexpr int kStep = kWarps == 8 ? 8 : 16;     // keys per mma step of a warp
    constexpr int kPasses = kTileKeys * 4 / kThreads;  // loader: 4 threads per key row
    if constexpr (kBf16) {
        a.q_dtype = a.k_dtype = a.v_dtype = a.out_dtype = XINFER_DTYPE_BF16;
        a.q_vec = a.k_vec = a.v_vec = true;
    }
    extern __shared__ __align__(128) unsigned char smem[];
    // Everything up to pdl_wait reads only what no op of this forward writes: the batch metadata
    // (uploaded by the host) and, with early_kv, the cache rows of keys before the sequence's own
    // tokens (stored by earlier forwards; this forward's KV_STORE, the op just before, writes
    // only keys kv_len - q_len and on, see backend_abi.h). So the first two K/V tiles are in
    // flight while the previous kernel finishes, and a decode block's latency chain after the
    // wait is q, the newest keys, the math.
    if (!a.early_kv) pdl_wait();
    const DecodeSmem L = decode_smem(dk_pad, dv_pad, kWarps);
    auto* Qs = reinterpret_cast<__nv_bfloat16*>(smem + L.q);
    auto* ml_s = reinterpret_cast<float*>(smem + L.ml);
    auto* tok_lo = reinterpret_cast<int*>(smem + L.lo);
    auto* tok_hi = reinterpret_cast<int*>(smem + L.hi);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tid4 = lane % 4;
    const int g = blockIdx.y, split = blockIdx.z, G = a.group;

    // Which sequence and which ≤64 of its rows this block owns (the same answer in every thread;
    // blocks past the last row tile exit: the grid is sized by an upper bound).
    // Last row tiles first: in a causal prefill they see the most keys, so the long blocks start
    // in the first wave and the short ones fill the tail.
    const BlockRows b = block_rows(find_row_tile(a.cu_q_lens, a.n_seqs, G, a.tile_rows, gridDim.x - 1 - blockIdx.x),
                                   a.tile_rows, G, a.cu_q_lens, a.kv_lens);
    if (b.seq < 0) return;
    const int s = b.seq, qlen = b.q_len, rows = b.rows, tok_first = b.tok_first, ntok = b.ntok;
    const int token_base = b.token_base, kv_len = b.kv_len;  // token_base: the block's first token in the batch
    const int64_t row0 = b.row0;
    store_token_ranges(b, a.positions, a.causal, a.window, kThreads, tok_lo, tok_hi);
    __syncthreads();

    // The block's key range: the union of its tokens' ranges, then this split's chunk of it
    // (whole 64-key tiles, so splits never share a tile).
    int key_lo, key_hi;
    key_union(tok_lo, tok_hi, ntok, key_lo, key_hi);
    if (key_lo <= key_hi && a.n_split > 1) {
        const int len = key_hi - key_lo + 1;
        const int chunk = ((len + a.n_split - 1) / a.n_split + kTileKeys - 1) / kTileKeys * kTileKeys;
        const int my_lo = key_lo + split * chunk;
        key_hi = min(key_hi, my_lo + chunk - 1);
        key_lo = my_lo;
    }
    const int n_tiles = key_lo <= key_hi ? (key_hi - key_lo + kTileKeys) / kTileKeys : 0;
    // Keys from fresh_lo on are this forward's (written by the KV_STORE just before): read after
    // pdl_wait. Without early loads every key counts as fresh.
    const int fresh_lo = a.early_kv ? kv_len - qlen : INT_MIN;

    // A key's logical page: a shift for the usual power-of-two page sizes (a division by a runtime
    // value is ~20 dependent instructions, and the loader needs two per key row per tile).
    const auto page_of = [&](int j) { return a.page_shift >= 0 ? j >> a.page_shift : j / a.page_size; };
    const int32_t* page_row = a.page_table + int64_t(s) * a.max_pages;
    // Loader: thread → (key kk = pass·kThreads/4 + tid/4, a quarter of its 16-byte chunks). The page
    // numbers of a tile are read one tile ahead of its copies (fetch_pages, then issue_tile an
    // iteration later), so the page-table latency never sits between two tiles' copies.
    constexpr int kNotNeeded = INT_MIN;
    auto fetch_pages = [&](int kb, int (&page)[kPasses]) {
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int j = kb + pass * (kThreads / 4) + tid / 4;
            bool needed = false;
            if (j <= key_hi)
                for (int i = 0; i < ntok && !needed; ++i) needed = j >= tok_lo[i] && j <= tok_hi[i];
            page[pass] = needed ? page_row[page_of(j)] : kNotNeeded;
        }
    };
    // Rows of keys nobody needs are zeroed and rows on released pages NaN-filled with the older
    // keys (neither reads the cache); kFreshKeys copies the remaining rows from fresh_lo on.
    auto issue_tile = [&](int stage, int kb, const int (&page)[kPasses], TileRows which) {
        auto* Ks = reinterpret_cast<__nv_bfloat16*>(smem + L.kv + stage * L.stage + L.k_stage);
        auto* Vs = reinterpret_cast<__nv_bfloat16*>(smem + L.kv + stage * L.stage + L.v_stage);
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int kk = pass * (kThreads / 4) + tid / 4, j = kb + kk;
            const bool copied = page[pass] != kNotNeeded && page[pass] >= 0;
            if (which == kOlderKeys && copied && j >= fresh_lo) continue;
            if (which == kFreshKeys && !(copied && j >= fresh_lo)) continue;
            int64_t ks = kZero, vs = kZero;
            if (page[pass] != kNotNeeded) {
                if (page[pass] < 0) {
                    ks = kNaN;
                } else {
                    const int64_t slot_row = int64_t(j - page_of(j) * a.page_size) * a.nkv + g;
                    ks = int64_t(page[pass]) * a.k_page_stride + slot_row * dk;
                    vs = int64_t(page[pass]) * a.v_page_stride + slot_row * dv;
                }
            }
            if constexpr (kDk > 0) {  // (bf16 rows with 16-byte chunks: one branch per row)
                copy_row_part<kDk>(Ks + kk * L.ldk, static_cast<const __nv_bfloat16*>(a.k_cache), ks, tid % 4);
                copy_row_part<kDv>(Vs + kk * L.ldv, static_cast<const __nv_bfloat16*>(a.v_cache), vs, tid % 4);
            } else {
                fill_row_part(Ks + kk * L.ldk, a.k_cache, a.k_dtype, ks, dk, dk_pad, a.k_vec, tid % 4);
                fill_row_part(Vs + kk * L.ldv, a.v_cache, a.v_dtype, vs, dv, dv_pad, a.v_vec, tid % 4);
            }
        }
    };
    // The first two tiles (both stages): their older keys now, the fresh ones after the wait.
    const int n_first = min(n_tiles, 2);
    int first_pages[2][kPasses];
#pragma unroll
    for (int u = 0; u < 2; ++u)
        if (u < n_first) {
            fetch_pages(key_lo + u * kTileKeys, first_pages[u]);
            issue_tile(u, key_lo + u * kTileKeys, first_pages[u], kOlderKeys);
        }
    cp_async_commit();
    pdl_wait();
    pdl_launch_dependents();
#pragma unroll
    for (int u = 0; u < 2; ++u)
        if (u < n_first) issue_tile(u, key_lo + u * kTileKeys, first_pages[u], kFreshKeys);
    cp_async_commit();
    // Q rows as bf16, zero-padded to dk_pad; rows past `rows` up to the last 16-row group that
    // ldmatrix reads are zero. A decode block runs this prologue with one warp per scheduler, so
    // every instruction here is latency: bf16 rows go in 16-byte loads, kQLoads of them issued by
    // each thread before its first store. (One row per warp at a time, a load-store chain per
    // row, cost ~0.5 µs per row: a 64-row verify block spent ~8 µs here; ncu, H200.)
    const int q_rows = (rows + 15) / 16 * 16;
    const auto q_offset = [&](int r) {  // element offset of block row r's q vector
        const int flat = int(row0) + r;  // < q_len · G, an int (see `rows`); 32-bit division is ~5× cheaper
        const int64_t t = token_base + (flat / G - tok_first);
        return (t * a.nq + g * G + flat % G) * dk;
    };
    if (a.q_vec) {
        constexpr int kQLoads = 8;
        const int per_row = dk_pad / 8, n = q_rows * per_row;
        for (int first = 0; first < n; first += kThreads * kQLoads) {
            uint4 v[kQLoads];
#pragma unroll
            for (int u = 0; u < kQLoads; ++u) {
                const int i = first + u * kThreads + tid, r = i / per_row, c = i % per_row;
                v[u] = make_uint4(0, 0, 0, 0);
                if (i < n && r < rows && c * 8 < dk)
                    v[u] = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.q) + q_offset(r) + c * 8);
            }
#pragma unroll
            for (int u = 0; u < kQLoads; ++u) {
                const int i = first + u * kThreads + tid;
                if (i < n) *reinterpret_cast<uint4*>(Qs + (i / per_row) * L.ldk + (i % per_row) * 8) = v[u];
            }
        }
    }
    for (int r = warp; !a.q_vec && r < q_rows; r += kWarps) {  // f32 / f16 / unaligned q: element by element
        const int64_t base = r < rows ? q_offset(r) : -1;
        for (int d = lane; d < dk_pad; d += 32)
            Qs[r * L.ldk + d] = __float2bfloat16_rn(base >= 0 && d < dk ? load_f(a.q, a.q_dtype, base + d) : 0.f);
    }
    __syncthreads();

    // Warp roles: n_rg groups of 16 rows; with fewer than 4 groups the spare warps take other
    // keys of the same tile (kp parts of 64/kp keys). The 8-warp instance only gets 16-row tiles
    // (n_rg = 1): 8 parts of 8 keys.
    const int n_rg = (rows + 15) / 16;
    const int kp = kWarps == 8 ? 8 : n_rg == 1 ? 4 : n_rg == 2 ? 2 : 1;
    const int rg = warp % n_rg, part = warp / n_rg;
    const bool active = part < kp;
    const int part_keys = kTileKeys / kp;

    // This thread's two rows (gid, gid + 8 of the warp's group): visible keys within the split.
    int lo_r[2], hi_r[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) row_key_range(b, rg * 16 + gid + 8 * h, G, tok_lo, tok_hi, key_lo, key_hi, lo_r[h], hi_r[h]);

    float o[kMaxDv / 8][4];
#pragma unroll
    for (int j = 0; j < kMaxDv / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
    const int dk_steps = dk_pad / 16, dv_steps = dv_pad / 16;

    int next_pages[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) next_pages[pass] = kNotNeeded;
    if (n_tiles > 2) fetch_pages(key_lo + 2 * kTileKeys, next_pages);
    // Tiles 0 and 1 are in flight; from t = 1 on, tile t + 1 is issued while tile t is used.
    for (int t = 0; t < n_tiles; ++t) {
        if (t >= 1 && t + 1 < n_tiles) {
            issue_tile((t + 1) & 1, key_lo + (t + 1) * kTileKeys, next_pages, kAllRows);
            cp_async_commit();
            if (t + 2 < n_tiles) fetch_pages(key_lo + (t + 2) * kTileKeys, next_pages);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const auto* Ks = reinterpret_cast<const __nv_bfloat16*>(smem + L.kv + (t & 1) * L.stage + L.k_stage);
        const auto* Vs = reinterpret_cast<const __nv_bfloat16*>(smem + L.kv + (t & 1) * L.stage + L.v_stage);
        const int kb = key_lo + t * kTileKeys;
        if (active) {
            for (int k0 = part * part_keys; k0 < (part + 1) * part_keys; k0 += kStep) {
                const int j0 = kb + k0;
                // Skip steps no row of this warp can see (past the end, or before a window).
                bool any = false;
#pragma unroll
                for (int h = 0; h < 2; ++h) any |= lo_r[h] <= j0 + kStep - 1 && hi_r[h] >= j0 && lo_r[h] <= hi_r[h];
                if (!__any_sync(0xffffffffu, any)) continue;

                // S[16 rows, kStep keys] = Q · Kᵀ: n-tile n holds keys j0 + 8n .. j0 + 8n + 7.
                constexpr int kN = kStep / 8;
                float sc[kN][4] = {};
                if constexpr (kStep == 16) {
                    for (int kk = 0; kk < dk_steps; ++kk) {
                        uint32_t qa[4], kb4[4];
                        ldmatrix_x4(qa, Qs + (rg * 16 + lane % 16) * L.ldk + kk * 16 + (lane / 16) * 8);
                        ldmatrix_x4(kb4, Ks + (k0 + (lane / 16) * 8 + lane % 8) * L.ldk + kk * 16 + ((lane / 8) % 2) * 8);
                        mma_bf16(sc[0], qa, kb4[0], kb4[1]);
                        mma_bf16(sc[1], qa, kb4[2], kb4[3]);
                    }
                } else {
                    // 8 keys: one ldmatrix gives their B fragments for two 16-dim steps, which
                    // accumulate into two chains (half as deep) summed at the end.
                    float sc2[4] = {};
                    int kk = 0;
                    for (; kk + 1 < dk_steps; kk += 2) {
                        uint32_t qa[4], qa2[4], kb4[4];
                        ldmatrix_x4(qa, Qs + (lane % 16) * L.ldk + kk * 16 + (lane / 16) * 8);
                        ldmatrix_x4(qa2, Qs + (lane % 16) * L.ldk + (kk + 1) * 16 + (lane / 16) * 8);
                        ldmatrix_x4(kb4, Ks + (k0 + lane % 8) * L.ldk + kk * 16 + (lane / 8) * 8);
                        mma_bf16(sc[0], qa, kb4[0], kb4[1]);
                        mma_bf16(sc2, qa2, kb4[2], kb4[3]);
                    }
                    if (kk < dk_steps) {
                        uint32_t qa[4], kb2[2];
                        ldmatrix_x4(qa, Qs + (lane % 16) * L.ldk + kk * 16 + (lane / 16) * 8);
                        ldmatrix_x2(kb2, Ks + (k0 + lane % 8) * L.ldk + kk * 16 + ((lane / 8) % 2) * 8);
                        mma_bf16(sc[0], qa, kb2[0], kb2[1]);
                    }
#pragma unroll
                    for (int e = 0; e < 4; ++e) sc[0][e] += sc2[e];
                }
                // Scale to log2 units, mask, online softmax per row. Steps whose keys every row of
                // the warp sees (all but a row's first and last steps) skip the per-score mask.
                bool whole = true;
#pragma unroll
                for (int h = 0; h < 2; ++h) whole &= lo_r[h] <= j0 && j0 + kStep - 1 <= hi_r[h];
                whole = __all_sync(0xffffffffu, whole);
                float corr[2];
                online_softmax_step(sc, j0, tid4, a.scale_log2, whole, lo_r, hi_r, m_r, l_r, corr);
                rescale_rows(o, corr);
                // O[16 rows, dv] += P[16 rows, kStep keys] · V[kStep keys, dv]; P from the S
                // accumulators (an m16n8 accumulator pair is the A fragment of the next mma).
                if constexpr (kStep == 16) {
                    const uint32_t pa[4] = {pack_bf16(sc[0][0], sc[0][1]), pack_bf16(sc[0][2], sc[0][3]),
                                            pack_bf16(sc[1][0], sc[1][1]), pack_bf16(sc[1][2], sc[1][3])};
#pragma unroll
                    for (int jj = 0; jj < kMaxDv / 16; ++jj) {
                        if (jj >= dv_steps) break;
                        uint32_t vb[4];
                        ldmatrix_x4_trans(vb, Vs + (k0 + ((lane / 8) % 2) * 8 + lane % 8) * L.ldv + jj * 16 + (lane / 16) * 8);
                        mma_bf16(o[2 * jj], pa, vb[0], vb[1]);
                        mma_bf16(o[2 * jj + 1], pa, vb[2], vb[3]);
                    }
                } else {
                    const uint32_t pa0 = pack_bf16(sc[0][0], sc[0][1]), pa1 = pack_bf16(sc[0][2], sc[0][3]);
                    // One transposed ldmatrix: the 8 keys' B fragments of four 8-column n-tiles.
#pragma unroll
                    for (int jq = 0; jq < kMaxDv / 32; ++jq) {
                        if (jq * 2 >= dv_steps) break;
                        if (jq * 2 + 1 < dv_steps) {
                            uint32_t vb[4];
                            ldmatrix_x4_trans(vb, Vs + (k0 + lane % 8) * L.ldv + jq * 32 + (lane / 8) * 8);
#pragma unroll
                            for (int i = 0; i < 4; ++i) mma_bf16_k8(o[4 * jq + i], pa0, pa1, vb[i]);
                        } else {
                            uint32_t vb[2];
                            ldmatrix_x2_trans(vb, Vs + (k0 + lane % 8) * L.ldv + jq * 32 + ((lane / 8) % 2) * 8);
                            mma_bf16_k8(o[4 * jq], pa0, pa1, vb[0]);
                            mma_bf16_k8(o[4 * jq + 1], pa0, pa1, vb[1]);
                        }
                    }
                }
            }
        }
        __syncthreads();  // this stage is refilled by the next iteration's prefetch
    }

    // Merge the warps' states per row and finish: normalise with the sink, or write partials.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 1);
        l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 2);
    }
    const int ldo = L.ldo;
    auto* Ow = reinterpret_cast<float*>(smem + L.kv);  // [kWarps][16][ldo]
    if (active) {
        float* base = Ow + warp * 16 * ldo;
#pragma unroll
        for (int jj = 0; jj < kMaxDv / 16; ++jj) {
            if (jj >= dv_steps) break;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int col = (2 * jj + half) * 8 + 2 * tid4;
                base[gid * ldo + col] = o[2 * jj + half][0];
                base[gid * ldo + col + 1] = o[2 * jj + half][1];
                base[(gid + 8) * ldo + col] = o[2 * jj + half][2];
                base[(gid + 8) * ldo + col + 1] = o[2 * jj + half][3];
            }
        }
        if (tid4 == 0) {
            ml_s[(warp * 16 + gid) * 2] = m_r[0];
            ml_s[(warp * 16 + gid) * 2 + 1] = l_r[0];
            ml_s[(warp * 16 + gid + 8) * 2] = m_r[1];
            ml_s[(warp * 16 + gid + 8) * 2 + 1] = l_r[1];
        }
    }
    __syncthreads();
    // Per row: the kp warps' merge factors and the row's final scale (or M and l of a split),
    // computed once by one thread; they sit after the warps' O (decode_smem).
    constexpr int kScale = kMaxWarps;  // fac[r]: kp merge factors, then at kScale the scale (or M, l)
    auto* fac = reinterpret_cast<float*>(smem + L.kv + L.factors);  // [64][kFactors]
    if (tid < rows) {
        const int grp = tid / 16, rr = tid % 16;
        float M = -INFINITY, l = 0.f;
        for (int p = 0; p < kp; ++p) M = fmaxf(M, ml_s[((p * n_rg + grp) * 16 + rr) * 2]);
        for (int p = 0; p < kp; ++p) {
            const int w = p * n_rg + grp;
            const float m = ml_s[(w * 16 + rr) * 2];
            const float f = m == -INFINITY ? 0.f : exp2f(m - M);
            l += ml_s[(w * 16 + rr) * 2 + 1] * f;
            fac[tid * kFactors + p] = f;
        }
        finish_row(a, g, row0 + tid, M, l, fac + tid * kFactors + kScale);
    }
    __syncthreads();
    // A warp per row, lanes over dv: the row's indices are computed once per row, not per element
    // (runtime divisions cost ~20 instructions each, and per element they were a large share of a
    // decode block's instructions).
    for (int r = warp; r < rows; r += kWarps) {
        const int grp = r / 16, rr = r % 16;
        const int64_t flat = row0 + r;
        const int64_t t = token_base + (flat / G - tok_first);
        const int64_t R = t * a.nq + g * G + int(flat % G);
        const float* f = fac + r * kFactors;
        const int64_t P = int64_t(split) * a.T * a.nq + R;  // partial row (n_split > 1)
        if constexpr (kDv == 4 * 32) {  // fixed dims (bf16 out): a lane's 4 adjacent columns, 16-byte loads
            const int d = lane * 4;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int p = 0; p < kp; ++p) {
                const float4 o = *reinterpret_cast<const float4*>(Ow + ((p * n_rg + grp) * 16 + rr) * ldo + d);
                acc.x += o.x * f[p];
                acc.y += o.y * f[p];
                acc.z += o.z * f[p];
                acc.w += o.w * f[p];
            }
            store_out4(a, R, P, dv, d, acc, f[kScale]);
        } else {
            for (int d = lane; d < dv; d += 32) {
                float acc = 0.f;
                for (int p = 0; p < kp; ++p) acc += Ow[((p * n_rg + grp) * 16 + rr) * ldo + d] * f[p];
                if (a.n_split == 1) store_f(a.out, a.out_dtype, R * dv + d, acc * f[kScale]);
                else a.part_o[P * dv + d] = acc;
            }
        }
        if (a.n_split > 1 && lane == 0) {
            a.part_ml[P * 2] = f[kScale];
            a.part_ml[P * 2 + 1] = f[kScale + 1];
        }
    }
}

// One block of min(n_split, kCombineWarps) warps per (token, head) row R: merges the n_split partials
// (max in log2 units) and the sink. Every load is issued before any is used - warp w holds the
// partial rows of splits w, w + warps, ... (kPerWarp of them at most), lane l their columns
// 4l..4l+3, while warp 0 reads every split's (m, l) and turns them into weights - so the merge
// costs about one round trip to L2. (A thread per column walking the splits in turn paid a round
// trip per split and per pass: at 32K keys, 64 splits, 75 µs of attention became 41 µs without it.)
constexpr int kCombineWarps = 8;
template <int kPerWarp>
__global__ void __launch_bounds__(kCombineWarps * 32)
    attention_decode_combine_kernel(const float* part_o /*[n_split, rows, dv]*/, const float* part_ml /*[n_split, rows, 2]*/,
                                    const float* sinks /*[nq] or null*/, int n_split, int64_t n_rows, int nq, int dv,
                                    void* out /*[rows, dv]*/, int out_dtype) {
    pdl_begin();
    __shared__ float weight[kMaxDecodeSplits];         // exp2(m_z - M) / denominator
    __shared__ float partial[kCombineWarps][kMaxDv];   // each warp's weighted sum over its splits
    const int64_t R = blockIdx.x;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;

    float o[kPerWarp][4];
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
        const int z = warp + i * warps;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = lane * 4 + e;
            o[i][e] = z < n_split && d < dv ? part_o[(z * n_rows + R) * dv + d] : 0.f;
        }
    }
    if (warp == 0) split_weights(part_ml, n_split, n_rows, R, sinks, nq, weight);
    __syncthreads();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
        const int z = warp + i * warps;
        if (z < n_split)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[e] += o[i][e] * weight[z];
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) partial[warp][lane * 4 + e] = acc[e];
    __syncthreads();
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float sum = 0.f;
        for (int w = 0; w < warps; ++w) sum += partial[w][d];
        store_f(out, out_dtype, R * dv + d, sum);
    }
}

// XINFER_CUDA_ATTN_BF16_INSTANCE=0: every launch takes the generic instance (A/B).
bool bf16_instance_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_ATTN_BF16_INSTANCE", true);
    return enabled;
}

// XINFER_CUDA_ATTN_WIDE_DECODE=0: decode-shaped batches keep 4-warp blocks (A/B of the 8-warp instance).
bool wide_decode_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_ATTN_WIDE_DECODE", true);
    return enabled;
}

// Tiles per split at least, for grids of fewer than 64 (sequence, KV head) blocks
// (XINFER_CUDA_ATTN_SMALL_SPLIT_TILES, default 2; A/B).
int64_t small_grid_split_tiles() {
    static const int64_t n = std::max<int64_t>(env_int("XINFER_CUDA_ATTN_SMALL_SPLIT_TILES", 2), 1);
    return n;
}

// XINFER_CUDA_ATTN_WINDOW_ONE_BLOCK=0: short key ranges (≤ 3 tiles) of small grids split like long ones (A/B).
bool window_one_block_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_ATTN_WINDOW_ONE_BLOCK", true);
    return enabled;
}

// The most splits a key range is cut into (XINFER_CUDA_ATTN_MAX_SPLITS, 1..kMaxDecodeSplits; A/B).
int64_t max_splits() {
    static const int64_t n = std::clamp<int64_t>(env_int("XINFER_CUDA_ATTN_MAX_SPLITS", 64), 1, kMaxDecodeSplits);
    return n;
}

// XINFER_CUDA_DECODE_ATTENTION: 0 = never (the flash kernel of attention.cu for everything),
// "decode" = only decode-shaped batches (≤ 32 query tokens per sequence on average), default: all.
int decode_attention_mode() {
    static const int mode = [] {
        const char* v = std::getenv("XINFER_CUDA_DECODE_ATTENTION");
        if (v && std::strcmp(v, "0") == 0) return 0;
        if (v && std::strcmp(v, "decode") == 0) return 1;
        return 2;
    }();
    return mode;
}


// Whether a batch of `rows` query rows (Σ q_len · G) in n_seqs sequences takes the prefill kernel
// (attention_prefill.cu: 192-row tiles, no key splits): at least a full tile per sequence on
// average and a wave of blocks. XINFER_CUDA_ATTN_PREFILL=0: never (A/B); "all": every batch it
// can take (tests: the decode-shaped cases of the attention grid then check its masking too).
bool use_prefill_kernel(int64_t rows, int64_t n_seqs, int64_t nkv, int64_t sm_count) {
    static const int mode = [] {
        const char* v = std::getenv("XINFER_CUDA_ATTN_PREFILL");
        if (v && std::strcmp(v, "0") == 0) return 0;
        if (v && std::strcmp(v, "all") == 0) return 2;
        return 1;
    }();
    if (mode != 1) return mode == 2;
    return rows >= kPrefillRows * n_seqs && ceil_div(rows, kPrefillRows) * nkv >= sm_count;
}

// The kernel instance: bf16 heads of MiMo's (192, 128) and Qwen3's / the DFlash drafter's
// (128, 128) dims have instances with the dims fixed at compile time
// (XINFER_CUDA_ATTN_FIXED_DIMS=0: the runtime-dims instances only, A/B).
template <int kWarps>
void (*decode_kernel_for(bool bf16, int dk, int dv))(DecodeArgs) {
    static const bool fixed = env_flag("XINFER_CUDA_ATTN_FIXED_DIMS", true);
    if (bf16 && fixed && dk == 192 && dv == 128) return attention_decode_kernel<true, kWarps, 192, 128>;
    if (bf16 && fixed && dk == 128 && dv == 128) return attention_decode_kernel<true, kWarps, 128, 128>;
    return bf16 ? attention_decode_kernel<true, kWarps> : attention_decode_kernel<false, kWarps>;
}

// The combine of a.n_split > 1 partials into the output (nothing for one split).
int launch_combine(Context* c, const DecodeArgs& a) {
    if (a.n_split <= 1) return XINFER_OK;
    const int combine_warps = std::min(a.n_split, kCombineWarps);
    const int per_warp = int(ceil_div(a.n_split, combine_warps));
    const auto combine = per_warp <= 1   ? attention_decode_combine_kernel<1>
                         : per_warp <= 2 ? attention_decode_combine_kernel<2>
                         : per_warp <= 4 ? attention_decode_combine_kernel<4>
                         : per_warp <= 8 ? attention_decode_combine_kernel<8>
                                         : attention_decode_combine_kernel<kMaxDecodeSplits / kCombineWarps>;
    return launch_pdl(c, "attention_decode_combine_kernel", combine, dim3(unsigned(a.T * a.nq)),
                      dim3(combine_warps * 32), 0, static_cast<const float*>(a.part_o),
                      static_cast<const float*>(a.part_ml), a.sinks, a.n_split, a.T * a.nq, a.nq, a.dv, a.out,
                      a.out_dtype);
}

}  // namespace

int decode_partials(Context* c, DecodeArgs& a) {
    if (a.n_split <= 1) return XINFER_OK;
    ScratchPlan plan;
    const size_t off_o = plan.add(size_t(a.n_split) * size_t(a.T * a.nq * a.dv) * 4);
    const size_t off_ml = plan.add(size_t(a.n_split) * size_t(a.T * a.nq) * 8);
    if (int rc = ensure_scratch(c, plan.total)) return rc;
    a.part_o = reinterpret_cast<float*>(c->scratch + off_o);
    a.part_ml = reinterpret_cast<float*>(c->scratch + off_ml);
    return XINFER_OK;
}

// Called by op_attention (attention.cu) after it validated the op. Returns XINFER_UNSUPPORTED,
// without an error message, for shapes this kernel does not take (prefill-shaped batches, fp8
// caches, dv > 128): the caller then runs its flash kernel.
int attention_decode(Context* c, const xinfer_op* op) {
    const xinfer_tensor &q = op->src[0], &k_cache = op->src[1], &v_cache = op->src[2], &sinks = op->src[3],
                        &out = op->dst[0];
    const xinfer_attention_batch& b = op->batch;
    const xinfer_attention_params& ap = op->params.attention;
    const int nq = ap.n_q_heads, nkv = ap.n_kv_heads, dk = ap.head_dim_k, dv = ap.head_dim_v;
    const int64_t T = q.shape[0];
    const int mode = decode_attention_mode();
    if (mode == 0) return XINFER_UNSUPPORTED;
    if (mode == 1 && T > 32 * int64_t(b.n_seqs)) return XINFER_UNSUPPORTED;
    if (!is_float(k_cache.dtype) || !is_float(v_cache.dtype) || dk > kMaxDk || dv > kMaxDv) return XINFER_UNSUPPORTED;
    const int dk_pad = (dk + 15) / 16 * 16, dv_pad = (dv + 15) / 16 * 16;

    DecodeArgs a{};
    a.q = q.data;
    a.k_cache = k_cache.data;
    a.v_cache = v_cache.data;
    a.sinks = absent(sinks) ? nullptr : static_cast<const float*>(sinks.data);
    a.out = out.data;
    a.cu_q_lens = static_cast<const int32_t*>(b.cu_q_lens.data);
    a.kv_lens = static_cast<const int32_t*>(b.kv_lens.data);
    a.positions = static_cast<const int32_t*>(b.positions.data);
    a.page_table = static_cast<const int32_t*>(b.page_table.data);
    a.k_page_stride = b.page_stride > 0 ? b.page_stride : int64_t(b.page_size) * nkv * dk;
    a.v_page_stride = b.page_stride > 0 ? b.page_stride : int64_t(b.page_size) * nkv * dv;
    a.T = T;
    a.q_dtype = q.dtype;
    a.k_dtype = k_cache.dtype;
    a.v_dtype = v_cache.dtype;
    a.out_dtype = out.dtype;
    a.n_seqs = b.n_seqs;
    a.max_pages = b.max_pages_per_seq;
    a.page_size = b.page_size;
    a.page_shift = b.page_size > 0 && (b.page_size & (b.page_size - 1)) == 0 ? __builtin_ctz(unsigned(b.page_size)) : -1;
    a.nq = nq;
    a.nkv = nkv;
    a.group = nq / nkv;
    a.dk = dk;
    a.dv = dv;
    a.dk_pad = dk_pad;
    a.dv_pad = dv_pad;
    a.scale = ap.softmax_scale;
    a.scale_log2 = ap.softmax_scale * kLog2e;
    a.window = ap.window;
    a.causal = ap.causal;
    const auto vec_ok = [](const xinfer_tensor& cache, int d, int64_t stride) {
        return cache.dtype == XINFER_DTYPE_BF16 && d % 8 == 0 && stride % 8 == 0 && pointer_alignment(cache.data) >= 16;
    };
    a.k_vec = vec_ok(k_cache, dk, a.k_page_stride);
    a.v_vec = vec_ok(v_cache, dv, a.v_page_stride);
    a.q_vec = vec_ok(q, dk, 0);
    a.early_kv = early_reads();

    // bf16 q, caches and out with 16-byte rows (out 8-byte aligned: the fixed-dims instances store
    // 4 bf16 columns at once) take the bf16 instances.
    const bool bf16 = a.q_vec && a.k_vec && a.v_vec && out.dtype == XINFER_DTYPE_BF16 && pointer_alignment(out.data) >= 8 &&
                      bf16_instance_enabled();
    if (bf16 && use_prefill_kernel(T * a.group, b.n_seqs, nkv, c->sm_count)) {
        a.n_split = 1;
        if (int rc = attention_prefill(c, a); rc != XINFER_UNSUPPORTED) return rc;
    }

    // Keys a block may walk, at most (host-known bounds only).
    int64_t key_span = int64_t(b.max_pages_per_seq) * b.page_size;
    if (ap.window > 0) key_span = std::min<int64_t>(key_span, (ap.causal ? 1 : 2) * int64_t(ap.window) + kRows);
    // Rows per block: 64, or 16 when 64-row blocks would give fewer than 64 (row tile, KV head)
    // blocks over short key ranges (verification at batch 1 of a sliding layer: 8 tokens × 8 heads
    // were one block per KV head, each warp walking every key of the split for its 16 rows; with
    // 16-row tiles the block's four warps share each key tile, as in decode). Over long ranges
    // 64-row tiles win, each key tile serving 4 tokens instead of 1: MiMo's 8-token verify on H200,
    // full layer over 4K keys 35.1 → 23.8 µs, while the sliding layer went 11.1 → 17.3 µs.
    // Decode rows (G ≤ 16) fit one tile either way, and take 16-row tiles whenever the batch is
    // decode-shaped (T·G ≤ 16 per sequence) so that they run on the 8-warp instance.
    const int64_t blocks_of_64 = std::max<int64_t>(b.n_seqs, ceil_div(T * a.group, kRows)) * nkv;
    const bool wide = wide_decode_enabled();
    constexpr int64_t kLongKeySpan = 1024;
    a.tile_rows = (blocks_of_64 < 64 && key_span < kLongKeySpan) || (wide && T * a.group <= 16 * int64_t(b.n_seqs)) ? 16 : kRows;
    const int warps = wide && a.tile_rows == 16 ? 8 : 4;
    const DecodeSmem L = decode_smem(dk_pad, dv_pad, warps);
    if (size_t(L.total) > c->smem_optin) return XINFER_UNSUPPORTED;
    // Row tiles: Σ_s ceil(q_len_s · G / tile_rows) ≤ ceil(T · G / tile_rows) + n_seqs (an upper
    // bound; blocks past the real tiles exit at once).
    const int64_t row_tiles = ceil_div(T * a.group, a.tile_rows) + b.n_seqs;
    const int64_t est_blocks = std::max<int64_t>(b.n_seqs, ceil_div(T * a.group, a.tile_rows)) * nkv;
    // Decode-shaped batches of MiMo's and Qwen3's bf16 heads: per-warp key streams (attention_stream.cu).
    if (bf16 && k_cache.rank == 4 && v_cache.rank == 4 && k_cache.shape[0] == v_cache.shape[0]) {
        bool merged = false;
        const int rc = attention_stream(c, a, k_cache.shape[0], key_span, est_blocks, row_tiles, &merged);
        if (rc != XINFER_UNSUPPORTED) return rc != XINFER_OK || merged ? rc : launch_combine(c, a);
    }
    // n_split from host-known bounds: enough blocks for ~2 waves of 2 blocks per SM, each split at
    // least min_split_tiles tiles and at most max_splits() splits, so the partials and the combine stay
    // small next to the keys read. Measured on H200 (ops-test --perf): 4 tiles rather than 2 took
    // batched sliding-window decode (32 seqs, window 128) from 48 to 28 µs and serving at
    // concurrency 32 from 68.8% to 71.1% of its roofline; the 64-split cap took a 32K-key decode
    // from 122 to 76 µs, where 4K keys (17 splits) stayed at 40 µs.
    // With fewer than 64 (sequence, KV head) blocks (batch-1 decode, verification) a block is a
    // latency chain, so splits go down to two tiles each: MiMo batch 1 on H200, sliding layer
    // 15.4 -> 9.2 + 4.5 (combine) µs with one-tile splits (session 8, 4-warp blocks); with 8-warp
    // blocks and the one-round-trip combine, two tiles (the sliding window's 128 keys in one block,
    // no combine; 4K keys in 33 splits) gave 76.8 / 76.7% of copy bandwidth against 76.2 / 76.4%
    // for one tile and 76.4 / 76.3% for four (session 12).
    // A key range of at most three tiles (a sliding window of 128 keys over a 64-key tiling) stays
    // in one block: no partials, no combine. MiMo on H200 (ops-test --perf, batch 1): sliding
    // decode 7.5 -> 5.5 µs, 8-token sliding verify 11.9 -> 7.1 µs; over 4K keys three-tile splits
    // lost (decode 14.6 -> 15.7 µs), so longer ranges keep two (XINFER_CUDA_ATTN_WINDOW_ONE_BLOCK=0:
    // two-tile splits everywhere, A/B).
    const bool one_block = est_blocks < 64 && key_span <= 3 * kTileKeys && window_one_block_enabled();
    const int64_t min_split_tiles = one_block ? 3 : est_blocks < 64 ? small_grid_split_tiles() : 4;
    const int64_t target = 4 * int64_t(c->sm_count);
    const int n_split = int(std::clamp<int64_t>(
        std::min({ceil_div(target, std::max<int64_t>(est_blocks, 1)), ceil_div(key_span, min_split_tiles * kTileKeys),
                  max_splits()}),
        1, int64_t(kMaxDecodeSplits)));
    a.n_split = n_split;
    if (int rc = decode_partials(c, a)) return rc;
    const auto kernel = warps == 8 ? decode_kernel_for<8>(bf16, dk, dv) : decode_kernel_for<4>(bf16, dk, dv);
    if (L.total > 48 * 1024)
        XCUDA_TRY(c, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L.total));
    const dim3 grid{unsigned(row_tiles), unsigned(nkv), unsigned(n_split)};
    if (int rc = launch_pdl(c, "attention_decode_kernel", kernel, grid, dim3(warps * 32), size_t(L.total), a))
        return rc;
    return launch_combine(c, a);
}

}  // namespace xcuda
