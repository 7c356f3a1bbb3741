// Long randomized schedules against KvCacheManager, with check_integrity() after every operation.
//
// The test keeps its own model of the pool, built only from what it wrote and the public API:
//  - written_[page][offset]: the token whose K/V the simulated forward wrote there. Writes must
//    land on private pages (ref 1, not cached); committed pages must still hold their tokens
//    when they fill up, and pages reused by a prefix hit must hold the new prompt's tokens.
//  - identity_[page]: the prefix a page held when it became full and committed, i.e. the
//    content the prefix cache may register it under.
// From these and page_cached(), the test computes the exact hit length add_sequence must
// return (the header's rule) and checks it, so the cache neither misses nor invents a hit.
#include "core/status.h"
#include "kv/kv_cache_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>

namespace xinfer {
namespace {

struct ScheduleConfig {
    const char* name;
    KvLayout layout;
    int64_t n_pages;      // seeds 1-3
    int64_t tight_pages;  // seeds 4-5: allocations fail, sequences get preempted
    int max_prompt, max_chunk, max_live, vocab;
    bool prefix_caching;
};

struct Identity {
    int group = -1;
    int64_t position = -1;
    std::vector<int32_t> prefix;  // tokens [0, (position + 1) · tokens_per_page)
};

struct Stats {
    int64_t adds = 0, hits = 0, hit_tokens = 0, failed_allocations = 0, evicting_allocations = 0, rollbacks = 0;
    int64_t aligned_adds = 0, aligned_hits = 0;  // adds with an alignment > 1 (counted apart from adds/hits)
};

class Schedule {
public:
    Schedule(const ScheduleConfig& config, uint32_t seed)
        : config_(config), manager_(config_.layout, config_.n_pages, config.prefix_caching), random_(seed) {
        int64_t widest = 0;
        for (const KvGroupLayout& group : config.layout.groups) widest = std::max(widest, group.tokens_per_page);
        written_.assign(size_t(config.n_pages), std::vector<int32_t>(size_t(widest), kUnwritten));
        identity_.resize(size_t(config.n_pages));
    }

    Stats run(int steps) {
        for (int step = 0; step < steps && !::testing::Test::HasFatalFailure(); ++step) {
            const int choice = pick(0, 99);
            if (live_.empty() || (choice < 15 && int(live_.size()) < config_.max_live))
                add();
            else if (choice < 80)
                forward(random_live());
            else if (choice < 86)
                truncate_lookahead(random_live());
            else if (choice < 94)
                free(random_live());
            else
                rejected_call(random_live());
            manager_.check_integrity();
        }
        while (!live_.empty()) free(live_.begin()->first);
        manager_.check_integrity();
        EXPECT_EQ(manager_.free_pages(), manager_.n_pages()) << "pages leaked";
        for (int32_t page = 0; page < int32_t(manager_.n_pages()); ++page)
            EXPECT_EQ(manager_.page_ref_count(page), 0) << "page " << page;
        return stats_;
    }

private:
    static constexpr int32_t kUnwritten = -1'000'000;
    struct Live {
        std::vector<int32_t> tokens;  // prompt, then accepted tokens; size ≥ committed
        int64_t prompt_length = 0;
    };

    int pick(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(random_); }
    int32_t random_token() { return int32_t(pick(0, config_.vocab - 1)); }
    int random_live() {
        auto it = live_.begin();
        std::advance(it, pick(0, int(live_.size()) - 1));
        return it->first;
    }
    int64_t per_page(size_t g) const { return config_.layout.groups[g].tokens_per_page; }
    int64_t released(size_t g, int64_t committed) const {
        const KvGroupLayout& group = config_.layout.groups[g];
        return group.sliding ? std::max<int64_t>(0, committed - group.window + 1) / group.tokens_per_page : 0;
    }

