#include "sample/sampler.h"

#include "backend/cpu/cpu_ops.h"
#include "core/status.h"

namespace xinfer {

int32_t argmax(std::span<const float> logits) {
    XINFER_CHECK(!logits.empty(), "argmax of empty logits");
    return cpu::argmax_row(logits.data(), int64_t(logits.size()));
}

int32_t Sampler::sample(std::span<const float> logits) {
    XINFER_CHECK(!logits.empty(), "sampling from empty logits");
    if (params_.temperature <= 0.f) return argmax(logits);
    return cpu::sample_row(logits.data(), int64_t(logits.size()), params_.temperature, params_.top_p, params_.top_k,
                           uniform());
}

void Sampler::distribution(std::span<const float> logits, std::vector<int32_t>& ids, std::vector<double>& probs) const {
    XINFER_CHECK(!logits.empty() && params_.temperature > 0.f, "distribution needs logits and temperature > 0");
    cpu::sampling_distribution(logits.data(), int64_t(logits.size()), params_.temperature, params_.top_p,
                               params_.top_k, ids, probs);
}

}  // namespace xinfer
