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
    // 24 random bits: uniform in [0, 1) exactly representable in f32, as device samplers get it.
    const float uniform = float(rng_() >> 40) / float(1 << 24);
    return cpu::sample_row(logits.data(), int64_t(logits.size()), params_.temperature, params_.top_p, params_.top_k,
                           uniform);
}

}  // namespace xinfer