    std::vector<int32_t> new_prompt() {
        std::vector<int32_t> prompt;
        const int kind = pick(0, 9);
        if (!library_.empty() && kind < 7) {
            // Reuse a recent stream: whole (a repeated or continued conversation) or a long prefix
            // of it with a new suffix (a shared system prompt).
            const std::vector<int32_t>& source = library_[size_t(pick(0, int(library_.size()) - 1))];
            const int length = int(source.size());
            prompt.assign(source.begin(), source.begin() + (kind < 3 ? length : pick(length / 2, length)));
            const int suffix = kind < 3 ? pick(0, 3) : pick(1, std::max(1, config_.max_prompt / 4));
            for (int i = 0; i < suffix; ++i) prompt.push_back(random_token());
            if (int(prompt.size()) > config_.max_prompt) prompt.resize(size_t(config_.max_prompt));
        } else {
            const int length = pick(1, config_.max_prompt);
            for (int i = 0; i < length; ++i) prompt.push_back(random_token());
        }
        if (prompt.empty()) prompt.push_back(random_token());
        return prompt;
    }

    // The header's rule, evaluated on the test's model of what is cached.
    // `alignment`: a drafter's block (add_sequence's third argument); hits are multiples of
    // lcm(block_tokens, alignment).
    int64_t expected_hit(const std::vector<int32_t>& prompt, int64_t alignment) const {
        if (!config_.prefix_caching) return 0;
        std::map<std::pair<int, int64_t>, std::vector<int32_t>> cached;  // (group, position) → pages
        for (int32_t page = 0; page < int32_t(config_.n_pages); ++page) {
            if (!manager_.page_cached(page)) continue;
            const Identity& identity = identity_[size_t(page)];
            cached[{identity.group, identity.position}].push_back(page);
        }
        auto is_cached = [&](size_t g, int64_t i) {
            const size_t end = size_t((i + 1) * per_page(g));
            auto it = cached.find({int(g), i});
            if (it == cached.end()) return false;
            for (int32_t page : it->second) {
                const std::vector<int32_t>& prefix = identity_[size_t(page)].prefix;
                if (std::equal(prefix.begin(), prefix.end(), prompt.begin(), prompt.begin() + long(end))) return true;
            }
            return false;
        };
        const int64_t block = std::lcm(config_.layout.block_tokens(), alignment);
        for (int64_t length = (int64_t(prompt.size()) - 1) / block * block; length > 0; length -= block) {
            bool usable = true;
            for (size_t g = 0; g < config_.layout.groups.size() && usable; ++g)
                for (int64_t i = released(g, length); i < length / per_page(g) && usable; ++i) usable = is_cached(g, i);
            if (usable) return length;
        }
        return 0;
    }

    void add() {
        const int seq = next_seq_++;
        std::vector<int32_t> prompt = new_prompt();
        // Mostly the plain rule; one add in ten with a drafter's alignment (a divisor of the block,
        // a number prime to it, or a block multiple).
        const int64_t alignments[] = {2, 5, 2 * config_.layout.block_tokens()};
        const int64_t alignment = pick(0, 9) == 0 ? alignments[pick(0, 2)] : 1;
        const int64_t expected = expected_hit(prompt, alignment);
        const int64_t reused = manager_.add_sequence(seq, prompt, alignment);
        ASSERT_EQ(reused, expected) << config_.name << ": sequence " << seq << " of " << prompt.size()
                                    << " tokens, alignment " << alignment;
        ASSERT_EQ(manager_.committed_tokens(seq), reused);
        ASSERT_EQ(manager_.allocated_tokens(seq), reused);
        if (alignment > 1) {
            ++stats_.aligned_adds;
            stats_.aligned_hits += reused > 0;
        } else {
            ++stats_.adds;
            stats_.hits += reused > 0;
        }
        stats_.hit_tokens += reused;
        // Reused pages hold exactly this prompt's prefix, slot by slot.
        for (size_t g = 0; g < config_.layout.groups.size(); ++g) {
            const std::vector<int32_t>& table = manager_.page_table(seq, int(g));
            ASSERT_EQ(int64_t(table.size()), reused / per_page(g));
            for (int64_t i = released(g, reused); i < int64_t(table.size()); ++i) {
                const int32_t page = table[size_t(i)];
                const Identity& identity = identity_[size_t(page)];
                ASSERT_EQ(identity.group, int(g));
                ASSERT_EQ(identity.position, i);
                ASSERT_TRUE(std::equal(identity.prefix.begin(), identity.prefix.end(), prompt.begin()));
                for (int64_t offset = 0; offset < per_page(g); ++offset)
                    ASSERT_EQ(written_[size_t(page)][size_t(offset)], prompt[size_t(i * per_page(g) + offset)])
                        << "group " << g << " slot " << i << " page " << page;
            }
        }
        live_[seq] = Live{std::move(prompt), 0};
        live_[seq].prompt_length = int64_t(live_[seq].tokens.size());
    }

