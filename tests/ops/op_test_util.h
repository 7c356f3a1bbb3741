// Helpers for op tests: device tensors made from host vectors, NaN-poisoned outputs, seeded
// random data, dtype rounding for references, and the relative-error comparison of DESIGN.md
// (max|got - want| / max|want|; any NaN fails).
#pragma once

#include "backend/backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace xinfer::test {

inline Backend& cpu_backend() {
    static std::unique_ptr<Backend> backend = make_backend("cpu");
    return *backend;
}

// The ABI's optional fused ops, which a backend may refuse (supports_op 0) for Backend to run the
// ops each stands for.
inline bool optional_fused_op(int type) {
    return type == XINFER_OP_ROPE_KV_STORE || type == XINFER_OP_ADD_RMSNORM_MATMUL || type == XINFER_OP_MOE_ROUTE_EXPERTS;
}

// The CPU's table with the optional fused ops refused (supports_op 0, run_op an error), as a
// plugin without them answers: Backend must then run their ops itself.
inline const xinfer_backend_api* unfused_cpu_api() {
    static xinfer_backend_api api = [] {
        xinfer_backend_api a = *cpu_backend_api();
        a.supports_op = [](void* ctx, const xinfer_op* op) {
            return optional_fused_op(op->type) ? 0 : cpu_backend_api()->supports_op(ctx, op);
        };
        a.run_op = [](void* ctx, const xinfer_op* op) {
            return optional_fused_op(op->type) ? int(XINFER_ERROR) : cpu_backend_api()->run_op(ctx, op);
        };
        return a;
    }();
    return &api;
}

// An allocation on the backend and a view of it.
struct DeviceTensor {
    Buffer buffer;
    Tensor tensor;
    operator const Tensor&() const { return tensor; }
};

inline DeviceTensor device_empty(DType dtype, std::initializer_list<int64_t> dims, Backend& backend = cpu_backend()) {
    DeviceTensor t;
    t.tensor = Tensor(nullptr, dtype, dims);
    t.buffer = backend.alloc(t.tensor.nbytes());
    t.tensor.data = t.buffer.data();
    return t;
}

// f32 values stored as `dtype` (rounded on the host) on the device.
inline DeviceTensor device_from(const std::vector<float>& values, DType dtype, std::initializer_list<int64_t> dims,
                                Backend& backend = cpu_backend()) {
    DeviceTensor t = device_empty(dtype, dims, backend);
    EXPECT_EQ(int64_t(values.size()), t.tensor.numel());
    std::vector<char> host(t.tensor.nbytes());
    convert_from_f32(values.data(), dtype, host.data(), int64_t(values.size()));
    backend.upload(t.tensor, host.data());
    return t;
}

inline DeviceTensor device_from_i32(const std::vector<int32_t>& values, std::initializer_list<int64_t> dims,
                                    Backend& backend = cpu_backend()) {
    DeviceTensor t = device_empty(DType::i32, dims, backend);
    EXPECT_EQ(int64_t(values.size()), t.tensor.numel());
    backend.upload(t.tensor, values.data());
    return t;
}

// Outputs start as NaN so an element the kernel forgets to write fails the comparison.
inline DeviceTensor device_poisoned(std::initializer_list<int64_t> dims, Backend& backend = cpu_backend()) {
    return device_from(
        std::vector<float>(size_t(Tensor(nullptr, DType::f32, dims).numel()), std::numeric_limits<float>::quiet_NaN()),
        DType::f32, dims, backend);
}

inline std::vector<float> to_host(const Tensor& t, Backend& backend = cpu_backend()) {
    std::vector<char> raw(t.nbytes());
    backend.download(t, raw.data());
    std::vector<float> values(size_t(t.numel()));
    convert_to_f32(t.dtype, raw.data(), values.data(), t.numel());
    return values;
}

inline std::vector<int32_t> to_host_i32(const Tensor& t, Backend& backend = cpu_backend()) {
    std::vector<int32_t> values(size_t(t.numel()));
    backend.download(t, values.data());
    return values;
}

inline std::vector<float> random_vector(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
}

// The values a reference must use once `values` are stored as `dtype`.
inline std::vector<float> rounded(const std::vector<float>& values, DType dtype) {
    std::vector<char> raw(dtype_row_bytes(dtype, int64_t(values.size())));
    convert_from_f32(values.data(), dtype, raw.data(), int64_t(values.size()));
    std::vector<float> out(values.size());
    convert_to_f32(dtype, raw.data(), out.data(), int64_t(values.size()));
    return out;
}

// max|got - want| / max|want|; +inf if got has a NaN or the sizes differ.
inline double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
    if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
    double max_diff = 0.0, max_ref = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i])) return std::numeric_limits<double>::infinity();
        max_diff = std::max(max_diff, std::abs(double(got[i]) - want[i]));
        max_ref = std::max(max_ref, std::abs(want[i]));
    }
    return max_ref == 0.0 ? max_diff : max_diff / max_ref;
}

#define EXPECT_CLOSE(got, want, threshold, context)                          \
    do {                                                                     \
        const double rel_error_ = ::xinfer::test::relative_error(got, want); \
        EXPECT_LE(rel_error_, threshold) << context;                         \
    } while (0)

// Runs `body` and expects an xinfer::Error whose message contains every one of `needles`.
template <typename Body>
void expect_error(Body&& body, std::initializer_list<std::string> needles) {
    try {
        body();
        ADD_FAILURE() << "expected an xinfer::Error";
    } catch (const Error& e) {
        const std::string message = e.what();
        for (const std::string& needle : needles)
            EXPECT_NE(message.find(needle), std::string::npos) << "'" << needle << "' missing from: " << message;
    }
}

}  // namespace xinfer::test
