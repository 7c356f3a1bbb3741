// Prompt lookup ("ngram"): the drafts are whatever followed an earlier occurrence of the
// sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min, longest match
// first). No model, no state: a pure function of the committed tokens. It shines where
// the output copies its input — code edits, JSON echoing a schema, quoting — and proposes
// nothing elsewhere, so it never costs more than the verify rows it adds.
#include "spec/drafter.h"

#include <algorithm>

namespace xinfer {
namespace {

class NgramDrafter final : public Drafter {
public:
    explicit NgramDrafter(const SpeculativeConfig& config) : config_(config) {}

    const char* method() const override { return "ngram"; }
    int num_speculative_tokens() const override { return config_.num_speculative_tokens; }

    std::vector<std::vector<int32_t>> propose(std::span<const DraftRequest> requests) override {
        std::vector<std::vector<int32_t>> drafts;
        drafts.reserve(requests.size());
        for (const DraftRequest& r : requests) drafts.push_back(lookup(r.tokens, std::min(r.max_drafts, num_speculative_tokens())));
        return drafts;
    }

private:
    // Longest n first; among its occurrences the most recent one followed by max_drafts tokens,
    // else the one followed by the most (inside a repeating run the most recent occurrence is
    // followed by a single token, an earlier one by the whole run).
    std::vector<int32_t> lookup(std::span<const int32_t> tokens, int max_drafts) const {
        const int64_t len = int64_t(tokens.size());
        for (int64_t n = std::min<int64_t>(config_.prompt_lookup_max, len - 1); n >= config_.prompt_lookup_min; --n) {
            const std::span<const int32_t> suffix = tokens.subspan(size_t(len - n));
            int64_t best_from = -1, best_count = 0;
            for (int64_t j = len - n - 1; j >= 0 && best_count < max_drafts; --j) {
                if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + j)) continue;
                const int64_t from = j + n, count = std::min<int64_t>(len - from, max_drafts);
                if (count > best_count) best_from = from, best_count = count;
            }
            if (best_count > 0)
                return std::vector<int32_t>(tokens.begin() + best_from, tokens.begin() + best_from + best_count);
        }
        return {};
    }

    SpeculativeConfig config_;
};

}  // namespace

std::unique_ptr<Drafter> make_ngram_drafter(const SpeculativeConfig& config) {
    return std::make_unique<NgramDrafter>(config);
}

}  // namespace xinfer
