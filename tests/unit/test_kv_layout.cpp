// KV pool layout: page geometry for mixed full/sliding groups (DESIGN.md decision 6), and the
// bounded sliding-window footprint it buys for MiMo-V2-Flash.
#include "kv/kv_cache_manager.h"
#include "kv/kv_layout.h"
#include "safetensors_test_writer.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace xinfer {
namespace {

using test::error_message;

std::vector<int> layer_range(int first, int count, int stride = 1) {
    std::vector<int> layers;
    for (int i = 0; i < count; ++i) layers.push_back(first + i * stride);
    return layers;
}

// MiMo-V2-Flash: layers 0, 5, 11, ... are full attention (9 of 48); the rest slide over 128 keys.
std::vector<KvGroupShape> mimo_v2_flash_groups() {
    KvGroupShape full{
        .sliding = false, .window = 0, .n_kv_heads = 4, .head_dim_k = 192, .head_dim_v = 128, .layers = {}};
    KvGroupShape sliding{
        .sliding = true, .window = 128, .n_kv_heads = 8, .head_dim_k = 192, .head_dim_v = 128, .layers = {}};
    const std::vector<int> full_layers = {0, 5, 11, 17, 23, 29, 35, 41, 47};
    for (int layer = 0; layer < 48; ++layer) {
        const bool is_full = std::find(full_layers.begin(), full_layers.end(), layer) != full_layers.end();
        (is_full ? full : sliding).layers.push_back(layer);
    }
    return {full, sliding};
}

void expect_consistent(const KvLayout& layout) {
    for (const KvGroupLayout& group : layout.groups) {
        EXPECT_EQ(layout.page_bytes % group.bytes_per_token, 0) << "a page must not waste bytes";
        EXPECT_EQ(group.tokens_per_page * group.bytes_per_token, layout.page_bytes);
        ASSERT_EQ(group.k_offset.size(), group.layers.size());
        ASSERT_EQ(group.v_offset.size(), group.layers.size());
        // fp8: each block is its e4m3 values followed by one f32 scale per (token, kv head).
        const int64_t scale_elements = layout.dtype == DType::f8_e4m3 ? 4 : 0;
        const int64_t k_elements = group.tokens_per_page * group.n_kv_heads * (group.head_dim_k + scale_elements);
        const int64_t v_elements = group.tokens_per_page * group.n_kv_heads * (group.head_dim_v + scale_elements);
        EXPECT_EQ(kv_block_elements(layout.dtype, group.tokens_per_page, group.n_kv_heads, group.head_dim_k), k_elements);
        for (size_t i = 0; i < group.layers.size(); ++i) {
            EXPECT_EQ(group.k_offset[i], int64_t(i) * (k_elements + v_elements));
            EXPECT_EQ(group.v_offset[i], group.k_offset[i] + k_elements);  // V at width dv, not padded to dk
            if (scale_elements) {  // scales 4-byte aligned: values of 4-multiple widths before them
                EXPECT_EQ((group.k_offset[i] + group.tokens_per_page * group.n_kv_heads * group.head_dim_k) % 4, 0);
                EXPECT_EQ((group.v_offset[i] + group.tokens_per_page * group.n_kv_heads * group.head_dim_v) % 4, 0);
            }
        }
        EXPECT_EQ(group.v_offset.back() + v_elements, layout.page_elements()) << "layers fill the page exactly";
        EXPECT_EQ(layout.block_tokens() % group.tokens_per_page, 0);
    }
}

TEST(KvLayout, MimoV2FlashBf16) {
    const KvLayout layout = make_kv_layout(mimo_v2_flash_groups(), DType::bf16);
    ASSERT_EQ(layout.groups.size(), 2u);
    const KvGroupLayout& full = layout.groups[0];
    const KvGroupLayout& sliding = layout.groups[1];
    EXPECT_EQ(full.bytes_per_token, 23'040);      // 9 × 4 × (192 + 128) × 2
    EXPECT_EQ(sliding.bytes_per_token, 199'680);  // 39 × 8 × (192 + 128) × 2
    // LCM(23,040, 199,680) = 599,040 = 3 sliding tokens; 6× gives the sliding group ≥ 16 tokens.
    EXPECT_EQ(layout.page_bytes, 6 * 599'040);
    EXPECT_EQ(sliding.tokens_per_page, 18);
    EXPECT_EQ(full.tokens_per_page, 156);
    EXPECT_EQ(layout.block_tokens(), 468);  // LCM(156, 18)
    EXPECT_EQ(layout.pages_for(0, 0), 0);
    EXPECT_EQ(layout.pages_for(0, 156), 1);
    EXPECT_EQ(layout.pages_for(0, 157), 2);
    EXPECT_EQ(layout.pages_for(1, 100'000), (100'000 + 17) / 18);
    EXPECT_EQ(sliding.window, 128);
    EXPECT_EQ(full.layers.size(), 9u);
    EXPECT_EQ(sliding.layers.size(), 39u);
    expect_consistent(layout);
}

// fp8: e4m3 values (half of bf16) plus one f32 scale per (token, kv head) for K and for V:
// 328 instead of 640 bytes per head and layer.
TEST(KvLayout, MimoV2FlashFp8IsHalfPlusScales) {
    const KvLayout bf16 = make_kv_layout(mimo_v2_flash_groups(), DType::bf16);
    const KvLayout fp8 = make_kv_layout(mimo_v2_flash_groups(), DType::f8_e4m3);
    EXPECT_EQ(fp8.groups[0].bytes_per_token, 11'808);   // 9 × 4 × (192 + 128 + 2 × 4)
    EXPECT_EQ(fp8.groups[1].bytes_per_token, 102'336);  // 39 × 8 × 328
    EXPECT_EQ(kv_bytes_per_token_per_layer(DType::f8_e4m3, 4, 192, 128), 1'312);
    EXPECT_EQ(kv_bytes_per_token_per_layer(DType::bf16, 4, 192, 128), 2'560);
    // LCM(11,808, 102,336) = 307,008 = 3 sliding tokens; 6× gives ≥ 16: the same tokens per page as bf16.
    EXPECT_EQ(fp8.page_bytes, 6 * 307'008);
    EXPECT_EQ(fp8.groups[0].tokens_per_page, 156);
    EXPECT_EQ(fp8.groups[1].tokens_per_page, 18);
    EXPECT_EQ(fp8.page_bytes * 640, bf16.page_bytes * 328);
    EXPECT_EQ(fp8.page_elements(), fp8.page_bytes);  // 1-byte elements: offsets are byte offsets
    expect_consistent(fp8);
}

TEST(KvLayout, SingleGroupQwen3Like) {
    // Qwen3-30B-A3B: 48 full layers, 4 KV heads of 128.
    KvGroupShape all{
        .sliding = false, .window = 0, .n_kv_heads = 4, .head_dim_k = 128, .head_dim_v = 128, .layers = {}};
    all.layers = layer_range(0, 48);
    const KvLayout layout = make_kv_layout({all}, DType::bf16);
    EXPECT_EQ(layout.groups[0].bytes_per_token, 98'304);
    EXPECT_EQ(layout.groups[0].tokens_per_page, 16);
    EXPECT_EQ(layout.page_bytes, 16 * 98'304);
    EXPECT_EQ(layout.block_tokens(), 16);
    expect_consistent(layout);
    EXPECT_EQ(make_kv_layout({all}, DType::bf16, 1).groups[0].tokens_per_page, 1);
    EXPECT_EQ(make_kv_layout({all}, DType::bf16, 64).groups[0].tokens_per_page, 64);
}

TEST(KvLayout, PageIsTheSmallestSufficientCommonMultiple) {
    // bytes/token 12 and 16 (f32): LCM 48; min 5 tokens of the 16-byte group needs 80 → 96 bytes.
    KvGroupShape a{.sliding = false, .window = 0, .n_kv_heads = 1, .head_dim_k = 2, .head_dim_v = 1, .layers = {0}};
    KvGroupShape b{.sliding = true, .window = 7, .n_kv_heads = 2, .head_dim_k = 1, .head_dim_v = 1, .layers = {1}};
    const KvLayout layout = make_kv_layout({a, b}, DType::f32, 5);
    EXPECT_EQ(layout.page_bytes, 96);
    EXPECT_EQ(layout.groups[0].tokens_per_page, 8);
    EXPECT_EQ(layout.groups[1].tokens_per_page, 6);
    EXPECT_EQ(layout.block_tokens(), 24);
    expect_consistent(layout);
    // Exactly at a multiple: 4 tokens of 16 bytes = 64, next multiple of 48 is 96 → 6 tokens.
    EXPECT_EQ(make_kv_layout({a, b}, DType::f32, 4).page_bytes, 96);
    EXPECT_EQ(make_kv_layout({a, b}, DType::f32, 3).page_bytes, 48);
}

TEST(KvLayoutErrors, NameTheGroupAndValues) {
    KvGroupShape good{.sliding = false, .window = 0, .n_kv_heads = 1, .head_dim_k = 4, .head_dim_v = 4, .layers = {0}};
    EXPECT_CONTAINS(error_message([] { make_kv_layout({}, DType::bf16); }), "no layer groups");
    KvGroupShape empty = good;
    empty.layers.clear();
    EXPECT_CONTAINS(error_message([&] { make_kv_layout({good, empty}, DType::bf16); }), "group 1 (full) has no layers");
    KvGroupShape heads = good;
    heads.layers = {1};
    heads.head_dim_v = 0;
    EXPECT_CONTAINS(error_message([&] {
                        make_kv_layout({good, heads}, DType::bf16);
                    }),
                    "group 1 (full) needs positive n_kv_heads/head_dim_k/head_dim_v, got 1/4/0");
    KvGroupShape no_window = good;
    no_window.layers = {1};
    no_window.sliding = true;
    EXPECT_CONTAINS(error_message([&] {
                        make_kv_layout({good, no_window}, DType::bf16);
                    }),
                    "group 1 is sliding but its window is 0");
    KvGroupShape full_with_window = good;
    full_with_window.window = 64;
    EXPECT_CONTAINS(error_message([&] { make_kv_layout({full_with_window}, DType::bf16); }),
                    "group 0 is full attention but has window 64");
    KvGroupShape twice = good;
    twice.layers = {3, 0};
    EXPECT_CONTAINS(error_message([&] {
                        make_kv_layout({good, twice}, DType::bf16);
                    }),
                    "layer 0 appears twice (second time in group 1 (full))");
    KvGroupShape negative = good;
    negative.layers = {-2};
    EXPECT_CONTAINS(error_message([&] { make_kv_layout({negative}, DType::bf16); }), "negative layer index -2");
    EXPECT_CONTAINS(error_message([&] { make_kv_layout({good}, DType::fp4_e2m1); }), "KV dtype");
    EXPECT_CONTAINS(error_message([&] { make_kv_layout({good}, DType::bf16, 0); }),
                    "min_tokens_per_page must be >= 1, got 0");
    KvGroupShape huge = good;
    huge.n_kv_heads = 1 << 30;
    huge.head_dim_k = 1 << 30;
    EXPECT_CONTAINS(error_message([&] { make_kv_layout({huge}, DType::f32); }), "overflows");
    const KvLayout layout = make_kv_layout({good}, DType::bf16);
    EXPECT_CONTAINS(error_message([&] { layout.pages_for(1, 4); }), "group 1 out of range (layout has 1 groups)");
    EXPECT_CONTAINS(error_message([&] { layout.pages_for(0, -3); }), "group 0: negative token count -3");
}

// The point of decision 6: a MiMo sequence's sliding pages stay bounded however long it runs.
// Decoding one token at a time (allocate C+1, forward, commit C+1), resident sliding pages are
//   pages_for(allocated) - released(committed) = ceil(A/t) - floor(max(0, C-W+1)/t).
// After a commit (A = C) the worst case over C is ceil((W + t - 2) / t); during the forward of
// one new token (A = C + 1) it is ceil((W + t - 1) / t), one page more exactly when t divides
// W - 2 (here 126 = 7 × 18). Both are below the naive ceil((W - 1) / t) + 1 = 9 after a commit.
TEST(KvLayout, MimoSlidingPagesStayBoundedTo100kTokens) {
    const KvLayout layout = make_kv_layout(mimo_v2_flash_groups(), DType::bf16);
    const int64_t window = 128, per_page = layout.groups[1].tokens_per_page;
    const int64_t bound_after_commit = (window + per_page - 2 + per_page - 1) / per_page;
    const int64_t bound_during_step = (window + per_page - 1 + per_page - 1) / per_page;
    EXPECT_EQ(bound_after_commit, 8);
    EXPECT_EQ(bound_during_step, 9);
    const int64_t n_tokens = 100'000;
    KvCacheManager manager(layout, layout.pages_for(0, n_tokens) + bound_during_step, /*prefix caching*/ false);
    manager.add_sequence(1, {});
    const std::vector<int32_t> tokens(size_t(n_tokens), 7);
    auto resident_sliding = [&] {
        const std::vector<int32_t>& table = manager.page_table(1, 1);
        return int64_t(std::count_if(table.begin(), table.end(), [](int32_t page) { return page >= 0; }));
    };
    int64_t worst_after_commit = 0, worst_during_step = 0;
    for (int64_t length = 1; length <= n_tokens; ++length) {
        ASSERT_TRUE(manager.allocate(1, length)) << "at " << length;
        worst_during_step = std::max(worst_during_step, resident_sliding());
        manager.commit(1, tokens, length);
        const int64_t resident = resident_sliding();
        worst_after_commit = std::max(worst_after_commit, resident);
        ASSERT_LE(resident, bound_after_commit) << "at " << length;
        // Never fewer than the window needs: keys [length - W + 1, length) plus the next query's own.
        ASSERT_GE(resident * per_page, std::min(length, window - 1)) << "at " << length;
        if (length % 9973 == 0) manager.check_integrity();
    }
    EXPECT_EQ(worst_after_commit, bound_after_commit);
    EXPECT_EQ(worst_during_step, bound_during_step);
    // Every sliding page is released or resident, every full page resident.
    EXPECT_EQ(int64_t(manager.page_table(1, 1).size()), layout.pages_for(1, n_tokens));
    EXPECT_EQ(int64_t(manager.page_table(1, 0).size()), layout.pages_for(0, n_tokens));
    EXPECT_EQ(manager.free_pages(), manager.n_pages() - layout.pages_for(0, n_tokens) - resident_sliding());

    // ≈ 39 layers × 128 keys × 5,120 B = 25,559,040 B per sequence, up to page rounding.
    const int64_t window_bytes = 39 * 128 * 5'120;
    EXPECT_EQ(window_bytes, 25'559'040);
    EXPECT_EQ(window_bytes, window * layout.groups[1].bytes_per_token);
    const int64_t resident_bytes = bound_after_commit * layout.page_bytes;
    EXPECT_EQ(resident_bytes, 28'753'920);
    EXPECT_GE(resident_bytes, window_bytes);
    EXPECT_LT(resident_bytes, window_bytes + layout.page_bytes);
    EXPECT_LT(bound_during_step * layout.page_bytes, window_bytes + 2 * layout.page_bytes);
    manager.free_sequence(1);
    manager.check_integrity();
    EXPECT_EQ(manager.free_pages(), manager.n_pages());
}

}  // namespace
}  // namespace xinfer
