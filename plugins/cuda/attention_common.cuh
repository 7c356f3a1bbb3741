// Device logic every attention kernel shares (flash, split-KV decode, exact f32), so that they
// agree with the CPU reference (src/backend/cpu/attention.cpp) by construction.
#pragma once

#include <climits>
#include <cstdint>

namespace xcuda {

// One ATTENTION op, as the flash and exact kernels read it (attention.cu fills it from the op).
struct AttnArgs {
    const void* q;             // [T, nq, dk]
    const void* k_cache;       // pages of [page_size, nkv, dk], k_page_stride elements apart
    const void* v_cache;       // pages of [page_size, nkv, dv], v_page_stride elements apart
    const float* sinks;        // [nq] or null
    void* out;                 // [T, nq, dv]
    float* part_o;             // [n_split, T·nq, dv] (n_split > 1)
    float* part_ml;            // [n_split, T·nq, 2]  (n_split > 1): running max, denominator
    const int32_t* cu_q_lens;  // [n_seqs + 1]
    const int32_t* kv_lens;    // [n_seqs]
    const int32_t* positions;  // [T]
    const int32_t* page_table; // [n_seqs, max_pages]
    int64_t k_page_stride, v_page_stride, T;  // elements (bytes for fp8 caches)
    int q_dtype, k_dtype, v_dtype, out_dtype;
    int n_seqs, max_pages, page_size;
    int nq, nkv, group, dk, dv, dk_pad, dv_pad;
    float scale;
    int window, causal, n_split;
    bool k_vec, v_vec;         // bf16 cache rows may use 16-byte loads (fp8 rows: 8-byte loads)
};


// Keys a query at position p may see form one range [lo, hi] (empty when hi < lo): causal
// queries see keys ≤ p; a window keeps keys with p - j < window (non-causal: |p - j| < window,
// symmetric around each query, as DFlash drafters need); never keys ≥ kv_len.
__device__ __forceinline__ void attention_key_range(int p, int kv_len, int causal, int window, int& lo, int& hi) {
    lo = 0;
    hi = kv_len - 1;
    if (causal) hi = min(hi, p);
    if (window > 0) {
        lo = max(0, p - window + 1);
        if (!causal) hi = min(hi, p + window - 1);
    }
}

// Query rows are the pairs (query token i, head h of a KV head's group of G), token-major per
// sequence (row = i·G + h), cut into tiles of `tile_rows`; tiles of all sequences are numbered
// consecutively. Finds the sequence of tile `tile` and the tile's first row in it (seq = -1 past
// the last tile: grids are sized by an upper bound).
struct RowTile {
    int seq = -1;
    int q_len = 0;
    int64_t row0 = 0;
};
// Every block looks for its tile among all the sequences before its own, so the search must be
// short: a warp takes 32 sequences at a time (one offset load per lane, a prefix sum of their
// tile counts by shuffles, a ballot for the one holding `tile`). Walking them one by one was a
// chain of up to n_seqs dependent loads in every block (~64 at serving concurrency 64). Tile
// sizes are powers of two and divide by a shift (a 64-bit division by a runtime value is a ~100-
// instruction subroutine: ncu, session 8). Every lane of the calling warp must call it.
__device__ __forceinline__ RowTile find_row_tile(const int32_t* cu_q_lens, int n_seqs, int group, int tile_rows,
                                                 int64_t tile) {
    const int shift = __ffs(tile_rows) - 1;
    const bool pow2 = tile_rows == 1 << shift;
    const int lane = threadIdx.x % 32;
    RowTile t;
    int64_t first = 0;  // tiles of the sequences before this group of 32
    for (int base = 0; base < n_seqs; base += 32) {
        const int i = base + lane;
        const int q_len = i < n_seqs ? cu_q_lens[i + 1] - cu_q_lens[i] : 0;
        const int64_t rows_up = int64_t(q_len) * group + tile_rows - 1;
        const int64_t tiles = q_len == 0 ? 0 : pow2 ? rows_up >> shift : rows_up / tile_rows;
        int64_t end = tiles;  // inclusive prefix sum: one past this sequence's last tile in the group
#pragma unroll
        for (int off = 1; off < 32; off *= 2) {
            const int64_t v = __shfl_up_sync(0xffffffffu, end, off);
            if (lane >= off) end += v;
        }
        const int64_t start = first + end - tiles;
        const unsigned hit = __ballot_sync(0xffffffffu, tile >= start && tile < start + tiles);
        if (hit) {
            const int src = __ffs(hit) - 1;
            t.seq = base + src;
            t.q_len = __shfl_sync(0xffffffffu, q_len, src);
            t.row0 = (tile - __shfl_sync(0xffffffffu, start, src)) * tile_rows;
            return t;
        }
        first += __shfl_sync(0xffffffffu, end, 31);
    }
    return t;
}

// A block's share of the query rows once find_row_tile has named its tile: rows row0 .. row0 +
// rows - 1 of sequence seq (seq = -1: no tile, the block exits), i.e. its tokens tok_first ..
// tok_first + ntok - 1 (token_base: the first one's index in the batch), and the sequence's q_len
// and kv_len.
struct BlockRows {
    int seq = -1, rows = 0, tok_first = 0, ntok = 0, token_base = 0, q_len = 0, kv_len = 0;
    int64_t row0 = 0;
};
__device__ __forceinline__ BlockRows block_rows(const RowTile& tile, int tile_rows, int group, const int32_t* cu_q_lens,
                                                const int32_t* kv_lens) {
    BlockRows b;
    if (tile.seq < 0) return b;
    b.seq = tile.seq;
    b.row0 = tile.row0;
    b.rows = int(min(int64_t(tile_rows), int64_t(tile.q_len) * group - tile.row0));
    b.tok_first = int(tile.row0 / group);
    b.ntok = int((tile.row0 + b.rows - 1) / group) - b.tok_first + 1;
    b.token_base = cu_q_lens[b.seq] + b.tok_first;
    b.q_len = tile.q_len;
    b.kv_len = kv_lens[b.seq];
    return b;
}

// Each of the block's tokens' visible keys into tok_lo / tok_hi [ntok], the block's `threads`
// threads in turn (the caller synchronises before reading them).
__device__ __forceinline__ void store_token_ranges(const BlockRows& b, const int32_t* positions, int causal, int window,
                                                   int threads, int* tok_lo, int* tok_hi) {
    for (int i = threadIdx.x; i < b.ntok; i += threads) {
        int lo, hi;
        attention_key_range(positions[b.token_base + i], b.kv_len, causal, window, lo, hi);
        tok_lo[i] = lo;
        tok_hi[i] = hi;
    }
}

// The keys block row r sees, [lo, hi] within [key_lo, key_hi] (lo > hi past the block's rows):
// the range of its token (row = token · group + head, token-major).
__device__ __forceinline__ void row_key_range(const BlockRows& b, int r, int group, const int* tok_lo, const int* tok_hi,
                                              int key_lo, int key_hi, int& lo, int& hi) {
    lo = 1;
    hi = 0;
    if (r < b.rows) {
        const int tok = int((b.row0 + r) / group) - b.tok_first;
        lo = max(tok_lo[tok], key_lo);
        hi = min(tok_hi[tok], key_hi);
    }
}

// The union of the tokens' key ranges, [key_lo, key_hi] (key_lo > key_hi when no token sees a key).
__device__ __forceinline__ void key_union(const int* tok_lo, const int* tok_hi, int ntok, int& key_lo, int& key_hi) {
    key_lo = INT_MAX;
    key_hi = -1;
    for (int i = 0; i < ntok; ++i)
        if (tok_lo[i] <= tok_hi[i]) {
            key_lo = min(key_lo, tok_lo[i]);
            key_hi = max(key_hi, tok_hi[i]);
        }
}

}  // namespace xcuda
