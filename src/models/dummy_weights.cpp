#include "models/dummy_weights.h"

#include "core/status.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace xinfer {
namespace {

constexpr int64_t kDeviceTile = int64_t(1) << 20;  // elements generated on the host per tensor

}  // namespace

std::vector<float> dummy_values(int64_t n, int64_t cols, bool is_norm, uint64_t stream) {
    const float amplitude = is_norm ? 0.1f : 1.f / std::sqrt(float(cols));
    std::vector<float> values(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        uint64_t z = stream + uint64_t(i) * 0x94d049bb133111ebull;  // splitmix64 finaliser
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        const float unit = float(z >> 40) / float(1ull << 24) * 2.f - 1.f;  // [-1, 1)
        values[size_t(i)] = (is_norm ? 1.f : 0.f) + amplitude * unit;
    }
    return values;
}

namespace {

// Uploads the first `generated` elements (host, already in t's dtype) and replicates them over t.
void upload_replicated(Backend& backend, const Tensor& t, const std::vector<uint8_t>& host, int64_t generated) {
    const int64_t n = t.numel();
    const size_t element = dtype_size(t.dtype);
    char* base = static_cast<char*>(t.data);
    backend.upload(Tensor(base, t.dtype, {generated}), host.data());
    // Doubling: [0, filled) → [filled, 2·filled), until the tensor is full.
    for (int64_t filled = generated; filled < n;) {
        const int64_t chunk = std::min(filled, n - filled);
        backend.copy(Tensor(base + filled * int64_t(element), t.dtype, {chunk}), Tensor(base, t.dtype, {chunk}));
        filled += chunk;
    }
    backend.synchronize();  // `host` dies after this; uploads may be stream-ordered
}

int64_t generated_elements(const Backend& backend, int64_t n) {
    return !backend.props().host_memory && n > kDeviceTile ? kDeviceTile : n;
}

}  // namespace

void fill_dummy_weights(Backend& backend, const Tensor& t, bool is_norm, uint64_t stream) {
    const int64_t generated = generated_elements(backend, t.numel());
    const std::vector<float> values = dummy_values(generated, t.cols(), is_norm, stream);
    std::vector<uint8_t> host(size_t(generated) * dtype_size(t.dtype));
    convert_from_f32(values.data(), t.dtype, host.data(), generated);
    upload_replicated(backend, t, host, generated);
}

void fill_dummy_fp8_weights(Backend& backend, const Tensor& weight, const Tensor& scale, uint64_t stream) {
    XINFER_CHECK(weight.dtype == DType::f8_e4m3 && scale.dtype == DType::f32, "fp8 dummy weights: {} weight, {} scale",
                 dtype_name(weight.dtype), dtype_name(scale.dtype));
    const float s = 1.f / std::sqrt(float(weight.cols())) / 448.f;
    const int64_t generated = generated_elements(backend, weight.numel());
    const std::vector<float> values = dummy_values(generated, weight.cols(), false, stream);
    std::vector<uint8_t> host(static_cast<size_t>(generated));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < generated; ++i) host[size_t(i)] = f32_to_f8_e4m3(values[size_t(i)] / s);
    upload_replicated(backend, weight, host, generated);
    const std::vector<float> scales(static_cast<size_t>(scale.numel()), s);
    backend.upload(scale, scales.data());
    backend.synchronize();
}

}  // namespace xinfer
