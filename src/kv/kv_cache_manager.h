// KvCacheManager: page tables of every sequence in every layer group over one PagePool, with
// sliding-window release and an optional content-hashed prefix cache. Pure host bookkeeping;
// the runtime owns the pool's memory and turns page tables into AttentionBatch tensors.
// Not thread-safe: one owner (the scheduler) calls it; copies are independent.
//
// Invariants (checked by check_integrity() after every operation in the tests):
//  - every page is exactly one of: free, or referenced by ≥ 1 (sequence, group, slot), or
//    cached-and-evictable (ref 0, registered in the prefix cache, on the LRU list);
//  - a page's ref count equals the number of page-table slots pointing at it;
//  - a sequence's page table for group g has exactly pages_for(g, allocated tokens) slots;
//    slots of sliding groups below the release point are -1, all others are valid pages;
//  - only full pages of *committed* tokens are registered in the prefix cache, each hash once;
//    a registered page in a page table holds exactly that slot's committed tokens;
//  - only registered pages are shared (ref > 1), and no page appears twice in one sequence.
//
// Sliding release: with `committed` tokens computed, the next query is at position
// ≥ committed and needs keys ≥ committed - window + 1, so every page whose tokens all lie
// below that key, i.e. (i+1)·tokens_per_page ≤ committed - window + 1, is released (returned
// to the pool, or kept evictable if registered in the prefix cache).
// Releases follow the committed length only, so rolling speculative tokens back (truncate to a
// length ≥ committed) never needs a released page.
//
// Prefix cache: page i of group g is identified by a chained hash of all tokens in
// [0, (i+1)·tokens_per_page_g) (the chain makes the hash cover the whole prefix). A new
// sequence reuses the longest prefix L (a multiple of layout.block_tokens(), at most
// len(tokens) - 1 so at least one token is computed) such that, for every full group, all
// pages covering [0, L) are cached, and for every sliding group the pages covering
// [max(0, L - window + 1), L) are. Reused pages are shared (ref count + 1), never written:
// the new sequence writes only positions ≥ L, which lie on fresh pages because L is a page
// boundary of every group. Pages are evicted least recently released first; a finished
// sequence releases its pages tail first, so a shared prompt's start outlives its end.
#pragma once

#include "kv/kv_layout.h"

#include <cstdint>
#include <functional>
#include <span>
#include <unordered_map>
#include <vector>

namespace xinfer {

class KvCacheManager {
public:
    // Hash of one page in the chain: (hash of the previous page or 0, group index, the page's
    // token ids) → 64 bits; it picks the cache bucket. Injectable so tests can force collisions.
    // The default mixes every token through a bijective 64-bit finalizer, so prefixes differing
    // in one token never collide. A hit is verified independently of it (see page_check_hash_).
    using PageHashFn = std::function<uint64_t(uint64_t previous_hash, int group, std::span<const int32_t> tokens)>;
    static uint64_t default_page_hash(uint64_t previous_hash, int group, std::span<const int32_t> tokens);

    KvCacheManager(KvLayout layout, int64_t n_pages, bool enable_prefix_caching, PageHashFn page_hash = {});

    const KvLayout& layout() const { return layout_; }
    int64_t n_pages() const { return n_pages_; }
    int64_t free_pages() const;                            // free + evictable
    int64_t evictable_pages() const { return lru_size_; }  // cached, unreferenced
    bool prefix_caching() const { return prefix_caching_; }

    // Starts a sequence. With prefix caching, attaches the longest cached prefix of `tokens`
    // and returns its length (tokens the caller does not need to compute); else 0. The length is
    // a multiple of `alignment` too (a drafter's own cache granularity, see Drafter::prefix_cache_block).
    int64_t add_sequence(int seq, std::span<const int32_t> tokens, int64_t alignment = 1);
    // Pages `seq` would need to grow to `n_tokens` (0 if it already has them).
    int64_t pages_needed(int seq, int64_t n_tokens) const;
    // Grows `seq` to hold tokens [0, n_tokens). False (and no change) if the pool is short.
    // n_tokens at or below the allocated length is a no-op that returns true (use truncate to shrink).
    bool allocate(int seq, int64_t n_tokens);
    // Tokens [0, n_committed) of `seq` are computed and final (`tokens` holds at least those):
    // registers newly full pages in the prefix cache and releases pages outside every window.
    void commit(int seq, std::span<const int32_t> tokens, int64_t n_committed);
    // Speculative rollback: shrinks `seq` to n_tokens (≥ its committed length).
    void truncate(int seq, int64_t n_tokens);
    // Ends a sequence (finish, abort or preemption): all its pages are unreferenced at once.
    void free_sequence(int seq);

