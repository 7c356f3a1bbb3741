#include "spec/verify.h"

#include "core/status.h"

#include <algorithm>
#include <vector>

namespace xinfer {
namespace {

void check_shapes(std::span<const float> logits, int64_t vocab, std::span<const int32_t> drafts) {
    XINFER_CHECK(vocab > 0 && logits.size() == (drafts.size() + 1) * size_t(vocab),
                 "verify: {} logits for {} drafts + 1 rows of vocab {}", logits.size(), drafts.size(), vocab);
}

std::span<const float> row(std::span<const float> logits, int64_t vocab, size_t i) {
    return logits.subspan(i * size_t(vocab), size_t(vocab));
}

// Draws from `probs` over `ids` with token `excluded` removed (the rejection residual).
int32_t draw_without(const std::vector<int32_t>& ids, const std::vector<double>& probs, int32_t excluded,
                     float uniform) {
    double mass = 0;
    for (size_t i = 0; i < ids.size(); ++i)
        if (ids[i] != excluded) mass += probs[i];
    double draw = double(uniform) * mass;
    int32_t last = -1;
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] == excluded) continue;
        last = ids[i];
        draw -= probs[i];
        if (draw < 0) return ids[i];
    }
    XINFER_CHECK(last >= 0, "verify: empty rejection residual");  // p(excluded) = 1 is never rejected
    return last;
}

}  // namespace

Verdict verify_greedy(std::span<const float> logits, int64_t vocab, std::span<const int32_t> drafts) {
    check_shapes(logits, vocab, drafts);
    std::vector<int32_t> target_ids(drafts.size() + 1);
    for (size_t i = 0; i < target_ids.size(); ++i) target_ids[i] = argmax(row(logits, vocab, i));
    return verify_greedy_ids(target_ids, drafts);
}

Verdict verify_greedy_ids(std::span<const int32_t> target_ids, std::span<const int32_t> drafts) {
    XINFER_CHECK(target_ids.size() == drafts.size() + 1, "verify: {} target ids for {} drafts + 1 rows",
                 target_ids.size(), drafts.size());
    size_t accepted = 0;
    while (accepted < drafts.size() && drafts[accepted] == target_ids[accepted]) ++accepted;
    return {int(accepted), target_ids[accepted]};
}

Verdict verify_drafts(std::span<const float> logits, int64_t vocab, std::span<const int32_t> drafts, Sampler& sampler) {
    if (sampler.greedy()) return verify_greedy(logits, vocab, drafts);
    check_shapes(logits, vocab, drafts);
    std::vector<int32_t> ids;
    std::vector<double> probs;
    for (size_t i = 0; i < drafts.size(); ++i) {
        sampler.distribution(row(logits, vocab, i), ids, probs);
        const auto it = std::find(ids.begin(), ids.end(), drafts[i]);
        const double p_draft = it == ids.end() ? 0.0 : probs[size_t(it - ids.begin())];
        // Accept with probability min(1, p/q) = p, q being one-hot on the draft.
        if (double(sampler.uniform()) < p_draft) continue;
        return {int(i), draw_without(ids, probs, drafts[i], sampler.uniform())};
    }
    return {int(drafts.size()), sampler.sample(row(logits, vocab, drafts.size()))};
}

}  // namespace xinfer
