// The backend registry and the CPU backend's memory functions.
#include "op_test_util.h"

#include <cstdint>

namespace xinfer::test {
namespace {

TEST(Backend, MakesTheCpuBackendAndRejectsUnknownDevices) {
    auto backend = make_backend("cpu");
    ASSERT_NE(backend, nullptr);
    EXPECT_EQ(backend->name(), "cpu");
    expect_error([] { make_backend("nosuchaccel"); }, {"libxinfer-nosuchaccel.so", "not found", "XINFER_PLUGIN_PATH"});
    expect_error([] { make_backend("cpu:1"); }, {"cpu:1", "one device"});
    expect_error([] { make_backend("cuda:x"); }, {"cuda:x", "index"});
}

TEST(Backend, AllocIsAlignedAndUploadDownloadRoundTrips) {
    Backend& backend = cpu_backend();
    for (size_t bytes : {size_t(0), size_t(1), size_t(100), size_t(5) << 20}) {
        Buffer buffer = backend.alloc(bytes);
        ASSERT_NE(buffer.data(), nullptr);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % 64, 0u) << bytes << " bytes";
        EXPECT_EQ(buffer.bytes(), bytes);
    }
    const auto values = random_vector(1000, 3);
    DeviceTensor t = device_from(values, DType::f32, {10, 100});
    EXPECT_EQ(to_host(t), values);
    backend.synchronize();
}

TEST(Backend, MeasuresAPlausibleCopyBandwidth) {
    const double gbps = cpu_backend().measure_copy_bandwidth_gbps();
    EXPECT_GT(gbps, 0.5);
    EXPECT_LT(gbps, 10000.0);
}

}  // namespace
}  // namespace xinfer::test
