// Page bookkeeping for the KV cache: which physical pages each sequence owns in each layer
// group. Pure host-side state; the runtime owns the cache memory itself.
//
// Invariants: a page is either free or owned by exactly one sequence in its group; a
// sequence's page list for a group covers tokens [0, pages * page_size). (Sliding-window
// page release, one shared pool and prefix sharing belong to the serving-core KV manager.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace xinfer {

class KvManager {
public:
    KvManager(int n_groups, int page_size, int64_t pages_per_group);

    int page_size() const { return page_size_; }
    int64_t pages_per_group() const { return pages_per_group_; }

    // Makes sure `seq` has pages for tokens [0, n_tokens) in every group. Returns false (and
    // allocates nothing) when a group lacks free pages.
    bool reserve(int seq, int64_t n_tokens);
    void release(int seq);
    // Physical pages of `seq` in `group`, in logical order.
    const std::vector<int32_t>& pages(int seq, int group) const;
    int64_t free_pages(int group) const { return int64_t(free_[size_t(group)].size()); }
    // Throws if a page is lost, owned twice, or both owned and free.
    void check_integrity() const;

private:
    int page_size_;
    int64_t pages_per_group_;
    std::vector<std::vector<int32_t>> free_;                          // [group] free page stack
    std::unordered_map<int, std::vector<std::vector<int32_t>>> owned_; // seq → [group] pages
};

}  // namespace xinfer
