// Host-side token sampling from one row of logits (the CPU reference for device samplers).
#pragma once

#include "xinfer/sampling_params.h"

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace xinfer {

// Index of the largest logit (lowest index on ties).
int32_t argmax(std::span<const float> logits);

// Samples one token: temperature → top-k → top-p → draw. temperature 0 is argmax.
class Sampler {
public:
    explicit Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}
    int32_t sample(std::span<const float> logits);
    const SamplingParams& params() const { return params_; }
    bool greedy() const { return params_.temperature <= 0.f; }
    // What sample() draws from (temperature > 0 only): candidate ids and probabilities summing to 1.
    void distribution(std::span<const float> logits, std::vector<int32_t>& ids, std::vector<double>& probs) const;
    // The next number of this sampler's stream, uniform in [0, 1) (24 random bits, as device samplers get it).
    float uniform() { return float(rng_() >> 40) / float(1 << 24); }

private:
    SamplingParams params_;
    std::mt19937_64 rng_;
};

}  // namespace xinfer
