// Host-side token sampling from one row of logits (the CPU reference for device samplers).
#pragma once

#include "xinfer/sampling_params.h"

#include <cstdint>
#include <random>
#include <span>

namespace xinfer {

// Index of the largest logit (lowest index on ties).
int32_t argmax(std::span<const float> logits);

// Samples one token: temperature → top-k → top-p → draw. temperature 0 is argmax.
class Sampler {
public:
    explicit Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}
    int32_t sample(std::span<const float> logits);
    const SamplingParams& params() const { return params_; }

private:
    SamplingParams params_;
    std::mt19937_64 rng_;
};

}  // namespace xinfer
