// KvCacheManager: page tables, sliding release, prefix cache semantics and argument errors, on a
// tiny two-group layout whose numbers are easy to follow by hand:
//   group 0 full    12 B/token → 4 tokens per page
//   group 1 sliding 16 B/token → 3 tokens per page, window 8
//   page 48 B, block_tokens 12.
#include "kv/kv_cache_manager.h"
#include "safetensors_test_writer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

namespace xinfer {
namespace {

using test::error_message;

KvLayout small_layout() {
    KvGroupShape full{.sliding = false, .window = 0, .n_kv_heads = 1, .head_dim_k = 2, .head_dim_v = 1, .layers = {0}};
    KvGroupShape sliding{
        .sliding = true, .window = 8, .n_kv_heads = 2, .head_dim_k = 1, .head_dim_v = 1, .layers = {1}};
    return make_kv_layout({full, sliding}, DType::f32, 2);
}

std::vector<int32_t> token_run(int n, int32_t first) {
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    std::iota(tokens.begin(), tokens.end(), first);
    return tokens;
}

// Elements [begin, end) of `values`, clamped, so a wrong-sized table fails a comparison instead of crashing.
std::vector<int32_t> slice(const std::vector<int32_t>& values, size_t begin, size_t end) {
    end = std::min(end, values.size());
    begin = std::min(begin, end);
    return {values.begin() + long(begin), values.begin() + long(end)};
}

TEST(KvCacheManager, SmallLayoutIsWhatTheTestsAssume) {
    const KvLayout layout = small_layout();
    EXPECT_EQ(layout.page_bytes, 48);
    EXPECT_EQ(layout.groups[0].tokens_per_page, 4);
    EXPECT_EQ(layout.groups[1].tokens_per_page, 3);
    EXPECT_EQ(layout.block_tokens(), 12);
}

TEST(KvCacheManager, AllocateCommitTruncateFree) {
    KvCacheManager manager(small_layout(), 20, /*prefix caching*/ false);
    const std::vector<int32_t> prompt = token_run(40, 1);
    EXPECT_EQ(manager.add_sequence(1, slice(prompt, 0, 10)), 0);
    EXPECT_EQ(manager.pages_needed(1, 10), 3 + 4);
    ASSERT_TRUE(manager.allocate(1, 10));
    manager.check_integrity();
    EXPECT_EQ(manager.page_table(1, 0), (std::vector<int32_t>{0, 1, 2}));  // groups fill in order
    EXPECT_EQ(manager.page_table(1, 1), (std::vector<int32_t>{3, 4, 5, 6}));
    EXPECT_EQ(manager.free_pages(), 13);
    EXPECT_EQ(manager.pages_needed(1, 10), 0);
    EXPECT_TRUE(manager.allocate(1, 5));  // already held: no-op, does not shrink
    EXPECT_EQ(manager.allocated_tokens(1), 10);

    // All-or-nothing: 10 + 14 pages do not fit in 13.
    manager.add_sequence(2, prompt);
    EXPECT_EQ(manager.pages_needed(2, 40), 24);
    EXPECT_FALSE(manager.allocate(2, 40));
    EXPECT_TRUE(manager.page_table(2, 0).empty());
    EXPECT_TRUE(manager.page_table(2, 1).empty());
    EXPECT_EQ(manager.allocated_tokens(2), 0);
    EXPECT_EQ(manager.free_pages(), 13);
    manager.check_integrity();

    // Committing 10 tokens: the next query reads keys ≥ 3, so sliding page 0 (tokens 0-2) goes.
    manager.commit(1, prompt, 10);
    EXPECT_EQ(manager.committed_tokens(1), 10);
    EXPECT_EQ(manager.page_table(1, 1), (std::vector<int32_t>{-1, 4, 5, 6}));
    EXPECT_EQ(manager.free_pages(), 14);
    EXPECT_EQ(manager.page_ref_count(3), 0);
    EXPECT_FALSE(manager.page_cached(3));
    manager.check_integrity();

    // Speculate 4 tokens, accept 1, roll back the rest: only trailing uncommitted pages go.
    ASSERT_TRUE(manager.allocate(1, 14));
    EXPECT_EQ(manager.page_table(1, 0).size(), 4u);
    EXPECT_EQ(manager.page_table(1, 1).size(), 5u);
    manager.commit(1, prompt, 11);  // keys ≥ 4 now: sliding page 1 (tokens 3-5) still needed
    EXPECT_EQ(manager.page_table(1, 1)[1], 4);
    manager.truncate(1, 11);
    EXPECT_EQ(manager.page_table(1, 0).size(), 3u);
    EXPECT_EQ(manager.page_table(1, 1).size(), 4u);
    EXPECT_EQ(manager.allocated_tokens(1), 11);
    manager.check_integrity();
    manager.truncate(1, 11);        // no-op at the committed length
    manager.commit(1, prompt, 11);  // no-op
    ASSERT_TRUE(manager.allocate(1, 13));
    manager.commit(1, prompt, 12);  // keys ≥ 5: page 1 still holds token 5
    EXPECT_EQ(manager.page_table(1, 1).size(), 5u);
    EXPECT_EQ(slice(manager.page_table(1, 1), 0, 4), (std::vector<int32_t>{-1, 4, 5, 6}));
    manager.commit(1, prompt, 13);  // keys ≥ 6: page 1 released
    EXPECT_EQ(manager.page_table(1, 1)[1], -1);
    manager.check_integrity();

    manager.free_sequence(1);
    manager.free_sequence(2);
    EXPECT_FALSE(manager.has_sequence(1));
    EXPECT_EQ(manager.free_pages(), 20);
    EXPECT_EQ(manager.evictable_pages(), 0);
    manager.check_integrity();
}

TEST(KvPrefixCache, OffMeansNoHitsAndNothingRegistered) {
    KvCacheManager manager(small_layout(), 40, false);
    const std::vector<int32_t> prompt = token_run(50, 1);
    manager.add_sequence(1, prompt);
    ASSERT_TRUE(manager.allocate(1, 50));
    manager.commit(1, prompt, 50);
    EXPECT_EQ(manager.add_sequence(2, prompt), 0);
    for (int32_t page = 0; page < 40; ++page) EXPECT_FALSE(manager.page_cached(page));
    EXPECT_EQ(manager.prefix_queries(), 0);
    manager.check_integrity();
}

// A computed 50-token prompt: full pages 0-11 and sliding pages 0-15 registered (page 12 / 16
// are partial); sliding pages 0-13 released (the next query reads keys ≥ 43), hence evictable.
struct PromptA {
    std::vector<int32_t> tokens = token_run(50, 1000);
    std::vector<int32_t> full_pages, sliding_pages;  // A's pages per slot, recorded before release
};

PromptA compute_prompt_a(KvCacheManager& manager, int seq) {
    PromptA a;
    EXPECT_EQ(manager.add_sequence(seq, a.tokens), 0);
    EXPECT_TRUE(manager.allocate(seq, 50));
    a.full_pages = manager.page_table(seq, 0);
    a.sliding_pages = manager.page_table(seq, 1);
    manager.commit(seq, a.tokens, 50);
    manager.check_integrity();
    return a;
}

TEST(KvPrefixCache, SamePromptReusesTheLargestBlockMultiple) {
    KvCacheManager manager(small_layout(), 40, true);
    const PromptA a = compute_prompt_a(manager, 1);
    for (int i = 0; i < 12; ++i) EXPECT_TRUE(manager.page_cached(a.full_pages[size_t(i)])) << i;
    EXPECT_FALSE(manager.page_cached(a.full_pages[12]));
    for (int i = 0; i < 16; ++i) EXPECT_TRUE(manager.page_cached(a.sliding_pages[size_t(i)])) << i;
    EXPECT_EQ(manager.evictable_pages(), 14);

    // 48 = 4 blocks ≤ 49: full pages 0-11, and the sliding pages covering keys 41..47 (13-15).
    EXPECT_EQ(manager.add_sequence(2, a.tokens), 48);
    EXPECT_EQ(manager.committed_tokens(2), 48);
    EXPECT_EQ(manager.allocated_tokens(2), 48);
    EXPECT_EQ(manager.page_table(2, 0), slice(a.full_pages, 0, 12));
    std::vector<int32_t> expected_sliding(13, -1);
    for (int i = 13; i < 16; ++i) expected_sliding.push_back(a.sliding_pages[size_t(i)]);
    EXPECT_EQ(manager.page_table(2, 1), expected_sliding);
    EXPECT_EQ(manager.page_ref_count(a.full_pages[0]), 2);
    EXPECT_EQ(manager.page_ref_count(a.sliding_pages[13]), 1);  // was evictable, now B's alone
    EXPECT_EQ(manager.page_ref_count(a.sliding_pages[14]), 2);
    EXPECT_EQ(manager.evictable_pages(), 13);
    EXPECT_EQ(manager.prefix_queries(), 100);
    EXPECT_EQ(manager.prefix_hits(), 48);
    manager.check_integrity();

    // The hit is never the whole prompt: one token is always left to compute.
    EXPECT_EQ(manager.add_sequence(3, slice(a.tokens, 0, 48)), 36);
    EXPECT_EQ(manager.add_sequence(4, slice(a.tokens, 0, 49)), 48);
    EXPECT_EQ(manager.add_sequence(5, slice(a.tokens, 0, 12)), 0);
    EXPECT_EQ(manager.add_sequence(6, slice(a.tokens, 0, 13)), 12);
    EXPECT_EQ(manager.add_sequence(7, {}), 0);
    manager.check_integrity();

    // B continues on fresh pages: shared pages are never written.
    ASSERT_TRUE(manager.allocate(2, 52));
    EXPECT_EQ(manager.page_table(2, 0).size(), 13u);
    EXPECT_NE(manager.page_table(2, 0)[12], a.full_pages[12]);
    std::vector<int32_t> b_tokens = a.tokens;
    b_tokens.push_back(7);
    b_tokens.push_back(8);
    manager.commit(2, b_tokens, 52);  // B's page 12 differs from A's (A's is partial): now cached
    EXPECT_TRUE(manager.page_cached(manager.page_table(2, 0)[12]));
    manager.check_integrity();

    for (int seq = 1; seq <= 7; ++seq) manager.free_sequence(seq);
    manager.check_integrity();
    EXPECT_EQ(manager.free_pages(), 40);
}

// A drafter's own cache granularity (Drafter::prefix_cache_block) bounds the hit to multiples of
// lcm(block_tokens, alignment): with block 12, alignment 8 gives multiples of 24, alignment 12 or
// 1 the block itself; a bad alignment is an error that names it.
TEST(KvPrefixCache, AlignmentRoundsTheHitDownToACommonMultiple) {
    KvCacheManager manager(small_layout(), 60, true);
    const PromptA a = compute_prompt_a(manager, 1);
    EXPECT_EQ(manager.add_sequence(2, a.tokens, 8), 48);  // 48 = 2 × 24
    EXPECT_EQ(manager.add_sequence(3, slice(a.tokens, 0, 47), 8), 24);
    EXPECT_EQ(manager.add_sequence(4, slice(a.tokens, 0, 47), 12), 36);
    EXPECT_EQ(manager.add_sequence(5, slice(a.tokens, 0, 47), 1), 36);
    EXPECT_EQ(manager.add_sequence(6, a.tokens, 30), 0);  // lcm 60 > 49 - 1
    manager.check_integrity();
    EXPECT_NE(error_message([&] { manager.add_sequence(7, a.tokens, 0); }).find("alignment 0"), std::string::npos);
}

TEST(KvPrefixCache, ADifferentTokenLimitsTheHitToTheBlocksBeforeIt) {
    KvCacheManager manager(small_layout(), 60, true);
    const PromptA a = compute_prompt_a(manager, 1);
    auto with_change_at = [&](size_t position) {
        std::vector<int32_t> tokens = a.tokens;
        tokens[position] = -5;
        return tokens;
    };
    EXPECT_EQ(manager.add_sequence(2, with_change_at(30)), 24);  // block [24, 36) holds position 30
    EXPECT_EQ(manager.page_table(2, 0), slice(a.full_pages, 0, 6));
    EXPECT_EQ(manager.page_table(2, 1),
              (std::vector<int32_t>{-1, -1, -1, -1, -1, a.sliding_pages[5], a.sliding_pages[6], a.sliding_pages[7]}));
    EXPECT_EQ(manager.add_sequence(3, with_change_at(24)), 24);
    EXPECT_EQ(manager.add_sequence(4, with_change_at(23)), 12);
    EXPECT_EQ(manager.add_sequence(5, with_change_at(0)), 0);
    EXPECT_EQ(manager.add_sequence(6, with_change_at(48)), 48);
    manager.check_integrity();
}

// Takes exactly one page from the pool (a free one, else the LRU head) by growing filler
// sequence 100 to its next page boundary. Where both groups cross a boundary at once (every 12
// tokens), filler 101 first shrinks by one page, so the growth takes that page plus one more.
constexpr int kGrowingFiller = 100, kGivingFiller = 101;
void take_one_page(KvCacheManager& manager) {
    const int64_t available_before = manager.free_pages();
    int64_t next = manager.allocated_tokens(kGrowingFiller) + 1;
    while (manager.pages_needed(kGrowingFiller, next) == 0) ++next;
    if (manager.pages_needed(kGrowingFiller, next) == 2) {
        int64_t giver_tokens = manager.allocated_tokens(kGivingFiller);
        while (manager.free_pages() == available_before) {
            ASSERT_GT(giver_tokens, 1) << "the giving filler ran out of pages";
            manager.truncate(kGivingFiller, --giver_tokens);
        }
        ASSERT_EQ(manager.free_pages(), available_before + 1);
    }
    ASSERT_TRUE(manager.allocate(kGrowingFiller, next));
    ASSERT_EQ(manager.free_pages(), available_before - 1);
    manager.check_integrity();
}

// After A and D = A[0:30] + other tokens are computed and freed, the LRU list (least recent
// first) is: A's sliding 0-4, 8-13 (released while A ran), 7, 6, 5 (D's hit touched them), A's
// full 11..0, sliding 15, 14 (A's free, tail first). Nothing else is free.
struct SlidingEvictionSetup {
    KvCacheManager manager{small_layout(), 38, true};
    PromptA a;
};

SlidingEvictionSetup make_sliding_eviction_setup() {
    SlidingEvictionSetup setup;
    KvCacheManager& manager = setup.manager;
    setup.a = compute_prompt_a(manager, 1);
    std::vector<int32_t> d_tokens = slice(setup.a.tokens, 0, 30);
    for (int i = 0; i < 10; ++i) d_tokens.push_back(5000 + i);
    EXPECT_EQ(manager.add_sequence(2, d_tokens), 24);
    manager.free_sequence(2);
    manager.free_sequence(1);
    EXPECT_EQ(manager.evictable_pages(), 28);
    EXPECT_EQ(manager.free_pages(), 38);
    manager.add_sequence(kGrowingFiller, {});
    manager.add_sequence(kGivingFiller, {});
    EXPECT_TRUE(manager.allocate(kGrowingFiller, 1));  // 2 pages
    EXPECT_TRUE(manager.allocate(kGivingFiller, 11));  // 3 + 4 pages
    take_one_page(manager);                            // the last plain free page
    EXPECT_EQ(manager.free_pages(), 28);
    EXPECT_EQ(manager.evictable_pages(), 28);
    manager.check_integrity();
    return setup;
}

TEST(KvPrefixCache, SlidingHitSurvivesEvictionOfPagesBeforeTheWindow) {
    SlidingEvictionSetup setup = make_sliding_eviction_setup();
    KvCacheManager& manager = setup.manager;
    const PromptA& a = setup.a;
    for (int i = 0; i < 10; ++i) take_one_page(manager);  // evicts A's sliding 0-4 and 8-12
    for (int i : {0, 4, 8, 12}) EXPECT_FALSE(manager.page_cached(a.sliding_pages[size_t(i)])) << i;
    for (int i : {5, 13, 14, 15}) EXPECT_TRUE(manager.page_cached(a.sliding_pages[size_t(i)])) << i;
    EXPECT_EQ(manager.add_sequence(3, a.tokens), 48);
    EXPECT_EQ(manager.page_table(3, 0), slice(a.full_pages, 0, 12));
    EXPECT_EQ(slice(manager.page_table(3, 1), 13, 16), slice(a.sliding_pages, 13, 16));
    manager.check_integrity();
}

TEST(KvPrefixCache, SlidingHitIsRefusedWhenAWindowPageWasEvicted) {
    SlidingEvictionSetup setup = make_sliding_eviction_setup();
    KvCacheManager& manager = setup.manager;
    const PromptA& a = setup.a;
    for (int i = 0; i < 11; ++i) take_one_page(manager);  // ... and sliding 13, which L = 48 and 36 need
    EXPECT_FALSE(manager.page_cached(a.sliding_pages[13]));
    for (int i = 0; i < 12; ++i) EXPECT_TRUE(manager.page_cached(a.full_pages[size_t(i)])) << "full pages intact";

    // Copies are independent (the LRU list is index-linked), so one setup serves both steps.
    KvCacheManager before_more_evictions = manager;
    EXPECT_EQ(manager.add_sequence(3, a.tokens), 24);  // keys 17..23 live on sliding 5-7, still cached
    EXPECT_EQ(slice(manager.page_table(3, 1), 5, 8), slice(a.sliding_pages, 5, 8));
    manager.check_integrity();

    KvCacheManager& later = before_more_evictions;
    later.check_integrity();
    for (int i = 0; i < 3; ++i) take_one_page(later);  // sliding 7, 6, 5
    EXPECT_EQ(later.add_sequence(3, a.tokens), 0);
    later.check_integrity();
    // A freed sequence's pages are evicted tail first: its start is what other prompts share.
    take_one_page(later);
    EXPECT_FALSE(later.page_cached(a.full_pages[11]));
    for (int i = 0; i < 11; ++i) EXPECT_TRUE(later.page_cached(a.full_pages[size_t(i)])) << i;
    later.check_integrity();
}

// Forced collisions of the injectable bucket hash must cost hits, never produce wrong ones.
TEST(KvPrefixCache, ForcedHashCollisionsNeverGiveFalseHits) {
    {  // Every page in one bucket: only the first registered page is findable.
        KvCacheManager manager(small_layout(), 60, true, [](uint64_t, int, std::span<const int32_t>) { return 42u; });
        const PromptA a = compute_prompt_a(manager, 1);
        int cached = 0;
        for (int32_t page = 0; page < 60; ++page) cached += manager.page_cached(page);
        EXPECT_EQ(cached, 1);
        EXPECT_EQ(manager.add_sequence(2, token_run(50, 7)), 0);
        EXPECT_EQ(manager.add_sequence(3, a.tokens), 0);
        manager.check_integrity();
    }
    {  // A bucket hash without the chain: the window's pages of a prompt that differs only at
       // token 0 land in A's buckets with identical page tokens. The verification chain (which
       // covers the whole prefix) must still tell them apart.
        KvGroupShape sliding{
            .sliding = true, .window = 8, .n_kv_heads = 2, .head_dim_k = 1, .head_dim_v = 1, .layers = {0}};
        const KvLayout layout = make_kv_layout({sliding}, DType::f32, 3);
        auto unchained = [](uint64_t, int group, std::span<const int32_t> tokens) {
            return KvCacheManager::default_page_hash(0, group, tokens);
        };
        KvCacheManager manager(layout, 60, true, unchained);
        const std::vector<int32_t> a = token_run(50, 1000);
        manager.add_sequence(1, a);
        ASSERT_TRUE(manager.allocate(1, 50));
        manager.commit(1, a, 50);
        std::vector<int32_t> b = a;
        b[0] = -1;
        EXPECT_EQ(manager.add_sequence(2, b), 0);
        EXPECT_EQ(manager.add_sequence(3, a), 48);  // the bucket hash still finds true hits
        manager.check_integrity();
    }
}

TEST(KvCacheManagerErrors, NameTheSequenceAndValues) {
    KvCacheManager manager(small_layout(), 20, true);
    const std::vector<int32_t> prompt = token_run(30, 1);
    manager.add_sequence(7, prompt);
    ASSERT_TRUE(manager.allocate(7, 20));
    manager.commit(7, prompt, 10);
    const int64_t free_before = manager.free_pages();
    const std::vector<int32_t> full_before = manager.page_table(7, 0), sliding_before = manager.page_table(7, 1);

    EXPECT_CONTAINS(error_message([&] { manager.add_sequence(7, prompt); }),
                    "add_sequence: sequence 7 already exists (20 tokens allocated)");
    EXPECT_CONTAINS(error_message([&] { manager.allocate(8, 4); }), "allocate: sequence 8 is unknown");
    EXPECT_CONTAINS(error_message([&] { manager.pages_needed(8, 4); }), "pages_needed: sequence 8 is unknown");
    EXPECT_CONTAINS(error_message([&] { manager.commit(8, prompt, 4); }), "commit: sequence 8 is unknown");
    EXPECT_CONTAINS(error_message([&] { manager.truncate(8, 4); }), "truncate: sequence 8 is unknown");
    EXPECT_CONTAINS(error_message([&] { manager.free_sequence(8); }), "free_sequence: sequence 8 is unknown");
    EXPECT_CONTAINS(error_message([&] { manager.page_table(8, 0); }), "page_table: sequence 8 is unknown");
    EXPECT_CONTAINS(error_message([&] { manager.allocated_tokens(8); }), "sequence 8 is unknown");
    EXPECT_CONTAINS(error_message([&] { manager.committed_tokens(8); }), "sequence 8 is unknown");
    EXPECT_CONTAINS(error_message([&] { manager.allocate(7, -1); }), "allocate: sequence 7: negative token count -1");
    EXPECT_CONTAINS(error_message([&] { manager.pages_needed(7, -2); }), "sequence 7: negative token count -2");
    EXPECT_CONTAINS(error_message([&] { manager.commit(7, prompt, 9); }),
                    "commit: sequence 7: n_committed 9 is below its committed length 10");
    EXPECT_CONTAINS(error_message([&] { manager.commit(7, prompt, 21); }),
                    "commit: sequence 7: n_committed 21 exceeds its allocated length 20");
    EXPECT_CONTAINS(error_message([&] { manager.commit(7, slice(prompt, 0, 15), 16); }),
                    "commit: sequence 7: 15 tokens given for n_committed 16");
    EXPECT_CONTAINS(error_message([&] { manager.truncate(7, 9); }),
                    "truncate: sequence 7: n_tokens 9 is below its committed length 10");
    EXPECT_CONTAINS(error_message([&] { manager.truncate(7, 21); }),
                    "truncate: sequence 7: n_tokens 21 exceeds its allocated length 20");
    EXPECT_CONTAINS(error_message([&] { manager.page_table(7, 2); }),
                    "page_table: sequence 7: group 2 out of range (layout has 2 groups)");
    EXPECT_CONTAINS(error_message([&] { manager.page_ref_count(20); }), "page 20 out of [0, 20)");
    EXPECT_CONTAINS(error_message([&] { manager.page_cached(-1); }), "page -1 out of [0, 20)");
    EXPECT_CONTAINS(error_message([] { KvCacheManager(small_layout(), 0, true); }), "n_pages must be in [1, ");
    EXPECT_CONTAINS(error_message([] { KvCacheManager(KvLayout{}, 4, true); }), "the layout has no layer groups");

    // A rejected call changes nothing.
    EXPECT_EQ(manager.free_pages(), free_before);
    EXPECT_EQ(manager.page_table(7, 0), full_before);
    EXPECT_EQ(manager.page_table(7, 1), sliding_before);
    EXPECT_EQ(manager.allocated_tokens(7), 20);
    EXPECT_EQ(manager.committed_tokens(7), 10);
    manager.check_integrity();
}

}  // namespace
}  // namespace xinfer
