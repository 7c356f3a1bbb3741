#include "models/dummy_weights.h"

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

void fill_dummy_weights(Backend& backend, const Tensor& t, bool is_norm, uint64_t stream) {
    const int64_t n = t.numel();
    const bool tiled = !backend.props().host_memory && n > kDeviceTile;
    const int64_t generated = tiled ? kDeviceTile : n;
    const std::vector<float> values = dummy_values(generated, t.cols(), is_norm, stream);
    const size_t element = dtype_size(t.dtype);
    std::vector<uint8_t> host(size_t(generated) * element);
    convert_from_f32(values.data(), t.dtype, host.data(), generated);
    char* base = static_cast<char*>(t.data);
    backend.upload(Tensor(base, t.dtype, {generated}), host.data());
    // Doubling: [0, filled) → [filled, 2·filled), until the tensor is full.
    for (int64_t filled = generated; filled < n;) {
        const int64_t chunk = std::min(filled, n - filled);
        backend.copy(Tensor(base + filled * int64_t(element), t.dtype, {chunk}), Tensor(base, t.dtype, {chunk}));
        filled += chunk;
    }
    backend.synchronize();  // `host` dies here; uploads may be stream-ordered
}

}  // namespace xinfer