    bool has_sequence(int seq) const { return sequences_.count(seq) != 0; }
    int64_t allocated_tokens(int seq) const;
    int64_t committed_tokens(int seq) const;
    // Page table of `seq` in `group`: physical page per logical page, -1 where released.
    const std::vector<int32_t>& page_table(int seq, int group) const;

    // Per-page state, for tests and debug dumps.
    int32_t page_ref_count(int32_t page) const;
    bool page_cached(int32_t page) const;  // registered in the prefix cache (referenced or evictable)

    // Prefix-cache statistics.
    int64_t prefix_queries() const { return prefix_queries_; }  // tokens looked up
    int64_t prefix_hits() const { return prefix_hits_; }        // tokens reused

    void check_integrity() const;  // throws Error describing the first violated invariant

private:
    struct Sequence {
        int64_t allocated = 0;
        int64_t committed = 0;
        std::vector<std::vector<int32_t>> tables;         // [group] → pages
        std::vector<std::vector<uint64_t>> hashes;        // [group] → chained hash per full committed page
        std::vector<std::vector<uint64_t>> check_hashes;  // [group] → the verification chain, same pages
    };
    Sequence& find_sequence(int seq, const char* method);
    const Sequence& find_sequence(int seq, const char* method) const;
    // Logical pages of sliding group g entirely before the window of the next query after `committed`.
    int64_t released_pages(size_t group, int64_t committed) const;
    // The cached page that is logical page `position` of `group` with these chain hashes and
    // tokens; -1 if there is none (or only a colliding one).
    int32_t lookup(int group, int64_t position, uint64_t hash, uint64_t check_hash,
                   std::span<const int32_t> page_tokens) const;
    // Extends both hash chains of `sequence` in `group` over the full pages of tokens [0, n_tokens).
    void extend_hashes(Sequence& sequence, size_t group, std::span<const int32_t> tokens, int64_t n_tokens) const;
    // Longest usable cached prefix of `tokens` that is a multiple of `alignment`: attaches its
    // pages to `sequence`, returns its length.
    int64_t attach_cached_prefix(Sequence& sequence, std::span<const int32_t> tokens, int64_t alignment);
    void register_page(int32_t page, int group, int64_t position, uint64_t hash, uint64_t check_hash,
                       std::span<const int32_t> page_tokens);
    void unregister_page(int32_t page);
    int32_t take_page();       // a free page, else evicts the least recently used cached one
    void share(int32_t page);  // one more reference to a cached page (leaves the LRU list)
    void unref(int32_t page);
    void lru_push_back(int32_t page);
    void lru_remove(int32_t page);
    void check_sequence(int seq, const Sequence& sequence, std::vector<int32_t>& refs) const;

    KvLayout layout_;
    int64_t n_pages_;
    bool prefix_caching_;
    PageHashFn page_hash_fn_;
    std::vector<int32_t> ref_count_;  // [page]
    std::vector<int32_t> free_;       // stack of free, unregistered pages
    // Prefix-cache registration, per page. A hit must match the bucket hash, group, logical
    // position, the page's own tokens and a second, fixed 64-bit chain over the whole prefix
    // (independent of page_hash_fn_). Sliding groups check only the window's pages, so the
    // earlier tokens are vouched for by the chains alone: a false hit needs both to collide.
    std::vector<char> registered_;                   // [page]
    std::vector<uint64_t> page_hash_;                // [page] registered hash (valid if registered_)
    std::vector<uint64_t> page_check_hash_;          // [page] verification chain hash
    std::vector<int> page_group_;                    // [page] group of a registered page
    std::vector<int64_t> page_position_;             // [page] logical page index of a registered page
    std::vector<std::vector<int32_t>> page_tokens_;  // [page] token ids of a registered page
    std::unordered_map<uint64_t, int32_t> cached_;   // hash → page (the hash is group-salted)
    // Evictable pages as an index-linked list (least recent at the head), so the manager stays
    // copyable and movable, which a std::list plus stored iterators would not be.
    std::vector<int32_t> lru_prev_, lru_next_;  // [page], -1 at the ends / when not listed
    std::vector<char> in_lru_;                  // [page]
    int32_t lru_head_ = -1, lru_tail_ = -1;
    int64_t lru_size_ = 0;
    std::unordered_map<int, Sequence> sequences_;
    int64_t prefix_queries_ = 0, prefix_hits_ = 0;
};

}  // namespace xinfer
