// Prefill ATTENTION on Hopper warpgroup MMAs (wgmma) for long query tiles (bf16 q, caches and
// out with 16-byte rows; MiMo's 192/128 and Qwen3's 128/128 head dims).
//
// Why not the split-KV kernel (attention_decode.cu). That kernel is built around short query
// tiles: 64 rows per block, each warp reloading its Q fragments from shared memory for every 16
// keys and running the online softmax (row max, shuffles, O rescale) per 16 keys. On a causal
// prefill (H200, MiMo full layer, 4,096 tokens) it reached 19% of the bf16 matmul rate; this
// kernel 58% (docs/perf/2026-12-01-h200-session15.md). Here:
//   - a block owns kPrefillRows = 192 query rows (3 warpgroups × 64; rows token-major as
//     everywhere: row = token·G + head) of one sequence and one KV head;
//   - per 64-key tile, each warpgroup computes S[64, 64] = Q·Kᵀ with Q and K read by wgmma from
//     shared memory, runs one online-softmax update on the accumulators (the running max allowed
//     to lag by up to 2^8, so most tiles skip the O rescale; the per-score mask only on tiles that
//     cut some row's range), then O[64, dv] += P·V with P from registers (the S accumulators
//     rounded to bf16: wgmma's accumulator layout is its A-fragment layout) and V from shared
//     memory, O in registers;
//   - K/V tiles of 64 keys go global → shared with 16-byte cp.async into 128-byte-swizzled
//     layouts (wgmma.cuh) through a ring of 3 tiles (one __syncthreads per tile), page numbers
//     read a tile ahead of their copies, each loader thread one branch per row (copy, zeros or
//     NaN);
//   - no key splits (a prefill has blocks enough) and no cross-warp merge: each warp writes its
//     16 rows' outputs straight from registers.
// The mma.sync version (each warp 16 rows, K and V through ldmatrix) reached 39.5%: every warp read
// the whole K and V tile for its 16 rows, ~70% of the shared-memory bandwidth; wgmma reads them
// once per 64 rows.
// Masking, sinks, missing pages (a needed key on page -1 reads as NaN, unneeded keys are never
// read) and the row → (token, head) mapping are the split-KV kernel's, and with it the CPU
// reference's (attention_common.cuh). The launcher takes a batch only where this kernel applies
// (attention_decode decides; XINFER_CUDA_ATTN_PREFILL in plugins/cuda/README.md).
#include "attention_common.cuh"
#include "attention_tiles.cuh"
#include "wgmma.cuh"

