#include "faulty_backend.h"

#include "backend/op_desc.h"
#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace xinfer::test {
namespace {

FaultSpec g_spec;
int g_hits = 0;
xinfer_backend_api g_api;  // the CPU table with run_op, name and device_props replaced

// Deterministic noise in [-1, 1) for element i (splitmix64).
float noise(uint64_t i) {
    uint64_t z = i * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return float(z >> 40) / float(1ull << 24) * 2.f - 1.f;
}

// dst += relative · max|dst| · noise, in dst's own dtype (f32, bf16 or f16; host memory).
void perturb(const xinfer_tensor& dst, double relative) {
    int64_t n = 1;
    for (int i = 0; i < dst.rank; ++i) n *= dst.shape[i];
    const DType dtype = DType(dst.dtype);
    std::vector<float> values(static_cast<size_t>(n));
    convert_to_f32(dtype, dst.data, values.data(), n);
    float max_abs = 0;
    for (float v : values) max_abs = std::max(max_abs, std::fabs(v));
    const float amplitude = float(relative) * (max_abs > 0 ? max_abs : 1.f);
    for (int64_t i = 0; i < n; ++i) values[size_t(i)] += amplitude * noise(uint64_t(i));
    convert_from_f32(values.data(), dtype, dst.data, n);
}

int faulty_run_op(void* ctx, const xinfer_op* op) {
    const int status = cpu_backend_api()->run_op(ctx, op);
    if (status == XINFER_OK && op->type == g_spec.op_type && op->layer == g_spec.layer && op->dst[0].data) {
        perturb(op->dst[0], g_spec.relative);
        ++g_hits;
    }
    return status;
}

int faulty_device_props(int device, xinfer_device_props* out) {
    const int status = cpu_backend_api()->device_props(device, out);
    if (status == XINFER_OK) {
        const std::string name = std::string("faulty ") + op_type_name(g_spec.op_type) + " L" +
                                 std::to_string(g_spec.layer) + " over " + out->name;
        std::snprintf(out->name, sizeof(out->name), "%s", name.c_str());
    }
    return status;
}

}  // namespace

const xinfer_backend_api* faulty_backend_api(const FaultSpec& spec) {
    g_spec = spec;
    g_api = *cpu_backend_api();
    g_api.name = "faulty";
    g_api.run_op = faulty_run_op;
    g_api.device_props = faulty_device_props;
    return &g_api;
}

std::unique_ptr<Backend> make_faulty_backend(const FaultSpec& spec) {
    return std::make_unique<Backend>(faulty_backend_api(spec), 0, "faulty");
}

int faulty_backend_hits() { return g_hits; }

}  // namespace xinfer::test

#ifdef XINFER_FAULTY_PLUGIN
// The plugin entry point: the fault comes from the environment (see faulty_backend.h).
extern "C" __attribute__((visibility("default"))) const xinfer_backend_api* xinfer_backend_init(void) {
    xinfer::test::FaultSpec spec;
    if (const char* op = std::getenv("XINFER_FAULTY_OP")) {
        spec.op_type = -1;
        for (int type = 1; type < XINFER_OP_COUNT; ++type)
            if (std::strcmp(op, xinfer::op_type_name(type)) == 0) spec.op_type = type;
        if (spec.op_type < 0) {
            std::fprintf(stderr, "libxinfer-faulty: unknown XINFER_FAULTY_OP '%s'\n", op);
            return nullptr;
        }
    }
    if (const char* layer = std::getenv("XINFER_FAULTY_LAYER")) spec.layer = std::atoi(layer);
    if (const char* relative = std::getenv("XINFER_FAULTY_REL")) spec.relative = std::atof(relative);
    return xinfer::test::faulty_backend_api(spec);
}
#endif
