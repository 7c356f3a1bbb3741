// `xinfer bench --speculative-config JSON` (without --concurrency): what one speculative step
// costs at batch 1 next to a plain decode step — the verify forward over [anchor, d1 … dk],
// the drafter's propose and observe — and the speedup model that follows: tokens/s as a
// function of the mean acceptance length τ (tokens emitted per step, 1 … k + 1).
#pragma once

#include "commands.h"

#include <string>

namespace xinfer::cli {

struct SpecBenchOptions {
    std::string speculative_config;
    int64_t context = 512;  // tokens already in the cache when the steps are timed
    int iterations = 20;    // timed repetitions of each measurement (median reported)
    uint64_t seed = 0;
};

void run_spec_bench(const ModelOptions& model, const SpecBenchOptions& options);

}  // namespace xinfer::cli
