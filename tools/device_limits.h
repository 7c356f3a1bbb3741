// Limits of a device measured in the running process, for the figures the CLI prints next to
// them: the time of one op, and the matmul rate (ops-test --perf, bench).
#pragma once

#include "backend/backend.h"

#include <string>

namespace xinfer::cli {

double now_seconds();

// "matmul(T=1, N=7)" + "bf16" → "matmul(T=1, N=7, act=bf16)"
std::string with_activation(const std::string& description, const std::string& activation);

// Milliseconds per run of `op`: one warm-up, one run to size the loop, then enough runs for
// about `target_seconds`, timed with the backend's events when it has them (device time),
// else with the host clock around a synchronize.
double time_op(Backend& backend, const xinfer_op& op, double target_seconds, int* iterations_out);

struct MatmulPeak {
    double tflops = 0;
    std::string what;  // the matmul timed
};
// A large bf16-weight matmul through the backend: 8192³ on accelerators, 1024³ on host-memory
// backends (the CPU's time for a larger one would dominate a benchmark).
MatmulPeak measure_matmul_peak(Backend& device);

}  // namespace xinfer::cli