    struct Snapshot {
        int64_t free_pages, evictable;
        std::map<int, std::tuple<int64_t, int64_t, std::vector<std::vector<int32_t>>>> sequences;
        bool operator==(const Snapshot&) const = default;
    };
    Snapshot snapshot() const {
        Snapshot snapshot{manager_.free_pages(), manager_.evictable_pages(), {}};
        for (const auto& [seq, live] : live_) {
            std::vector<std::vector<int32_t>> tables;
            for (size_t g = 0; g < config_.layout.groups.size(); ++g)
                tables.push_back(manager_.page_table(seq, int(g)));
            snapshot.sequences[seq] = {manager_.allocated_tokens(seq), manager_.committed_tokens(seq), tables};
        }
        return snapshot;
    }

    // One model forward over `seq`: a prefill chunk, or a decode step verifying draft tokens.
    void forward(int seq) {
        Live& live = live_[seq];
        const int64_t committed = manager_.committed_tokens(seq);
        const int64_t prompt_left = live.prompt_length - committed;
        const bool prefill = prompt_left > 0;
        const int64_t n_query = prefill ? pick(1, int(std::min<int64_t>(prompt_left, config_.max_chunk))) : pick(1, 6);
        // Sometimes reserve lookahead slots beyond this step, as a scheduler may.
        const int64_t lookahead = pick(0, 3) == 0 ? pick(1, 4) : 0;
        const int64_t target = committed + n_query + lookahead;
        const Snapshot before = snapshot();
        const int64_t needed = manager_.pages_needed(seq, target);
        const int64_t plain_free = manager_.free_pages() - manager_.evictable_pages();
        if (!manager_.allocate(seq, target)) {
            ++stats_.failed_allocations;
            ASSERT_GT(needed, before.free_pages);
            ASSERT_TRUE(snapshot() == before) << "a failed allocate changed state";
            free(seq);  // preempt the sequence that did not fit
            return;
        }
        if (needed > plain_free) ++stats_.evicting_allocations;

        std::vector<int32_t> query(
            live.tokens.begin() + committed,
            live.tokens.begin() + committed + std::min(n_query, prompt_left < 0 ? 0 : prompt_left));
        while (int64_t(query.size()) < n_query) query.push_back(random_token());  // draft tokens
        for (int64_t offset = 0; offset < n_query; ++offset) write(seq, committed + offset, query[size_t(offset)]);

        // Prefill keeps the whole chunk; a decode step accepts a prefix of the drafts.
        const int64_t accepted = prefill ? n_query : pick(1, int(n_query));
        if (accepted < n_query) ++stats_.rollbacks;
        if (!prefill) live.tokens.insert(live.tokens.end(), query.begin(), query.begin() + accepted);
        const int64_t new_committed = committed + accepted;
        const bool truncate_first = pick(0, 1) == 0;  // both orders are legal
        const int64_t keep = pick(0, 1) == 0 ? new_committed : pick(int(new_committed), int(target));
        if (truncate_first) manager_.truncate(seq, keep);
        commit(seq, new_committed);
        if (!truncate_first) manager_.truncate(seq, keep);
        if (live.tokens.size() > size_t(config_.max_prompt) * 2 && pick(0, 3) == 0) free(seq);  // finished
    }

    void write(int seq, int64_t position, int32_t token) {
        for (size_t g = 0; g < config_.layout.groups.size(); ++g) {
            const int32_t page = manager_.page_table(seq, int(g))[size_t(position / per_page(g))];
            ASSERT_GE(page, 0) << "writing position " << position << " of sequence " << seq << " into a released slot";
            ASSERT_EQ(manager_.page_ref_count(page), 1) << "writing into shared page " << page;
            ASSERT_FALSE(manager_.page_cached(page)) << "writing into cached page " << page;
            written_[size_t(page)][size_t(position % per_page(g))] = token;
        }
    }

