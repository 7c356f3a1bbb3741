#include "sample/sampler.h"

#include "core/status.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace xinfer {

int32_t argmax(std::span<const float> logits) {
    XINFER_CHECK(!logits.empty(), "argmax of empty logits");
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

int32_t Sampler::sample(std::span<const float> logits) {
    if (params_.temperature <= 0.f) return argmax(logits);
    const int64_t vocab = int64_t(logits.size());
    // Candidates sorted by logit, descending; top-k trims the list first.
    std::vector<int32_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    const int64_t k = params_.top_k > 0 ? std::min<int64_t>(params_.top_k, vocab) : vocab;
    auto by_logit = [&](int32_t a, int32_t b) { return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b); };
    std::partial_sort(order.begin(), order.begin() + k, order.end(), by_logit);
    order.resize(size_t(k));

    // Softmax at temperature, in double for a stable tail.
    std::vector<double> probs(order.size());
    const double max_logit = logits[size_t(order[0])];
    double total = 0;
    for (size_t i = 0; i < order.size(); ++i) {
        probs[i] = std::exp((double(logits[size_t(order[i])]) - max_logit) / params_.temperature);
        total += probs[i];
    }
    // Top-p keeps the smallest prefix whose mass reaches top_p (always at least one token).
    size_t keep = probs.size();
    if (params_.top_p < 1.f) {
        double mass = 0;
        for (size_t i = 0; i < probs.size(); ++i) {
            mass += probs[i] / total;
            if (mass >= params_.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    const double kept_total = std::accumulate(probs.begin(), probs.begin() + long(keep), 0.0);
    double draw = std::uniform_real_distribution<double>(0.0, kept_total)(rng_);
    for (size_t i = 0; i < keep; ++i) {
        draw -= probs[i];
        if (draw < 0) return order[i];
    }
    return order[keep - 1];
}

}  // namespace xinfer
