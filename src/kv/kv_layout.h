// Where every layer's K and V live in the KV pool.
//
// One pool of equal-byte pages serves every layer group (DESIGN.md decision 6). A group's page
// holds `tokens_per_page` consecutive tokens for *all* layers of the group, laid out
//     [layer 0: K[tokens_per_page, n_kv, dk], V[tokens_per_page, n_kv, dv]] [layer 1: ...] ...
// so groups with fewer bytes per token get more tokens per page. page_bytes is a multiple of
// every group's bytes per token (their least common multiple, scaled up until the group with
// the most bytes per token has at least `min_tokens_per_page`), so no page wastes a byte.
// MiMo-V2-Flash in bf16: full group 23,040 B/token, sliding group 199,680 B/token.
//
// FP8 (e4m3) caches keep one f32 scale per (token, kv head) row of K and of V inside the same
// page, right after the values of the block they scale (the ABI's cache format,
// include/xinfer/backend_abi.h):
//     [layer 0: K[tpp, n_kv, dk] e4m3, K scales[tpp, n_kv] f32, V[tpp, n_kv, dv] e4m3, V scales[tpp, n_kv] f32] ...
// so a layer costs n_kv·(dk + dv + 8) bytes per token, pages stay equal across groups, and
// paging, prefix caching and sliding release never need to know about scales. MiMo-V2-Flash in
// fp8: full group 11,808 B/token (9 × 4 × 328), sliding 102,336 B/token (39 × 8 × 328).
#pragma once

#include "core/dtype.h"

#include <cstdint>
#include <vector>

namespace xinfer {

struct KvGroupLayout {
    bool sliding = false;
    int window = 0;  // sliding groups: keys p-window+1..p
    int n_kv_heads = 0;
    int head_dim_k = 0;
    int head_dim_v = 0;
    std::vector<int> layers;      // model layer indices in this group
    int64_t bytes_per_token = 0;  // K+V of all the group's layers
    int64_t tokens_per_page = 0;
    // Element offsets (in kv dtype elements; bytes for fp8) of layer i's K and V block inside a
    // page (fp8: each block is its values followed by their scales).
    std::vector<int64_t> k_offset, v_offset;
};

struct KvLayout {
    DType dtype = DType::f32;
    int64_t page_bytes = 0;
    std::vector<KvGroupLayout> groups;

    int64_t page_elements() const { return page_bytes / int64_t(dtype_size(dtype)); }
    // Scheduler / prefix-cache granularity: the least common multiple of tokens_per_page.
    int64_t block_tokens() const;
    // Pages group g needs to hold tokens [0, n_tokens) (sliding groups: before any release).
    int64_t pages_for(int group, int64_t n_tokens) const;
};

struct KvGroupShape {  // what the model declares (kind, geometry, layers)
    bool sliding = false;
    int window = 0;
    int n_kv_heads = 0, head_dim_k = 0, head_dim_v = 0;
    std::vector<int> layers;
};

// Bytes one token of one layer takes: n_kv·(dk + dv)·element size, plus 2·n_kv f32 scales for
// fp8 (the figure `xinfer plan` multiplies by layers and tokens).
int64_t kv_bytes_per_token_per_layer(DType dtype, int64_t n_kv_heads, int64_t head_dim_k, int64_t head_dim_v);
// Elements (bytes for fp8) of one page of one cache block [tokens, n_kv, d]: the values, plus
// the fp8 scales that follow them.
int64_t kv_block_elements(DType dtype, int64_t tokens, int64_t n_kv_heads, int64_t head_dim);

KvLayout make_kv_layout(const std::vector<KvGroupShape>& groups, DType dtype, int64_t min_tokens_per_page = 16);

}  // namespace xinfer
