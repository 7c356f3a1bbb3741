#include "kv/kv_manager.h"

#include "core/status.h"

namespace xinfer {

KvManager::KvManager(int n_groups, int page_size, int64_t pages_per_group)
    : page_size_(page_size), pages_per_group_(pages_per_group), free_(size_t(n_groups)) {
    XINFER_CHECK(page_size > 0 && pages_per_group > 0, "page_size {} pages {}", page_size, pages_per_group);
    for (auto& stack : free_) {
        // Highest first, so pages are handed out 0, 1, 2, ... (easier to read in dumps).
        for (int64_t p = pages_per_group - 1; p >= 0; --p) stack.push_back(int32_t(p));
    }
}

bool KvManager::reserve(int seq, int64_t n_tokens) {
    auto& groups = owned_[seq];
    groups.resize(free_.size());
    const size_t needed = size_t((n_tokens + page_size_ - 1) / page_size_);
    for (size_t g = 0; g < free_.size(); ++g) {
        if (groups[g].size() < needed && free_[g].size() < needed - groups[g].size()) return false;
    }
    for (size_t g = 0; g < free_.size(); ++g) {
        while (groups[g].size() < needed) {
            groups[g].push_back(free_[g].back());
            free_[g].pop_back();
        }
    }
    return true;
}

void KvManager::release(int seq) {
    auto it = owned_.find(seq);
    if (it == owned_.end()) return;
    for (size_t g = 0; g < it->second.size(); ++g) {
        for (int32_t page : it->second[g]) free_[g].push_back(page);
    }
    owned_.erase(it);
}

const std::vector<int32_t>& KvManager::pages(int seq, int group) const {
    auto it = owned_.find(seq);
    XINFER_CHECK(it != owned_.end(), "sequence {} has no KV pages", seq);
    return it->second[size_t(group)];
}

void KvManager::check_integrity() const {
    for (size_t g = 0; g < free_.size(); ++g) {
        std::vector<int> uses(size_t(pages_per_group_), 0);
        for (int32_t page : free_[g]) ++uses[size_t(page)];
        for (const auto& [seq, groups] : owned_) {
            if (g < groups.size())
                for (int32_t page : groups[g]) ++uses[size_t(page)];
        }
        for (size_t p = 0; p < uses.size(); ++p) {
            if (uses[p] != 1) fail("KV group {}: page {} is referenced {} times (expected exactly once)", g, p, uses[p]);
        }
    }
}

}  // namespace xinfer
