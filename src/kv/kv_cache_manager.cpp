#include "kv/kv_cache_manager.h"

#include "core/status.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <unordered_set>

namespace xinfer {
namespace {

// splitmix64's finalizer: a bijection on 64 bits with full avalanche.
uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

// MurmurHash3's fmix64: a second bijective mixer, for the verification chain.
uint64_t fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

// The verification chain: same shape as the default bucket hash, different mixer and salt, and
// never replaced, so a hit is only as weak as two unrelated 64-bit chains colliding together.
uint64_t check_page_hash(uint64_t previous_hash, int group, std::span<const int32_t> tokens) {
    uint64_t hash = fmix64(previous_hash + 0xc2b2ae3d27d4eb4full * uint64_t(group + 1));
    for (int32_t token : tokens) hash = fmix64(hash ^ (uint64_t(uint32_t(token)) * 0x9ddfea08eb382d69ull));
    return hash;
}

}  // namespace

uint64_t KvCacheManager::default_page_hash(uint64_t previous_hash, int group, std::span<const int32_t> tokens) {
    // The group salt keeps groups' chains apart (their pages cover different token ranges).
    uint64_t hash = mix64(previous_hash ^ (0x9e3779b97f4a7c15ull * uint64_t(group + 1)));
    // One bijective step per token: two equal-length pages differing in one token never collide.
    for (int32_t token : tokens) hash = mix64(hash ^ uint32_t(token));
    return hash;
}

KvCacheManager::KvCacheManager(KvLayout layout, int64_t n_pages, bool enable_prefix_caching, PageHashFn page_hash)
    : layout_(std::move(layout)),
      n_pages_(n_pages),
      prefix_caching_(enable_prefix_caching),
      page_hash_fn_(page_hash ? std::move(page_hash) : PageHashFn(&KvCacheManager::default_page_hash)) {
    if (layout_.groups.empty()) fail("KvCacheManager: the layout has no layer groups");
    for (size_t g = 0; g < layout_.groups.size(); ++g) {
        if (layout_.groups[g].tokens_per_page <= 0)
            fail("KvCacheManager: group {} has tokens_per_page {} (build the layout with make_kv_layout)", g,
                 layout_.groups[g].tokens_per_page);
    }
    if (n_pages <= 0 || n_pages > std::numeric_limits<int32_t>::max())
        fail("KvCacheManager: n_pages must be in [1, {}], got {}", std::numeric_limits<int32_t>::max(), n_pages);
    const size_t count = size_t(n_pages);
    ref_count_.assign(count, 0);
    registered_.assign(count, 0);
    page_hash_.assign(count, 0);
    page_check_hash_.assign(count, 0);
    page_group_.assign(count, -1);
    page_position_.assign(count, -1);
    page_tokens_.assign(count, {});
    lru_prev_.assign(count, -1);
    lru_next_.assign(count, -1);
    in_lru_.assign(count, 0);
    // Highest first, so pages are handed out 0, 1, 2, ... (easier to read in dumps).
    free_.reserve(count);
    for (int64_t page = n_pages - 1; page >= 0; --page) free_.push_back(int32_t(page));
}

int64_t KvCacheManager::free_pages() const { return int64_t(free_.size()) + lru_size_; }

// ---- sequences -------------------------------------------------------------------------------

KvCacheManager::Sequence& KvCacheManager::find_sequence(int seq, const char* method) {
    auto it = sequences_.find(seq);
    if (it == sequences_.end()) fail("KvCacheManager::{}: sequence {} is unknown", method, seq);
    return it->second;
}

const KvCacheManager::Sequence& KvCacheManager::find_sequence(int seq, const char* method) const {
    auto it = sequences_.find(seq);
    if (it == sequences_.end()) fail("KvCacheManager::{}: sequence {} is unknown", method, seq);
    return it->second;
}

int64_t KvCacheManager::released_pages(size_t group, int64_t committed) const {
    const KvGroupLayout& layout = layout_.groups[group];
    if (!layout.sliding) return 0;
    // The next query sits at position >= committed and reads keys >= committed - window + 1;
    // page i (tokens [i·t, (i+1)·t)) is dead once (i+1)·t <= that first key.
    return std::max<int64_t>(0, committed - layout.window + 1) / layout.tokens_per_page;
}

int64_t KvCacheManager::add_sequence(int seq, std::span<const int32_t> tokens, int64_t alignment) {
    if (sequences_.count(seq) != 0)
        fail("KvCacheManager::add_sequence: sequence {} already exists ({} tokens allocated)", seq,
             sequences_.at(seq).allocated);
    Sequence sequence;
    sequence.tables.resize(layout_.groups.size());
    sequence.hashes.resize(layout_.groups.size());
    sequence.check_hashes.resize(layout_.groups.size());
    int64_t reused = 0;
    if (prefix_caching_) {
        reused = attach_cached_prefix(sequence, tokens, alignment);
        prefix_queries_ += int64_t(tokens.size());
        prefix_hits_ += reused;
    }
    sequence.allocated = sequence.committed = reused;
    sequences_.emplace(seq, std::move(sequence));
    return reused;
}

int64_t KvCacheManager::attach_cached_prefix(Sequence& sequence, std::span<const int32_t> tokens,
                                             int64_t alignment) {
    if (alignment < 1) fail("KvCacheManager::add_sequence: alignment {} must be at least 1", alignment);
    const int64_t block = std::lcm(layout_.block_tokens(), alignment);
    // At least one token must be computed, so the sequence has logits to sample from.
    const int64_t longest = tokens.empty() ? 0 : (int64_t(tokens.size()) - 1) / block * block;
    if (longest == 0) return 0;

    // misses[g][i]: pages among the first i of group g that are not cached; a window of pages
    // [a, b) is fully cached when misses[g][b] == misses[g][a]. Makes each candidate O(groups).
    const size_t n_groups = layout_.groups.size();
    std::vector<std::vector<int32_t>> found(n_groups);
    std::vector<std::vector<int64_t>> misses(n_groups);
    for (size_t g = 0; g < n_groups; ++g) {
        const int64_t per_page = layout_.groups[g].tokens_per_page;
        extend_hashes(sequence, g, tokens, longest);
        const std::vector<uint64_t>& hashes = sequence.hashes[g];
        misses[g].push_back(0);
        for (size_t i = 0; i < hashes.size(); ++i) {
            found[g].push_back(lookup(int(g), int64_t(i), hashes[i], sequence.check_hashes[g][i],
                                      tokens.subspan(i * size_t(per_page), size_t(per_page))));
            misses[g].push_back(misses[g].back() + (found[g].back() < 0 ? 1 : 0));
        }
    }
    auto usable = [&](int64_t length) {
        for (size_t g = 0; g < n_groups; ++g) {
            // Full groups need every page of the prefix; sliding groups only those the next
            // query's window reaches (the same pages commit() would have kept).
            const size_t end = size_t(length / layout_.groups[g].tokens_per_page);
            const size_t begin = size_t(released_pages(g, length));
            if (misses[g][end] != misses[g][begin]) return false;
        }
        return true;
    };
    int64_t length = longest;
    while (length > 0 && !usable(length)) length -= block;

    for (size_t g = 0; g < n_groups; ++g) {
        const int64_t end = length / layout_.groups[g].tokens_per_page;
        std::vector<int32_t>& table = sequence.tables[g];
        table.assign(size_t(end), -1);
        for (int64_t i = released_pages(g, length); i < end; ++i) {
            share(found[g][size_t(i)]);
            table[size_t(i)] = found[g][size_t(i)];
        }
        sequence.hashes[g].resize(size_t(end));  // hashes of the full committed pages only
        sequence.check_hashes[g].resize(size_t(end));
    }
    return length;
}

int64_t KvCacheManager::pages_needed(int seq, int64_t n_tokens) const {
    const Sequence& sequence = find_sequence(seq, "pages_needed");
    if (n_tokens < 0) fail("KvCacheManager::pages_needed: sequence {}: negative token count {}", seq, n_tokens);
    int64_t needed = 0;
    for (size_t g = 0; g < layout_.groups.size(); ++g)
        needed += std::max<int64_t>(0, layout_.pages_for(int(g), n_tokens) - int64_t(sequence.tables[g].size()));
    return needed;
}

bool KvCacheManager::allocate(int seq, int64_t n_tokens) {
    Sequence& sequence = find_sequence(seq, "allocate");
    if (n_tokens < 0) fail("KvCacheManager::allocate: sequence {}: negative token count {}", seq, n_tokens);
    if (n_tokens <= sequence.allocated) return true;
    // Checked up front so a short pool changes nothing (all groups or none).
    if (pages_needed(seq, n_tokens) > free_pages()) return false;
    for (size_t g = 0; g < layout_.groups.size(); ++g) {
        // New slots lie past the committed length, hence past every released slot: all need pages.
        const size_t target = size_t(layout_.pages_for(int(g), n_tokens));
        while (sequence.tables[g].size() < target) sequence.tables[g].push_back(take_page());
    }
    sequence.allocated = n_tokens;
    return true;
}

void KvCacheManager::commit(int seq, std::span<const int32_t> tokens, int64_t n_committed) {
    Sequence& sequence = find_sequence(seq, "commit");
    if (n_committed < sequence.committed)
        fail("KvCacheManager::commit: sequence {}: n_committed {} is below its committed length {}", seq, n_committed,
             sequence.committed);
    if (n_committed > sequence.allocated)
        fail("KvCacheManager::commit: sequence {}: n_committed {} exceeds its allocated length {}", seq, n_committed,
             sequence.allocated);
    if (int64_t(tokens.size()) < n_committed)
        fail("KvCacheManager::commit: sequence {}: {} tokens given for n_committed {}", seq, tokens.size(),
             n_committed);
    const int64_t previous_committed = sequence.committed;
    sequence.committed = n_committed;
    for (size_t g = 0; g < layout_.groups.size(); ++g) {
        std::vector<int32_t>& table = sequence.tables[g];
        if (prefix_caching_) {
            // Register before releasing, so a page both filled and left behind by this commit
            // stays reusable (evictable) instead of going straight back to the free stack.
            const size_t first_new = sequence.hashes[g].size();
            extend_hashes(sequence, g, tokens, n_committed);
            const std::vector<uint64_t>& hashes = sequence.hashes[g];
            const size_t per_page = size_t(layout_.groups[g].tokens_per_page);
            for (size_t i = first_new; i < hashes.size(); ++i) {
                // Another page may already hold this content (computed twice, e.g. by two
                // sequences admitted together); keep that one, ours is freed when unreferenced.
                if (cached_.count(hashes[i]) != 0) continue;
                register_page(table[i], int(g), int64_t(i), hashes[i], sequence.check_hashes[g][i],
                              tokens.subspan(i * per_page, per_page));
            }
        }
        const int64_t release_end = released_pages(g, n_committed);
        for (int64_t i = released_pages(g, previous_committed); i < release_end; ++i) {
            unref(table[size_t(i)]);
            table[size_t(i)] = -1;
        }
    }
}

void KvCacheManager::extend_hashes(Sequence& sequence, size_t group, std::span<const int32_t> tokens,
                                   int64_t n_tokens) const {
    std::vector<uint64_t>& hashes = sequence.hashes[group];
    std::vector<uint64_t>& check_hashes = sequence.check_hashes[group];
    const size_t per_page = size_t(layout_.groups[group].tokens_per_page);
    const size_t full_pages = size_t(n_tokens) / per_page;
    while (hashes.size() < full_pages) {
        const std::span<const int32_t> page_tokens = tokens.subspan(hashes.size() * per_page, per_page);
        const uint64_t previous = hashes.empty() ? 0 : hashes.back();
        const uint64_t previous_check = check_hashes.empty() ? 0 : check_hashes.back();
        hashes.push_back(page_hash_fn_(previous, int(group), page_tokens));
        check_hashes.push_back(check_page_hash(previous_check, int(group), page_tokens));
    }
}

void KvCacheManager::truncate(int seq, int64_t n_tokens) {
    Sequence& sequence = find_sequence(seq, "truncate");
    if (n_tokens < sequence.committed)
        fail("KvCacheManager::truncate: sequence {}: n_tokens {} is below its committed length {}", seq, n_tokens,
             sequence.committed);
    if (n_tokens > sequence.allocated)
        fail("KvCacheManager::truncate: sequence {}: n_tokens {} exceeds its allocated length {} (use allocate)", seq,
             n_tokens, sequence.allocated);
    for (size_t g = 0; g < layout_.groups.size(); ++g) {
        // Trailing pages hold only uncommitted tokens: never released, never registered.
        std::vector<int32_t>& table = sequence.tables[g];
        const size_t keep = size_t(layout_.pages_for(int(g), n_tokens));
        while (table.size() > keep) {
            unref(table.back());
            table.pop_back();
        }
    }
    sequence.allocated = n_tokens;
}

void KvCacheManager::free_sequence(int seq) {
    Sequence& sequence = find_sequence(seq, "free_sequence");
    for (const std::vector<int32_t>& table : sequence.tables) {
        // Tail first, so the LRU list evicts a prefix's end before its start (vLLM does the same):
        // the start is what other prompts are most likely to share.
        for (auto it = table.rbegin(); it != table.rend(); ++it)
            if (*it >= 0) unref(*it);
    }
    sequences_.erase(seq);
}

int64_t KvCacheManager::allocated_tokens(int seq) const { return find_sequence(seq, "allocated_tokens").allocated; }

int64_t KvCacheManager::committed_tokens(int seq) const { return find_sequence(seq, "committed_tokens").committed; }

const std::vector<int32_t>& KvCacheManager::page_table(int seq, int group) const {
    const Sequence& sequence = find_sequence(seq, "page_table");
    if (group < 0 || size_t(group) >= sequence.tables.size())
        fail("KvCacheManager::page_table: sequence {}: group {} out of range (layout has {} groups)", seq, group,
             sequence.tables.size());
    return sequence.tables[size_t(group)];
}

int32_t KvCacheManager::page_ref_count(int32_t page) const {
    if (page < 0 || page >= n_pages_) fail("KvCacheManager::page_ref_count: page {} out of [0, {})", page, n_pages_);
    return ref_count_[size_t(page)];
}

bool KvCacheManager::page_cached(int32_t page) const {
    if (page < 0 || page >= n_pages_) fail("KvCacheManager::page_cached: page {} out of [0, {})", page, n_pages_);
    return registered_[size_t(page)] != 0;
}

// ---- pages -----------------------------------------------------------------------------------

int32_t KvCacheManager::lookup(int group, int64_t position, uint64_t hash, uint64_t check_hash,
                               std::span<const int32_t> page_tokens) const {
    auto it = cached_.find(hash);
    if (it == cached_.end()) return -1;
    const size_t page = size_t(it->second);
    const std::vector<int32_t>& stored = page_tokens_[page];
    const bool same = page_group_[page] == group && page_position_[page] == position &&
                      page_check_hash_[page] == check_hash &&
                      std::equal(stored.begin(), stored.end(), page_tokens.begin(), page_tokens.end());
    return same ? it->second : -1;
}

void KvCacheManager::register_page(int32_t page, int group, int64_t position, uint64_t hash, uint64_t check_hash,
                                   std::span<const int32_t> page_tokens) {
    const size_t index = size_t(page);
    XINFER_CHECK(page >= 0 && !registered_[index] && ref_count_[index] > 0,
                 "registering page {} (group {}, position {}): registered {} ref {}", page, group, position,
                 int(page >= 0 && registered_[index]), page >= 0 ? ref_count_[index] : -1);
    registered_[index] = 1;
    page_hash_[index] = hash;
    page_check_hash_[index] = check_hash;
    page_group_[index] = group;
    page_position_[index] = position;
    page_tokens_[index].assign(page_tokens.begin(), page_tokens.end());
    cached_.emplace(hash, page);
}

void KvCacheManager::unregister_page(int32_t page) {
    const size_t index = size_t(page);
    cached_.erase(page_hash_[index]);
    registered_[index] = 0;
    page_group_[index] = -1;
    page_position_[index] = -1;
    page_tokens_[index].clear();
}

int32_t KvCacheManager::take_page() {
    int32_t page = -1;
    if (!free_.empty()) {
        page = free_.back();
        free_.pop_back();
    } else {
        // Callers check free_pages() first, so an empty LRU list here is a bookkeeping bug.
        XINFER_CHECK(lru_head_ >= 0, "no free or evictable page left ({} pages)", n_pages_);
        page = lru_head_;
        lru_remove(page);
        unregister_page(page);
    }
    ref_count_[size_t(page)] = 1;
    return page;
}

void KvCacheManager::share(int32_t page) {
    if (ref_count_[size_t(page)] == 0) lru_remove(page);
    ++ref_count_[size_t(page)];
}

void KvCacheManager::unref(int32_t page) {
    XINFER_CHECK(page >= 0 && ref_count_[size_t(page)] > 0, "unref of page {} with ref count {}", page,
                 page >= 0 ? ref_count_[size_t(page)] : 0);
    if (--ref_count_[size_t(page)] > 0) return;
    // Registered content stays reusable until the pool needs the page; the rest is plain free.
    if (registered_[size_t(page)])
        lru_push_back(page);
    else
        free_.push_back(page);
}

void KvCacheManager::lru_push_back(int32_t page) {
    const size_t index = size_t(page);
    lru_prev_[index] = lru_tail_;
    lru_next_[index] = -1;
    if (lru_tail_ >= 0)
        lru_next_[size_t(lru_tail_)] = page;
    else
        lru_head_ = page;
    lru_tail_ = page;
    in_lru_[index] = 1;
    ++lru_size_;
}

void KvCacheManager::lru_remove(int32_t page) {
    const size_t index = size_t(page);
    const int32_t prev = lru_prev_[index], next = lru_next_[index];
    if (prev >= 0)
        lru_next_[size_t(prev)] = next;
    else
        lru_head_ = next;
    if (next >= 0)
        lru_prev_[size_t(next)] = prev;
    else
        lru_tail_ = prev;
    lru_prev_[index] = lru_next_[index] = -1;
    in_lru_[index] = 0;
    --lru_size_;
}

// ---- integrity -------------------------------------------------------------------------------

void KvCacheManager::check_sequence(int seq, const Sequence& sequence, std::vector<int32_t>& refs) const {
    const size_t n_groups = layout_.groups.size();
    if (sequence.committed < 0 || sequence.committed > sequence.allocated)
        fail("KvCacheManager integrity: sequence {}: committed {} not in [0, allocated {}]", seq, sequence.committed,
             sequence.allocated);
    if (sequence.tables.size() != n_groups || sequence.hashes.size() != n_groups ||
        sequence.check_hashes.size() != n_groups)
        fail("KvCacheManager integrity: sequence {}: {} tables and {}/{} hash lists for {} groups", seq,
             sequence.tables.size(), sequence.hashes.size(), sequence.check_hashes.size(), n_groups);
    std::unordered_set<int32_t> pages_of_sequence;
    for (size_t g = 0; g < n_groups; ++g) {
        const std::vector<int32_t>& table = sequence.tables[g];
        const int64_t per_page = layout_.groups[g].tokens_per_page;
        const int64_t expected_slots = layout_.pages_for(int(g), sequence.allocated);
        if (int64_t(table.size()) != expected_slots)
            fail("KvCacheManager integrity: sequence {} group {}: {} slots for {} allocated tokens (expected {})", seq,
                 g, table.size(), sequence.allocated, expected_slots);
        const int64_t expected_hashes = prefix_caching_ ? sequence.committed / per_page : 0;
        if (int64_t(sequence.hashes[g].size()) != expected_hashes ||
            sequence.check_hashes[g].size() != sequence.hashes[g].size())
            fail(
                "KvCacheManager integrity: sequence {} group {}: {} page hashes ({} check hashes) for {} committed "
                "tokens (expected {})",
                seq, g, sequence.hashes[g].size(), sequence.check_hashes[g].size(), sequence.committed,
                expected_hashes);
        const int64_t released = released_pages(g, sequence.committed);
        for (size_t i = 0; i < table.size(); ++i) {
            const int32_t page = table[i];
            if (int64_t(i) < released) {
                if (page != -1)
                    fail(
                        "KvCacheManager integrity: sequence {} group {} slot {}: holds page {} but lies before the "
                        "window (first {} slots are released at committed {})",
                        seq, g, i, page, released, sequence.committed);
                continue;
            }
            if (page < 0 || page >= n_pages_)
                fail("KvCacheManager integrity: sequence {} group {} slot {}: page {} out of [0, {})", seq, g, i, page,
                     n_pages_);
            if (!pages_of_sequence.insert(page).second)
                fail("KvCacheManager integrity: sequence {} group {} slot {}: page {} appears twice in the sequence",
                     seq, g, i, page);
            ++refs[size_t(page)];
            if (!registered_[size_t(page)]) continue;
            // A registered page holds exactly this sequence's committed tokens of this slot.
            const bool committed_page = int64_t(i + 1) * per_page <= sequence.committed;
            if (page_group_[size_t(page)] != int(g) || page_position_[size_t(page)] != int64_t(i) || !committed_page ||
                sequence.hashes[g][i] != page_hash_[size_t(page)] ||
                sequence.check_hashes[g][i] != page_check_hash_[size_t(page)])
                fail(
                    "KvCacheManager integrity: sequence {} group {} slot {}: cached page {} (group {}, position {}) "
                    "does not hold this slot's committed tokens (committed {})",
                    seq, g, i, page, page_group_[size_t(page)], page_position_[size_t(page)], sequence.committed);
        }
    }
}

void KvCacheManager::check_integrity() const {
    const size_t count = size_t(n_pages_);
    std::vector<int32_t> refs(count, 0);
    for (const auto& [seq, sequence] : sequences_) check_sequence(seq, sequence, refs);

    enum : char { kUnseen, kFree, kEvictable };
    std::vector<char> state(count, kUnseen);
    for (int32_t page : free_) {
        if (page < 0 || page >= n_pages_) fail("KvCacheManager integrity: free list holds page {} out of range", page);
        if (state[size_t(page)] != kUnseen) fail("KvCacheManager integrity: page {} is on the free list twice", page);
        state[size_t(page)] = kFree;
        if (registered_[size_t(page)]) fail("KvCacheManager integrity: free page {} is still registered", page);
    }
    int64_t listed = 0;
    int32_t previous = -1;
    for (int32_t page = lru_head_; page >= 0; page = lru_next_[size_t(page)]) {
        if (page >= n_pages_ || ++listed > n_pages_)
            fail("KvCacheManager integrity: LRU list is corrupt at page {} after {} entries", page, listed);
        if (state[size_t(page)] != kUnseen)
            fail("KvCacheManager integrity: page {} is on the LRU list and {}", page,
                 state[size_t(page)] == kFree ? "on the free list" : "on the LRU list twice");
        state[size_t(page)] = kEvictable;
        if (lru_prev_[size_t(page)] != previous || !in_lru_[size_t(page)])
            fail("KvCacheManager integrity: LRU links of page {} are broken", page);
        if (!registered_[size_t(page)]) fail("KvCacheManager integrity: evictable page {} is not registered", page);
        previous = page;
    }
    if (listed != lru_size_ || lru_tail_ != previous)
        fail("KvCacheManager integrity: LRU list has {} entries ending at {}, expected {} ending at {}", listed,
             previous, lru_size_, lru_tail_);

    int64_t n_registered = 0;
    for (size_t page = 0; page < count; ++page) {
        if (ref_count_[page] != refs[page])
            fail("KvCacheManager integrity: page {} has ref count {} but {} page-table slots point at it", page,
                 ref_count_[page], refs[page]);
        if (ref_count_[page] > 0 && state[page] != kUnseen)
            fail("KvCacheManager integrity: page {} is referenced {} times yet {}", page, ref_count_[page],
                 state[page] == kFree ? "free" : "evictable");
        if (ref_count_[page] == 0 && state[page] == kUnseen)
            fail("KvCacheManager integrity: page {} is lost (unreferenced, neither free nor evictable)", page);
        if (bool(in_lru_[page]) != (state[page] == kEvictable))
            fail("KvCacheManager integrity: page {} LRU flag {} disagrees with the list", page, int(in_lru_[page]));
        // Only prefix hits share pages, and only cached pages can be hit.
        if (ref_count_[page] > 1 && !registered_[page])
            fail("KvCacheManager integrity: page {} is shared by {} slots but not registered", page, ref_count_[page]);
        if (!registered_[page]) continue;
        ++n_registered;
        const int group = page_group_[page];
        auto it = cached_.find(page_hash_[page]);
        if (it == cached_.end() || it->second != int32_t(page))
            fail("KvCacheManager integrity: registered page {} is not what the cache maps its hash to", page);
        if (group < 0 || size_t(group) >= layout_.groups.size() ||
            int64_t(page_tokens_[page].size()) != layout_.groups[size_t(group)].tokens_per_page ||
            page_position_[page] < 0)
            fail("KvCacheManager integrity: registered page {} has group {}, position {} and {} tokens", page, group,
                 page_position_[page], page_tokens_[page].size());
    }
    if (int64_t(cached_.size()) != n_registered)
        fail("KvCacheManager integrity: the prefix cache maps {} hashes but {} pages are registered", cached_.size(),
             n_registered);
    if (!prefix_caching_ && n_registered != 0)
        fail("KvCacheManager integrity: {} pages registered with prefix caching off", n_registered);
}

}  // namespace xinfer