namespace xcuda {
namespace {

// kPrefillRows = 192 query rows: 3 warpgroups of 4 warps × 16 rows. (mma.sync history, H200,
// MiMo full layer, 4,096-token causal prefill: 8 warps with Q in registers 1.37 ms, 12 warps
// re-reading Q from shared memory 1.27 ms, 16 warps 1.265 ms with spills; wgmma 0.86 ms.)
constexpr int kRows = kPrefillRows, kWarps = kRows / 16, kThreads = kWarps * 32;
constexpr int kKeys = 64;            // keys per shared-memory tile and per warp step
constexpr int kLoaders = kKeys * 4;  // threads that copy a tile: 4 per key row
constexpr int kStages = 3;           // K/V tiles in the ring: tile t is used while t + 1, t + 2 load
// The running max moves only when a score passes it by more than this (log2 units); see update_max.
constexpr float kMaxSlack = 8.f;

// Shared memory (bytes), tiles in 128-byte-swizzled 64-element chunks (wgmma.cuh), 1,024-byte
// aligned: Q [3 warpgroups][dk / 64][64 rows][128 B] (K-major), then kStages × (K [dk / 64][64 keys]
// [128 B] (K-major), V [dv / 64][64 keys][128 B] (N-major)), then the block's per-token key ranges.
constexpr int kChunkBytes = kKeys * 128;  // one 64-element chunk of a 64-row tile
struct PrefillSmem {
    int q, ring, k_stage, v_stage, stage, lo, hi, total;
};
constexpr PrefillSmem prefill_smem(int dk, int dv) {
    PrefillSmem L{};
    L.q = 0;
    L.ring = kRows * dk * 2;
    L.k_stage = 0;
    L.v_stage = kKeys * dk * 2;
    L.stage = L.v_stage + kKeys * dv * 2;
    L.lo = L.ring + kStages * L.stage;
    L.hi = L.lo + kRows * 4;
    L.total = L.hi + kRows * 4 + 1024;  // (slack to align the base)
    return L;
}

// copy_row_part (attention_tiles.cuh) into a 128-byte-swizzled tile (wgmma.cuh): 16-byte unit u
// of key row `row` goes to chunk u / 8, unit (u % 8) ^ (row % 8) of the row.
template <int kLen>
__device__ __forceinline__ void copy_row_swizzled(unsigned char* tile, int row, const __nv_bfloat16* cache, int64_t src,
                                                  int part) {
    static_assert(kLen % 32 == 0, "each of a row's 4 threads takes whole 16-byte chunks");
    const auto dst = [&](int u) { return tile + (u / 8) * kChunkBytes + swizzle_offset(row, u % 8); };
    if (src >= 0) {
#pragma unroll
        for (int u = part; u < kLen / 8; u += 4) cp_async16(dst(u), cache + src + u * 8);
    } else {
        const uint32_t fill = src == kNaN ? 0x7fc07fc0u : 0u;  // bf16 NaN pairs
#pragma unroll
        for (int u = part; u < kLen / 8; u += 4) *reinterpret_cast<uint4*>(dst(u)) = make_uint4(fill, fill, fill, fill);
    }
}

template <int kDk, int kDv>
__global__ void __launch_bounds__(kThreads, 1) attention_prefill_kernel(DecodeArgs a) {
    static_assert(kDk % 64 == 0 && kDk <= 256 && kDv == 128, "wgmma shapes: S m64n64k16, O m64n128k16");
    constexpr PrefillSmem L = prefill_smem(kDk, kDv);
    constexpr int kDkSteps = kDk / 16;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    // (the swizzle atoms need 1,024-byte alignment)
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    auto* tok_lo = reinterpret_cast<int*>(smem + L.lo);
    auto* tok_hi = reinterpret_cast<int*>(smem + L.hi);
    // A prefill reads what the op before it (KV_STORE) wrote from the first key on; nothing is
    // worth reading before the wait.
    pdl_wait();
    pdl_launch_dependents();

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tid4 = lane % 4;
    const int g = blockIdx.y, G = a.group;
    // Last row tiles first: in a causal prefill they see the most keys (split-KV kernel's order).
    const BlockRows b = block_rows(find_row_tile(a.cu_q_lens, a.n_seqs, G, kRows, gridDim.x - 1 - blockIdx.x), kRows,
                                   G, a.cu_q_lens, a.kv_lens);
    if (b.seq < 0) return;
    const int s = b.seq, rows = b.rows, tok_first = b.tok_first, ntok = b.ntok, token_base = b.token_base;
    const int64_t row0 = b.row0;
    store_token_ranges(b, a.positions, a.causal, a.window, kThreads, tok_lo, tok_hi);
    __syncthreads();
    int key_lo, key_hi;
    key_union(tok_lo, tok_hi, ntok, key_lo, key_hi);
    const int n_tiles = key_lo <= key_hi ? (key_hi - key_lo + kKeys) / kKeys : 0;
    // Whether the tokens' ranges, in token order, form one interval (consecutive positions do):
    // then every key of [key_lo, key_hi] is needed, and the loader skips the per-token search.
    bool chained = true;
    for (int i = tid; i + 1 < ntok; i += kThreads)
        chained &= tok_lo[i] <= tok_hi[i] && tok_lo[i + 1] <= tok_hi[i + 1] && tok_lo[i] <= tok_lo[i + 1] &&
                   tok_hi[i] <= tok_hi[i + 1] && tok_lo[i + 1] <= tok_hi[i] + 1;
    const bool contiguous = __syncthreads_and(chained);

    // Loader: thread → key row tid / 4 of a tile, a quarter of its 16-byte chunks (every 4th).
    const auto page_of = [&](int j) { return a.page_shift >= 0 ? j >> a.page_shift : j / a.page_size; };
    const int32_t* page_row = a.page_table + int64_t(s) * a.max_pages;
    constexpr int kNotNeeded = INT_MIN;
    const int kk_load = tid / 4;
    const bool loader = tid < kLoaders;  // (the last 4 warps copy nothing)
    auto fetch_page = [&](int kb) {
        const int j = kb + kk_load;
        bool needed = loader && j <= key_hi;
        if (needed && !contiguous) {
            needed = false;
            for (int i = 0; i < ntok && !needed; ++i) needed = j >= tok_lo[i] && j <= tok_hi[i];
        }
        return needed ? page_row[page_of(j)] : kNotNeeded;
    };
    // Keys nobody needs are zeros; a needed key on a released page (-1) NaN in K (so exactly the
    // rows that see it turn NaN) and zeros in V.
    auto issue_tile = [&](int stage, int kb, int page) {
        if (!loader) return;
        int64_t ks = page == kNotNeeded ? kZero : kNaN, vs = kZero;
        if (page >= 0) {
            const int j = kb + kk_load;
            const int64_t slot_row = int64_t(j - page_of(j) * a.page_size) * a.nkv + g;
            ks = int64_t(page) * a.k_page_stride + slot_row * kDk;
            vs = int64_t(page) * a.v_page_stride + slot_row * kDv;
        }
        unsigned char* tile = smem + L.ring + stage * L.stage;
        copy_row_swizzled<kDk>(tile + L.k_stage, kk_load, static_cast<const __nv_bfloat16*>(a.k_cache), ks, tid % 4);
        copy_row_swizzled<kDv>(tile + L.v_stage, kk_load, static_cast<const __nv_bfloat16*>(a.v_cache), vs, tid % 4);
    };

    // Q rows (zero past `rows`) in the first group with tile 0; tiles 0 .. kStages - 2 in flight.
    {
        constexpr int kChunks = kDk / 8;  // 16-byte chunks per row
        for (int i = tid; i < kRows * kChunks; i += kThreads) {
            const int r = i / kChunks, c = i % kChunks;
            unsigned char* dst = smem + L.q + ((r / 64) * (kDk / 64) + c / 8) * kChunkBytes + swizzle_offset(r % 64, c % 8);
            if (r < rows) {
                const int flat = int(row0) + r;
                const int64_t t = token_base + (flat / G - tok_first);
                cp_async16(dst, static_cast<const __nv_bfloat16*>(a.q) + (t * a.nq + g * G + flat % G) * kDk + c * 8);
            } else {
                *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < kStages - 1; ++u) {
        if (u < n_tiles) issue_tile(u, key_lo + u * kKeys, fetch_page(key_lo + u * kKeys));
        cp_async_commit();
    }
    int next_page = kNotNeeded;  // the page of tile t + kStages - 1, read one tile ahead
    if (kStages - 1 < n_tiles) next_page = fetch_page(key_lo + (kStages - 1) * kKeys);

    // This thread's two rows (gid, gid + 8 of the warp's 16): their visible keys.
    int lo_r[2], hi_r[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
        row_key_range(b, warp * 16 + gid + 8 * h, G, tok_lo, tok_hi, INT_MIN, INT_MAX, lo_r[h], hi_r[h]);

    cp_async_wait<kStages - 2>();
    fence_proxy_async();  // (this thread's shared-memory writes, for wgmma)
    __syncthreads();

    float o[kDv / 8][4];
#pragma unroll
    for (int j = 0; j < kDv / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
    const float scale = a.scale_log2;  // > 0 (the launcher's condition): max(s)·scale = max(s·scale)
    const auto k_tile = [&](int st) { return smem_addr(smem + L.ring + st * L.stage + L.k_stage); };
    const auto v_tile = [&](int st) { return smem_addr(smem + L.ring + st * L.stage + L.v_stage); };
    const auto next_stage = [](int st) { return st + 1 == kStages ? 0 : st + 1; };

    // S[64 rows, 64 keys] = Q · Kᵀ of the warpgroup; this thread's part is the warp's 16 rows in
    // the mma.sync layout: n-tile n holds keys kb + 8n .. kb + 8n + 7. k-step kk: 64-element chunk
    // kk / 4, 32 bytes per step inside it (K-major, SBO = one 8-row atom).
    using Scores = float[kKeys / 8][4];
    const uint32_t q_base = smem_addr(smem + L.q) + (warp / 4) * (kDk / 64) * kChunkBytes;
    const auto scores = [&](uint32_t k_base, Scores& sc) {
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kDkSteps; ++kk) {
            const uint32_t off = (kk / 4) * kChunkBytes + (kk % 4) * 32;
            wgmma_m64n64k16_ss(sc, wgmma_desc(q_base + off, 16, 1024), wgmma_desc(k_base + off, 16, 1024), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(sc);
    };
    // Whether every row of the warp sees every key of tile kb (then no score needs a mask).
    const auto whole_tile = [&](int kb) {
        bool whole = true;
#pragma unroll
        for (int h = 0; h < 2; ++h) whole &= lo_r[h] <= kb && kb + kKeys - 1 <= hi_r[h];
        return __all_sync(0xffffffffu, whole);
    };
    // Scores of keys a row may not see: only in tiles that cut some row's range (a causal
    // prefill's diagonal tile, a window's edges), as a branch of its own.
    const auto mask = [&](Scores& sc, int kb) {
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = kb + n * 8 + 2 * tid4 + (e & 1), h = e / 2;
                if (j < lo_r[h] || j > hi_r[h]) sc[n][e] = -INFINITY;
            }
    };
    // Online softmax in log2 units, per row (a row's 64 scores are spread over a quad). The
    // reference max m_r moves only when a score passes it by more than kMaxSlack: until then
    // probabilities may reach 2^kMaxSlack (no overflow in f32 sums or bf16 P, the same relative
    // rounding), and O keeps its scale, so most tiles after the first few skip the rescale.
    const auto update_max = [&](const Scores& sc, float (&m_use)[2], float (&corr)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < kKeys / 8; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * h], sc[n][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx *= scale;
            const float m_new = mx > m_r[h] + kMaxSlack ? mx : m_r[h];
            m_use[h] = m_new == -INFINITY ? 0.f : m_new;
            corr[h] = fast_exp2(m_r[h] - m_use[h]);
            m_r[h] = m_new;
        }
    };
    // Scores → probabilities in place; the rows' denominators.
    const auto exponentiate = [&](Scores& sc, const float (&m_use)[2], const float (&corr)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = fast_exp2(fmaf(sc[n][2 * h + e], scale, -m_use[h]));
                    sc[n][2 * h + e] = p;
                    sum += p;
                }
            l_r[h] = l_r[h] * corr[h] + sum;
        }
    };
    // O[64 rows, dv] += P[64 rows, 64 keys] · V[64 keys, dv] of the warpgroup, 16 keys per k-step: P
    // from the S accumulators (an m16n8 accumulator pair is the A fragment of the next MMA), V
    // N-major (16 keys = two 8-row atoms, SBO, per k-step; 64-element dv chunks LBO apart).
    const auto accumulate = [&](uint32_t v_base, const Scores& sc) {
        uint32_t pa[kKeys / 16][4];
#pragma unroll
        for (int k16 = 0; k16 < kKeys / 16; ++k16) {
            pa[k16][0] = pack_bf16(sc[2 * k16][0], sc[2 * k16][1]);
            pa[k16][1] = pack_bf16(sc[2 * k16][2], sc[2 * k16][3]);
            pa[k16][2] = pack_bf16(sc[2 * k16 + 1][0], sc[2 * k16 + 1][1]);
            pa[k16][3] = pack_bf16(sc[2 * k16 + 1][2], sc[2 * k16 + 1][3]);
        }
        wgmma_fence();
#pragma unroll
        for (int k16 = 0; k16 < kKeys / 16; ++k16)
            wgmma_m64n128k16_rs(o, pa[k16], wgmma_desc(v_base + k16 * 2 * 1024, kChunkBytes, 1024));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(o);
    };
    // Refills the stage of tile t - 1 with tile t + kStages - 1 (after the barrier that frees it).
    int refill = kStages - 1;
    const auto refill_ring = [&](int t) {
        if (t + kStages - 1 < n_tiles) {
            issue_tile(refill, key_lo + (t + kStages - 1) * kKeys, next_page);
            if (t + kStages < n_tiles) next_page = fetch_page(key_lo + (t + kStages) * kKeys);
        }
        cp_async_commit();  // (an empty group past the last tile keeps the wait counts uniform)
        refill = next_stage(refill);
    };

    int stage = 0;
    for (int t = 0; t < n_tiles; ++t) {
        if (t > 0) {
            cp_async_wait<kStages - 2>();  // tile t has landed (this thread's copies) ...
            fence_proxy_async();
            __syncthreads();               // ... everyone's, and tile t - 1's stage is free
        }
        refill_ring(t);
        const int kb = key_lo + t * kKeys, st = stage;
        stage = next_stage(stage);
        // (Every warp takes every tile: a warpgroup's MMAs need all four warps; rows that see none
        // of the tile get probabilities 0 from the mask.)
        Scores sc;
        scores(k_tile(st), sc);
        if (!whole_tile(kb)) mask(sc, kb);
        float m_use[2], corr[2];
        update_max(sc, m_use, corr);
        rescale_rows(o, corr);
        exponentiate(sc, m_use, corr);
        accumulate(v_tile(st), sc);
    }
    cp_async_wait<0>();  // no copy may outlive the block (empty groups only, but be exact)

    // Normalise (with the sink) and write the warp's rows from registers: a quad holds a row's
    // 2-column pairs, so each store is one bf16x2.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 1);
        l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 2);
        const int r = warp * 16 + gid + 8 * h;
        if (r >= rows) continue;
        const int flat = int(row0) + r;
        const int head = g * G + flat % G;
        float alpha = 1.f, denom = l_r[h];
        if (a.sinks) {
            const float sink = a.sinks[head] * kLog2e, M = m_r[h];
            const float Ms = fmaxf(M, sink);
            alpha = M == -INFINITY ? 0.f : exp2f(M - Ms);
            denom = l_r[h] * alpha + exp2f(sink - Ms);
        }
        const float f = denom == 0.f ? 0.f : alpha / denom;
        const int64_t R = int64_t(token_base + (flat / G - tok_first)) * a.nq + head;
        auto* out = static_cast<__nv_bfloat16*>(a.out) + R * kDv + 2 * tid4;
#pragma unroll
        for (int n = 0; n < kDv / 8; ++n)
            *reinterpret_cast<__nv_bfloat162*>(out + n * 8) = __floats2bfloat162_rn(o[n][2 * h] * f, o[n][2 * h + 1] * f);
    }
}

template <int kDk, int kDv>
int launch_prefill(Context* c, const DecodeArgs& a) {
    constexpr PrefillSmem L = prefill_smem(kDk, kDv);
    if (size_t(L.total) > c->smem_optin) return XINFER_UNSUPPORTED;
    XCUDA_TRY(c, cudaFuncSetAttribute(attention_prefill_kernel<kDk, kDv>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      L.total));
    // Row tiles: Σ_s ceil(q_len_s · G / kRows) ≤ ceil(T · G / kRows) + n_seqs (blocks past the last exit).
    const int64_t row_tiles = (a.T * a.group + kRows - 1) / kRows + a.n_seqs;
    return launch_pdl(c, "attention_prefill_kernel", attention_prefill_kernel<kDk, kDv>,
                      dim3(unsigned(row_tiles), unsigned(a.nkv)), dim3(kThreads), size_t(L.total), a);
}

}  // namespace

int attention_prefill(Context* c, const DecodeArgs& a) {
    if (a.n_split != 1 || !(a.scale_log2 > 0.f)) return XINFER_UNSUPPORTED;
    if (a.dk == 192 && a.dv == 128) return launch_prefill<192, 128>(c, a);
    if (a.dk == 128 && a.dv == 128) return launch_prefill<128, 128>(c, a);
    return XINFER_UNSUPPORTED;
}

}  // namespace xcuda