    void commit(int seq, int64_t new_committed) {
        const Live& live = live_[seq];
        const int64_t committed = manager_.committed_tokens(seq);
        // Pages that fill up now get their identity; read the tables before commit releases them.
        for (size_t g = 0; g < config_.layout.groups.size(); ++g) {
            const std::vector<int32_t>& table = manager_.page_table(seq, int(g));
            for (int64_t i = committed / per_page(g); i < new_committed / per_page(g); ++i) {
                const int32_t page = table[size_t(i)];
                ASSERT_GE(page, 0);
                const size_t end = size_t((i + 1) * per_page(g));
                for (int64_t offset = 0; offset < per_page(g); ++offset)
                    ASSERT_EQ(written_[size_t(page)][size_t(offset)], live.tokens[size_t(i * per_page(g) + offset)])
                        << "committed page " << page << " lost its contents";
                identity_[size_t(page)] = {int(g), i, {live.tokens.begin(), live.tokens.begin() + long(end)}};
            }
        }
        manager_.commit(seq, live.tokens, new_committed);
        ASSERT_EQ(manager_.committed_tokens(seq), new_committed);
    }

    void truncate_lookahead(int seq) {
        const int64_t committed = manager_.committed_tokens(seq), allocated = manager_.allocated_tokens(seq);
        manager_.truncate(seq, pick(int(committed), int(allocated)));
        manager_.commit(seq, live_[seq].tokens, committed);  // a repeated commit is a no-op
    }

    void free(int seq) {
        Live& live = live_[seq];
        live.tokens.resize(size_t(manager_.committed_tokens(seq)));
        if (!live.tokens.empty()) {
            if (library_.size() >= 16) library_.erase(library_.begin());  // keep the recent ones
            library_.push_back(std::move(live.tokens));
        }
        manager_.free_sequence(seq);
        live_.erase(seq);
    }

    // Invalid calls must throw and change nothing.
    void rejected_call(int seq) {
        const Snapshot before = snapshot();
        const std::vector<int32_t>& tokens = live_[seq].tokens;
        const int64_t committed = manager_.committed_tokens(seq), allocated = manager_.allocated_tokens(seq);
        switch (pick(0, 6)) {
            case 0:
                EXPECT_THROW(manager_.allocate(next_seq_ + 1000, 4), Error);
                break;
            case 1:
                EXPECT_THROW(manager_.commit(seq, tokens, committed > 0 ? committed - 1 : allocated + 1), Error);
                break;
            case 2:
                EXPECT_THROW(manager_.truncate(seq, committed > 0 ? committed - 1 : allocated + 1), Error);
                break;
            case 3:
                EXPECT_THROW(manager_.add_sequence(seq, tokens), Error);
                break;
            case 4:
                EXPECT_THROW(manager_.commit(seq, std::span(tokens).first(size_t(committed)), committed + 1), Error);
                break;
            case 5:
                EXPECT_THROW(manager_.page_table(seq, int(config_.layout.groups.size())), Error);
                break;
            default:
                EXPECT_THROW(manager_.free_sequence(-1), Error);
                break;
        }
        ASSERT_TRUE(snapshot() == before) << "a rejected call changed state";
    }

