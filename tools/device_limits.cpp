#include "device_limits.h"

#include "backend/op_cases.h"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>

namespace xinfer::cli {

using namespace op_cases;

double now_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string with_activation(const std::string& description, const std::string& activation) {
    if (description.empty() || description.back() != ')') return description + " act=" + activation;
    return description.substr(0, description.size() - 1) + ", act=" + activation + ")";
}

double time_op(Backend& backend, const xinfer_op& op, double target_seconds, int* iterations_out) {
    backend.run(op);
    backend.synchronize();
    const double start = now_seconds();
    backend.run(op);
    backend.synchronize();
    const double single = std::max(now_seconds() - start, 1e-6);
    const int iterations = int(std::clamp(target_seconds / single, 1.0, 1000.0));
    *iterations_out = iterations;
    if (backend.has_events()) {
        void* begin = backend.event_record();
        for (int i = 0; i < iterations; ++i) backend.run(op);
        void* end = backend.event_record();
        const double ms = backend.event_elapsed_ms(begin, end);
        backend.event_destroy(begin);
        backend.event_destroy(end);
        return ms / iterations;
    }
    const double loop_start = now_seconds();
    for (int i = 0; i < iterations; ++i) backend.run(op);
    backend.synchronize();
    return (now_seconds() - loop_start) * 1e3 / iterations;
}

MatmulPeak measure_matmul_peak(Backend& device) {
    const bool host = device.props().host_memory != 0;
    const int64_t n = host ? 1024 : 8192;
    const DType w = DType::bf16;  // the models' weights (the CPU runs them with f32 activations)
    const OpCase c = matmul_case(n, n, n, w, 1);
    const CaseData data = c.build();
    const std::optional<DType> activation = pick_activation(data, device);
    if (!activation) return {0, fmt::format("{}: not supported", c.description)};
    PreparedCase prepared(data, device, *activation, false);
    prepared.reset();
    int iterations = 0;
    const double ms = time_op(device, prepared.op(), 0.5, &iterations);
    return {2.0 * double(n) * double(n) * double(n) / (ms * 1e-3) / 1e12,
            with_activation(c.description, std::string(dtype_name(*activation)))};
}

}  // namespace xinfer::cli