    ScheduleConfig config_;
    KvCacheManager manager_;
    std::mt19937 random_;
    std::map<int, Live> live_;
    std::vector<std::vector<int32_t>> library_;  // finished streams, for prompts sharing prefixes
    std::vector<std::vector<int32_t>> written_;  // [page][offset]
    std::vector<Identity> identity_;             // [page]
    int next_seq_ = 0;
    Stats stats_;
};

KvGroupShape shape(bool sliding, int window, int n_kv_heads, std::vector<int> layers) {
    return {.sliding = sliding,
            .window = window,
            .n_kv_heads = n_kv_heads,
            .head_dim_k = 1,
            .head_dim_v = 1,
            .layers = std::move(layers)};
}

std::vector<ScheduleConfig> schedule_configs() {
    // Full 12 B/token (4 per page) + sliding 16 B/token (3 per page, window 8): block 12.
    KvGroupShape full{.sliding = false, .window = 0, .n_kv_heads = 1, .head_dim_k = 2, .head_dim_v = 1, .layers = {0}};
    KvGroupShape sliding{
        .sliding = true, .window = 8, .n_kv_heads = 2, .head_dim_k = 1, .head_dim_v = 1, .layers = {1}};
    const KvLayout mixed = make_kv_layout({full, sliding}, DType::f32, 2);
    // Three groups: full (6 per page), sliding window 5 (2 per page), sliding window 16 (3 per page).
    const KvLayout three =
        make_kv_layout({shape(false, 0, 1, {0}), shape(true, 5, 3, {1}), shape(true, 16, 2, {2})}, DType::f32, 2);
    const KvLayout single = make_kv_layout({shape(false, 0, 1, {0, 1})}, DType::f32, 4);
    // The real MiMo-V2-Flash geometry (156 / 18 tokens per page, window 128, block 468).
    KvGroupShape mimo_full{
        .sliding = false, .window = 0, .n_kv_heads = 4, .head_dim_k = 192, .head_dim_v = 128, .layers = {}};
    KvGroupShape mimo_sliding{
        .sliding = true, .window = 128, .n_kv_heads = 8, .head_dim_k = 192, .head_dim_v = 128, .layers = {}};
    for (int layer = 0; layer < 48; ++layer)
        (layer % 5 == 0 && layer < 45 ? mimo_full : mimo_sliding).layers.push_back(layer);
    const KvLayout mimo = make_kv_layout({mimo_full, mimo_sliding}, DType::bf16);
    return {
        {"mixed", mixed, 110, 55, 40, 16, 4, 1000, true},
        {"mixed-tiny-vocab", mixed, 80, 40, 30, 9, 4, 2, true},
        {"three-groups", three, 100, 50, 36, 12, 4, 1000, true},
        {"three-groups-tiny-vocab", three, 80, 40, 30, 7, 4, 3, true},
        {"single-full", single, 80, 40, 60, 10, 6, 1000, true},
        {"mixed-no-prefix-cache", mixed, 80, 40, 60, 12, 6, 1000, false},
        {"mimo-bf16", mimo, 200, 45, 1500, 300, 4, 1000, true},
    };
}

TEST(KvCacheManagerRandom, LongSchedulesKeepEveryInvariant) {
    int64_t total_steps = 0;
    for (const ScheduleConfig& config : schedule_configs()) {
        ASSERT_EQ(config.layout.groups.size() == 2 && config.layout.groups[1].tokens_per_page == 18,
                  std::string(config.name) == "mimo-bf16");
        Stats sum;
        for (uint32_t seed : {1u, 2u, 3u, 4u, 5u}) {
            SCOPED_TRACE(std::string(config.name) + " seed " + std::to_string(seed));
            // Roomy pools let cached prefixes survive to be hit; halved ones force failures and preemption.
            ScheduleConfig seeded = config;
            if (seed > 3) seeded.n_pages = config.tight_pages;
            Schedule schedule(seeded, seed);
            const int steps = 3000;
            const Stats stats = schedule.run(steps);
            ASSERT_FALSE(::testing::Test::HasFatalFailure());
            total_steps += steps;
            sum.adds += stats.adds;
            sum.hits += stats.hits;
            sum.aligned_adds += stats.aligned_adds;
            sum.aligned_hits += stats.aligned_hits;
            sum.hit_tokens += stats.hit_tokens;
            sum.failed_allocations += stats.failed_allocations;
            sum.evicting_allocations += stats.evicting_allocations;
            sum.rollbacks += stats.rollbacks;
        }
        std::printf(
            "  %-24s adds %5lld  hits %5lld (aligned: %4lld / %4lld) (%6lld tokens)  failed allocations %4lld  "
            "evicting %4lld  rollbacks %5lld\n",
            config.name, (long long)sum.adds, (long long)sum.hits, (long long)sum.aligned_hits,
            (long long)sum.aligned_adds, (long long)sum.hit_tokens, (long long)sum.failed_allocations,
            (long long)sum.evicting_allocations, (long long)sum.rollbacks);
        // The schedules must actually exercise pressure, eviction and reuse.
        EXPECT_GT(sum.failed_allocations, 0) << config.name;
        EXPECT_GT(sum.rollbacks, 0) << config.name;
        if (config.prefix_caching) {
            EXPECT_GT(sum.hits, sum.adds / 20) << config.name;
            EXPECT_GT(sum.aligned_hits, 0) << config.name;
            EXPECT_GT(sum.evicting_allocations, 0) << config.name;
        } else {
            EXPECT_EQ(sum.hits, 0) << config.name;
        }
    }
    EXPECT_EQ(total_steps, 7 * 5 * 3000);
}

}  // namespace
}  // namespace xinfer
