// The CUDA backend's ABI table: devices, contexts (one stream + cuBLASLt handle + workspaces),
// memory, copies, the copy-bandwidth probe, op dispatch, graph capture, events and NVTX ranges.
//
// Ownership: a context owns its stream, cuBLASLt handle, workspaces and the graphs/events it
// hands out until they are destroyed through the table. Contexts are not thread-safe (ABI).
// Every entry point makes the context's device current first, so several contexts on different
// devices can be driven from one thread.
#include "common.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define XCUDA_HAVE_NVTX 1
#else
#define XCUDA_HAVE_NVTX 0
#endif

namespace xcuda {

// ---- errors and small helpers --------------------------------------------------------------------

std::string str_format(const char* format, ...) {
    char buffer[1024];
    va_list args;
    va_start(args, format);
    vsnprintf(buffer, sizeof buffer, format, args);
    va_end(args);
    return buffer;
}

void set_error(Context* c, const char* format, ...) {
    char buffer[1024];
    va_list args;
    va_start(args, format);
    vsnprintf(buffer, sizeof buffer, format, args);
    va_end(args);
    c->error = buffer;
}

int cuda_fail(Context* c, cudaError_t err, const char* what) {
    set_error(c, "cuda: %s failed: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
    cudaGetLastError();  // clear a sticky-less error so the next call starts clean
    return err == cudaErrorMemoryAllocation ? XINFER_OUT_OF_MEMORY : XINFER_ERROR;
}

bool env_flag(const char* name, bool fallback) {
    const char* v = std::getenv(name);
    if (!v || !v[0]) return fallback;
    return !(v[0] == '0' && v[1] == 0);
}

int64_t env_int(const char* name, int64_t fallback) {
    const char* v = std::getenv(name);
    return v && v[0] ? int64_t(std::atoll(v)) : fallback;
}

int env_ring_shape(const char* name, std::initializer_list<int> built) {
    const char* v = std::getenv(name);
    if (!v || !v[0]) return 0;
    if (v[0] >= '1' && v[0] <= '9' && v[1] == 'x' && v[2] >= '1' && v[2] <= '9' && v[3] == 0) {
        const int shape = (v[0] - '0') * 10 + (v[2] - '0');
        if (std::find(built.begin(), built.end(), shape) != built.end()) return shape;
    }
    std::string names;
    for (int b : built) names += (names.empty() ? "" : ", ") + std::to_string(b / 10) + "x" + std::to_string(b % 10);
    std::fprintf(stderr, "xinfer cuda: %s=%s is not one of the built ring shapes (%s); using the default\n", name, v,
                 names.c_str());
    return 0;
}

bool early_reads() {
    static const bool on = env_flag("XINFER_CUDA_EARLY_READS", true);
    return on;
}

bool pdl_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_PDL", true);
    return enabled;
}

int unsupported(Context* c, const xinfer_op* op, const char* format, ...) {
    char buffer[1024];
    va_list args;
    va_start(args, format);
    vsnprintf(buffer, sizeof buffer, format, args);
    va_end(args);
    c->error = str_format("cuda %s%s%s (layer %d): %s", xinfer_op_type_name(op->type), op->name ? " " : "",
                          op->name ? op->name : "", op->layer, buffer);
    return XINFER_UNSUPPORTED;
}

int64_t numel(const xinfer_tensor& t) {
    int64_t n = 1;
    for (int i = 0; i < t.rank && i < XINFER_MAX_RANK; ++i) n *= t.shape[i];
    return t.rank == 0 ? 0 : n;
}

size_t dtype_size(int dtype) {
    switch (dtype) {
        case XINFER_DTYPE_F32: case XINFER_DTYPE_I32: return 4;
        case XINFER_DTYPE_F16: case XINFER_DTYPE_BF16: return 2;
        case XINFER_DTYPE_I64: return 8;
        default: return 1;  // f8, e8m0, u8 (fp4 packs two per byte; not used here)
    }
}

const char* dtype_name(int dtype) {
    switch (dtype) {
        case XINFER_DTYPE_F32: return "f32";
        case XINFER_DTYPE_F16: return "f16";
        case XINFER_DTYPE_BF16: return "bf16";
        case XINFER_DTYPE_F8_E4M3: return "f8_e4m3";
        case XINFER_DTYPE_E8M0: return "e8m0";
        case XINFER_DTYPE_FP4_E2M1: return "fp4_e2m1";
        case XINFER_DTYPE_I32: return "i32";
        case XINFER_DTYPE_I64: return "i64";
        case XINFER_DTYPE_U8: return "u8";
        default: return "?";
    }
}

std::string shape_str(const xinfer_tensor& t) {
    if (t.rank == 0) return "(absent)";
    std::string s = std::string(dtype_name(t.dtype)) + "[";
    for (int i = 0; i < t.rank && i < XINFER_MAX_RANK; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
    return s + "]";
}

bool stream_capturing(Context* c) {
    if (c->capturing) return true;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(c->stream, &status) != cudaSuccess) return false;
    return status != cudaStreamCaptureStatusNone;
}

int ensure_scratch(Context* c, size_t bytes) {
    if (bytes <= c->scratch_bytes) return XINFER_OK;
    if (stream_capturing(c)) {
        set_error(c,
                  "cuda: an op needs %zu bytes of workspace but only %zu are allocated, and the workspace cannot grow "
                  "during graph capture; run the same op shapes once before capturing",
                  bytes, c->scratch_bytes);
        return XINFER_ERROR;
    }
    // Kernels queued earlier may still use the old buffer.
    XCUDA_TRY(c, cudaStreamSynchronize(c->stream));
    if (c->scratch) {
        if (c->live_graphs > 0) {
            c->retired.push_back(c->scratch);
        } else {
            XCUDA_TRY(c, cudaFree(c->scratch));
        }
    }
    c->scratch = nullptr;
    c->scratch_bytes = 0;
    // Grow geometrically so a slowly growing batch does not reallocate every step.
    const size_t want = std::max(bytes, bytes / 4 * 5);
    void* p = nullptr;
    XCUDA_TRY(c, cudaMalloc(&p, want));
    c->scratch = static_cast<char*>(p);
    c->scratch_bytes = want;
    return XINFER_OK;
}

namespace {

// Makes the context's device current for the duration of an entry point.
struct DeviceGuard {
    explicit DeviceGuard(const Context* c) { cudaSetDevice(c->device); }
};

Context* ctx_of(void* p) { return static_cast<Context*>(p); }

// ---- devices -----------------------------------------------------------------------------------

int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

int device_props(int device, xinfer_device_props* out) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return XINFER_ERROR;
    std::memset(out, 0, sizeof *out);
    const size_t name_len = std::min(std::strlen(prop.name), sizeof out->name - 1);
    std::memcpy(out->name, prop.name, name_len);
    out->total_memory = prop.totalGlobalMem;
    int previous = 0;
    cudaGetDevice(&previous);
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(device) == cudaSuccess && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
        out->free_memory = free_bytes;
        out->total_memory = total_bytes;
    }
    cudaSetDevice(previous);
    out->host_memory = 0;
    return XINFER_OK;
}

// ---- contexts ----------------------------------------------------------------------------------

constexpr size_t kLtWorkspaceBytes = size_t(64) << 20;  // cuBLASLt's recommended ceiling on Hopper is 32 MiB+

// ---- device timeline (a diagnostic) -------------------------------------------------------------
// XINFER_CUDA_TIMELINE=FILE: every stream operation queued outside a capture (uploads, downloads,
// copies, eager ops, graph launches) records an event right after itself, and when the context is
// destroyed FILE gets one tab-separated line per operation: its index, name, op type (-1 if not an
// op), the device time from the previous operation's end to its own (µs), and whether the device
// had already finished the previous operation when the host queued this one (1: the device sat
// idle, waiting for the host). What a timed decode step spends beyond its graph shows there
// without a system profiler (the GPU machine has none).
const char* timeline_path() {
    static const char* path = [] {
        const char* v = std::getenv("XINFER_CUDA_TIMELINE");
        return v && *v ? v : nullptr;
    }();
    return path;
}

// Call before queueing an operation: whether the device is already idle.
bool timeline_starved(const Context* c) {
    return timeline_path() && !c->capturing && !c->timeline.empty() &&
           cudaEventQuery(c->timeline.back().done) == cudaSuccess;
}

void timeline_mark(Context* c, const char* what, int op_type, bool starved) {
    if (!timeline_path() || c->capturing) return;
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) return;
    cudaEventRecord(e, c->stream);
    c->timeline.push_back({what, op_type, e, starved});
}

void timeline_write(Context* c) {
    if (c->timeline.empty()) return;
    cudaStreamSynchronize(c->stream);
    if (FILE* f = std::fopen(timeline_path(), "w")) {
        for (size_t i = 0; i < c->timeline.size(); ++i) {
            const TimelineMark& m = c->timeline[i];
            float ms = 0.f;
            if (i > 0) cudaEventElapsedTime(&ms, c->timeline[i - 1].done, m.done);
            std::fprintf(f, "%zu\t%s\t%d\t%.2f\t%d\n", i, m.what, m.op_type, double(ms) * 1e3, m.starved ? 1 : 0);
        }
        std::fclose(f);
    }
    for (const TimelineMark& m : c->timeline) cudaEventDestroy(m.done);
    c->timeline.clear();
}

void context_destroy(void* p);

int context_create(int device, void** out) {
    *out = nullptr;
    Context* c = new (std::nothrow) Context();
    if (!c) return XINFER_OUT_OF_MEMORY;
    c->device = device;
    cudaError_t err = cudaSetDevice(device);
    cudaDeviceProp prop{};
    if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device);
    if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaMalloc(&c->lt_workspace, kLtWorkspaceBytes);
    if (err == cudaSuccess) err = cudaMalloc(&c->arrivals, kArrivalInts * sizeof(int));
    // On the context's stream (non-blocking: a plain cudaMemset, on the legacy stream, would not be
    // ordered before the kernels that count on the zero).
    if (err == cudaSuccess) err = cudaMemsetAsync(c->arrivals, 0, kArrivalInts * sizeof(int), c->stream);
    if (err != cudaSuccess) {
        context_destroy(c);  // frees what was created (the stream, the workspace)
        return err == cudaErrorMemoryAllocation ? XINFER_OUT_OF_MEMORY : XINFER_ERROR;
    }
    c->lt_workspace_bytes = kLtWorkspaceBytes;
    c->sm_count = prop.multiProcessorCount;
    c->smem_optin = prop.sharedMemPerBlockOptin;
    if (cublasLtCreate(&c->lt) != CUBLAS_STATUS_SUCCESS) {
        context_destroy(c);
        return XINFER_ERROR;
    }
    *out = c;
    return XINFER_OK;
}

void context_destroy(void* p) {
    Context* c = ctx_of(p);
    if (!c) return;
    DeviceGuard guard(c);
    timeline_write(c);
    if (c->stream) cudaStreamSynchronize(c->stream);
    if (c->lt) cublasLtDestroy(c->lt);
    if (c->lt_workspace) cudaFree(c->lt_workspace);
    if (c->arrivals) cudaFree(c->arrivals);
    if (c->scratch) cudaFree(c->scratch);
    if (c->download_staging) cudaFreeHost(c->download_staging);
    if (c->downloads_done) cudaEventDestroy(c->downloads_done);
    for (const Context::MappedRange& m : c->mapped) cudaFreeHost(m.host);
    for (void* r : c->retired) cudaFree(r);
    if (c->stream) cudaStreamDestroy(c->stream);
    delete c;
}

const char* last_error(void* p) { return p ? ctx_of(p)->error.c_str() : "cuda: no context"; }

// ---- memory ------------------------------------------------------------------------------------

int alloc(void* p, size_t bytes, void** ptr) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    *ptr = nullptr;
    // Plain device memory, never managed: managed allocations beyond free memory can hang the GPU.
    cudaError_t err = cudaMalloc(ptr, std::max<size_t>(bytes, 1));
    if (err != cudaSuccess) {
        cuda_fail(c, err, "cudaMalloc");
        c->error += str_format(" (asked for %zu bytes)", bytes);
        return err == cudaErrorMemoryAllocation ? XINFER_OUT_OF_MEMORY : XINFER_ERROR;
    }
    return XINFER_OK;
}

void free_(void* p, void* ptr) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (ptr) cudaFree(ptr);  // cudaFree waits for work using it to finish
}

// ---- mapped host memory ----------------------------------------------------------------------------
// Pinned host memory with a device address: a decode graph reads its step's inputs from it and its
// argmax writes the ids there, so a step queues no upload, token copy or download of its own
// (docs/perf/2026-12-06-h200-session32.md). XINFER_CUDA_MAPPED=0 refuses it (A/B): xinfer then
// stages the same buffers in device memory.
int alloc_mapped(void* p, size_t bytes, void** host, void** device) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    *host = *device = nullptr;
    static const bool enabled = env_flag("XINFER_CUDA_MAPPED", true);
    if (!enabled) {
        set_error(c, "cuda: mapped host memory is off (XINFER_CUDA_MAPPED=0)");
        return XINFER_UNSUPPORTED;
    }
    char *h = nullptr, *d = nullptr;
    cudaError_t err = cudaHostAlloc(reinterpret_cast<void**>(&h), std::max<size_t>(bytes, 1), cudaHostAllocMapped);
    if (err == cudaSuccess) err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&d), h, 0);
    if (err != cudaSuccess) {
        if (h) cudaFreeHost(h);
        cuda_fail(c, err, "cudaHostAlloc(mapped)");
        c->error += str_format(" (asked for %zu bytes)", bytes);
        return err == cudaErrorMemoryAllocation ? XINFER_OUT_OF_MEMORY : XINFER_ERROR;
    }
    c->mapped.push_back({h, d, bytes});
    *host = h;
    *device = d;
    return XINFER_OK;
}

void free_mapped(void* p, void* host) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    for (size_t i = 0; i < c->mapped.size(); ++i) {
        if (c->mapped[i].host != host) continue;
        cudaStreamSynchronize(c->stream);  // queued kernels may still address it
        cudaFreeHost(host);
        c->mapped.erase(c->mapped.begin() + long(i));
        return;
    }
}

// The host address of [device, device + bytes) when that lies in one mapped allocation, else null.
char* mapped_host(const Context* c, const void* device, size_t bytes) {
    const char* d = static_cast<const char*>(device);
    for (const Context::MappedRange& m : c->mapped)
        if (d >= m.device && d + bytes <= m.device + m.bytes) return m.host + (d - m.device);
    return nullptr;
}

// 16-byte words when dst, src and bytes allow, else bytes; writes to host memory are made visible
// to the host before the kernel completes.
__global__ void small_copy_kernel(char* dst, const char* src, size_t bytes) {
    const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = size_t(gridDim.x) * blockDim.x;
    if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
        for (size_t i = first; i < bytes / 16; i += stride)
            reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    } else {
        for (size_t i = first; i < bytes; i += stride) dst[i] = src[i];
    }
    __threadfence_system();
}

int launch_small_copy(Context* c, void* dst, const void* src, size_t bytes) {
    constexpr unsigned kThreads = 256;
    const unsigned blocks = unsigned(std::min<size_t>((bytes + 16 * kThreads - 1) / (16 * kThreads), 16));
    small_copy_kernel<<<blocks, kThreads, 0, c->stream>>>(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
    XCUDA_CHECK_LAUNCH(c, "small_copy_kernel");
    return XINFER_OK;
}

// Stream-ordered. From pageable host memory the runtime stages the bytes before it returns, as
// the ABI asks; from pinned memory the copy would still be reading after the return, so that
// source waits for its copy.
int upload(void* p, void* dst, const void* src, size_t bytes) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (bytes == 0) return XINFER_OK;
    const bool starved = timeline_starved(c);
    XCUDA_TRY(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
    timeline_mark(c, "upload", -1, starved);
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, src) != cudaSuccess)
        cudaGetLastError();  // older runtimes report unregistered (pageable) memory as an error: clear only that
    else if (attributes.type == cudaMemoryTypeHost)
        XCUDA_TRY(c, cudaStreamSynchronize(c->stream));
    return XINFER_OK;
}

int download(void* p, void* dst, const void* src, size_t bytes) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (bytes == 0) return XINFER_OK;
    if (const char* host = mapped_host(c, src, bytes)) {
        XCUDA_TRY(c, cudaStreamSynchronize(c->stream));
        std::memcpy(dst, host, bytes);
        return XINFER_OK;
    }
    const bool starved = timeline_starved(c);
    XCUDA_TRY(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    timeline_mark(c, "download", -1, starved);
    XCUDA_TRY(c, cudaStreamSynchronize(c->stream));
    return XINFER_OK;
}

// ---- asynchronous downloads ------------------------------------------------------------------------
// Into pinned staging (grown only while nothing is pending), then to dst in wait_downloads. A copy
// engine spends tens of µs of device time on a download of a few bytes: H200, batch-1 MiMo decode
// with overlapped steps (XINFER_CUDA_TIMELINE), the argmax id's 4 bytes 30-39 µs between the
// argmax and the next step's upload. Downloads up to kSmallDownloadBytes therefore run as a copy
// kernel that writes the staging (mapped pinned memory) over the bus: 5 µs, and 31-37 µs less a
// decode step. XINFER_CUDA_SMALL_DOWNLOAD_KERNEL=0 keeps the copy engine (A/B).
constexpr size_t kMinDownloadStaging = 64 * 1024;
constexpr size_t kSmallDownloadBytes = 64 * 1024;

bool small_download_kernel() {
    static const bool enabled = env_flag("XINFER_CUDA_SMALL_DOWNLOAD_KERNEL", true);
    return enabled;
}

// bytes of src (device) into the staging at offset, queued on the stream.
int queue_download(Context* c, size_t offset, const void* src, size_t bytes) {
    if (!small_download_kernel() || bytes > kSmallDownloadBytes) {
        XCUDA_TRY(c, cudaMemcpyAsync(c->download_staging + offset, src, bytes, cudaMemcpyDeviceToHost, c->stream));
        return XINFER_OK;
    }
    return launch_small_copy(c, c->download_staging_device + offset, src, bytes);
}

int download_async(void* p, void* dst, const void* src, size_t bytes) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (c->capturing) {
        set_error(c, "download_async during graph capture");
        return XINFER_ERROR;
    }
    if (bytes == 0) return XINFER_OK;
    if (!c->downloads_done) XCUDA_TRY(c, cudaEventCreateWithFlags(&c->downloads_done, cudaEventDisableTiming));
    if (const char* host = mapped_host(c, src, bytes)) {  // the bytes are on the host already: only wait
        timeline_mark(c, "download_async", -1, timeline_starved(c));
        XCUDA_TRY(c, cudaEventRecord(c->downloads_done, c->stream));
        c->pending_downloads.push_back({dst, 0, bytes, host});
        return XINFER_OK;
    }
    const size_t offset = (c->pending_download_bytes + 15) / 16 * 16;
    if (offset + bytes > c->download_staging_bytes) {
        if (!c->pending_downloads.empty()) return download(p, dst, src, bytes);  // in order, just not overlapped
        if (c->download_staging) cudaFreeHost(c->download_staging);
        c->download_staging = c->download_staging_device = nullptr;
        c->download_staging_bytes = 0;
        const size_t size = std::max(kMinDownloadStaging, bytes);
        XCUDA_TRY(c, cudaHostAlloc(reinterpret_cast<void**>(&c->download_staging), size, cudaHostAllocMapped));
        XCUDA_TRY(c, cudaHostGetDevicePointer(reinterpret_cast<void**>(&c->download_staging_device), c->download_staging, 0));
        c->download_staging_bytes = size;  // only once both pointers are valid
    }
    const bool starved = timeline_starved(c);
    if (int rc = queue_download(c, offset, src, bytes)) return rc;
    timeline_mark(c, "download_async", -1, starved);
    XCUDA_TRY(c, cudaEventRecord(c->downloads_done, c->stream));
    c->pending_downloads.push_back({dst, offset, bytes, nullptr});
    c->pending_download_bytes = offset + bytes;
    return XINFER_OK;
}

int wait_downloads(void* p) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (c->pending_downloads.empty()) return XINFER_OK;
    XCUDA_TRY(c, cudaEventSynchronize(c->downloads_done));
    for (const Context::PendingDownload& d : c->pending_downloads)
        std::memcpy(d.dst, d.mapped_src ? d.mapped_src : c->download_staging + d.offset, d.bytes);
    c->pending_downloads.clear();
    c->pending_download_bytes = 0;
    return XINFER_OK;
}

int copy(void* p, void* dst, const void* src, size_t bytes) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (bytes == 0) return XINFER_OK;
    const bool starved = timeline_starved(c);
    // To or from mapped memory: a kernel, which a copy engine's tens of µs per small transfer
    // would lose to (see queue_download); larger ones go to the copy engine as host copies do.
    if (mapped_host(c, dst, bytes) || mapped_host(c, src, bytes)) {
        if (bytes <= kSmallDownloadBytes) {
            if (int rc = launch_small_copy(c, dst, src, bytes)) return rc;
        } else {
            XCUDA_TRY(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream));
        }
    } else {
        XCUDA_TRY(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
    }
    timeline_mark(c, "copy", -1, starved);
    return XINFER_OK;
}

int synchronize(void* p) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    XCUDA_TRY(c, cudaStreamSynchronize(c->stream));
    return XINFER_OK;
}

// 1 GiB copied device-to-device, best of 5 after a warm-up, counting bytes read plus written.
int measure_copy_bandwidth(void* p, double* gbps) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    *gbps = 0;
    if (stream_capturing(c)) {
        set_error(c, "cuda: measure_copy_bandwidth cannot run during graph capture");
        return XINFER_ERROR;
    }
    const size_t bytes = size_t(1) << 30;
    void *src = nullptr, *dst = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    int rc = XINFER_OK;
    auto check = [&](cudaError_t err, const char* what) {
        if (err != cudaSuccess && rc == XINFER_OK) rc = cuda_fail(c, err, what);
        return rc == XINFER_OK;
    };
    if (check(cudaMalloc(&src, bytes), "cudaMalloc(src)") && check(cudaMalloc(&dst, bytes), "cudaMalloc(dst)") &&
        check(cudaEventCreate(&start), "cudaEventCreate") && check(cudaEventCreate(&stop), "cudaEventCreate") &&
        check(cudaMemsetAsync(src, 1, bytes, c->stream), "cudaMemsetAsync") &&
        check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream), "warm-up copy")) {
        float best_ms = 1e30f;
        for (int rep = 0; rep < 5 && rc == XINFER_OK; ++rep) {
            float ms = 0;
            if (check(cudaEventRecord(start, c->stream), "cudaEventRecord") &&
                check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream), "copy") &&
                check(cudaEventRecord(stop, c->stream), "cudaEventRecord") &&
                check(cudaEventSynchronize(stop), "cudaEventSynchronize") &&
                check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime"))
                best_ms = std::min(best_ms, ms);
        }
        if (rc == XINFER_OK) *gbps = 2.0 * double(bytes) / (double(best_ms) * 1e-3) / 1e9;
    }
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (src) cudaFree(src);
    if (dst) cudaFree(dst);
    return rc;
}

// ---- ops ---------------------------------------------------------------------------------------

int dispatch(Context* c, const xinfer_op* op, bool run) {
    switch (op->type) {
        case XINFER_OP_EMBEDDING: return op_embedding(c, op, run);
        case XINFER_OP_RMSNORM: return op_rmsnorm(c, op, run);
        case XINFER_OP_ADD_RMSNORM: return op_add_rmsnorm(c, op, run);
        case XINFER_OP_MATMUL: return op_matmul(c, op, run);
        case XINFER_OP_ROPE: return op_rope(c, op, run);
        case XINFER_OP_SWIGLU: return op_swiglu(c, op, run);
        case XINFER_OP_SCALE: return op_scale(c, op, run);
        case XINFER_OP_ADD: return op_add(c, op, run);
        case XINFER_OP_KV_STORE: return op_kv_store(c, op, run);
        case XINFER_OP_ATTENTION: return op_attention(c, op, run);
        case XINFER_OP_MOE_ROUTE: return op_moe_route(c, op, run);
        case XINFER_OP_MOE_EXPERTS: return op_moe_experts(c, op, run);
        case XINFER_OP_ARGMAX: return op_argmax(c, op, run);
        case XINFER_OP_SAMPLE: return op_sample(c, op, run);
        case XINFER_OP_CONVERT: return op_convert(c, op, run);
        case XINFER_OP_ROPE_KV_STORE: return op_rope_kv_store(c, op, run);
        case XINFER_OP_ADD_RMSNORM_MATMUL: return op_add_rmsnorm_matmul(c, op, run);
        case XINFER_OP_MOE_ROUTE_EXPERTS: return op_moe_route_experts(c, op, run);
        default: return unsupported(c, op, "op type %d is not implemented", op->type);
    }
}

int supports_op(void* p, const xinfer_op* op) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    return dispatch(c, op, false) == XINFER_OK ? 1 : 0;
}

// XINFER_CUDA_TIMING_SKIP=<mask of xinfer_op_type bits>: ops of those types launch nothing while a
// graph is captured (decode steps), so a bench shows what each op type costs inside the replayed
// step, launch and dependency included. Results are wrong with it: timing only, never for serving.
bool skipped_for_timing(const Context* c, const xinfer_op* op) {
    static const int64_t mask = [] {
        const int64_t m = env_int("XINFER_CUDA_TIMING_SKIP", 0);
        if (m != 0)
            std::fprintf(stderr, "xinfer cuda: XINFER_CUDA_TIMING_SKIP=%lld: ops of those types launch nothing in "
                                 "captured graphs; results are wrong (timing only)\n", (long long)m);
        return m;
    }();
    return mask != 0 && c->capturing && op->type >= 0 && op->type < 63 && ((mask >> op->type) & 1) != 0;
}

int run_op(void* p, const xinfer_op* op) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (skipped_for_timing(c, op)) return XINFER_OK;
    const bool starved = timeline_starved(c);
    const int rc = dispatch(c, op, true);
    timeline_mark(c, "op", op->type, starved);
    return rc;
}

// ---- graphs ------------------------------------------------------------------------------------

int graph_begin(void* p) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (c->capturing) {
        set_error(c, "cuda: graph_begin while a capture is already open");
        return XINFER_ERROR;
    }
    // Thread-local mode: unsafe calls (cudaMalloc, ...) from this thread fail the capture instead
    // of silently running, and other threads are unaffected.
    XCUDA_TRY(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    c->capturing = true;
    return XINFER_OK;
}

int graph_end(void* p, void** graph) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    *graph = nullptr;
    if (!c->capturing) {
        set_error(c, "cuda: graph_end without graph_begin");
        return XINFER_ERROR;
    }
    c->capturing = false;
    cudaGraph_t g = nullptr;
    XCUDA_TRY(c, cudaStreamEndCapture(c->stream, &g));
    cudaGraphExec_t exec = nullptr;
    cudaError_t err = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    if (err != cudaSuccess) return cuda_fail(c, err, "cudaGraphInstantiate");
    // The graph's work goes to the device now, not as part of its first launch: H200, batch-1 MiMo
    // decode: the first step after a capture 9.53 -> 8.99 ms (bf16), 6.60 -> 6.07 ms (FP8).
    // XINFER_CUDA_GRAPH_UPLOAD=0: on first launch (A/B).
    static const bool upload_now = env_flag("XINFER_CUDA_GRAPH_UPLOAD", true);
    if (upload_now && (err = cudaGraphUpload(exec, c->stream)) != cudaSuccess) {
        cudaGraphExecDestroy(exec);
        return cuda_fail(c, err, "cudaGraphUpload");
    }
    ++c->live_graphs;
    *graph = exec;
    return XINFER_OK;
}

int graph_launch(void* p, void* graph) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    const bool starved = timeline_starved(c);
    XCUDA_TRY(c, cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), c->stream));
    timeline_mark(c, "graph", -1, starved);
    return XINFER_OK;
}

void graph_destroy(void* p, void* graph) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (!graph) return;
    cudaStreamSynchronize(c->stream);  // a replay in flight must finish first
    cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
    if (--c->live_graphs <= 0) {
        c->live_graphs = 0;
        for (void* r : c->retired) cudaFree(r);
        c->retired.clear();
    }
}

// ---- events and ranges ---------------------------------------------------------------------------

int event_record(void* p, void** event) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    cudaEvent_t e = nullptr;
    XCUDA_TRY(c, cudaEventCreate(&e));
    cudaError_t err = cudaEventRecord(e, c->stream);
    if (err != cudaSuccess) {
        cudaEventDestroy(e);
        return cuda_fail(c, err, "cudaEventRecord");
    }
    *event = e;
    return XINFER_OK;
}

int event_elapsed_ms(void* p, void* start, void* end, float* ms) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    XCUDA_TRY(c, cudaEventSynchronize(static_cast<cudaEvent_t>(end)));
    XCUDA_TRY(c, cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
    return XINFER_OK;
}

void event_destroy(void* p, void* event) {
    Context* c = ctx_of(p);
    DeviceGuard guard(c);
    if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void range_push(void*, const char* name) {
#if XCUDA_HAVE_NVTX
    nvtxRangePushA(name ? name : "");
#else
    (void)name;
#endif
}

void range_pop(void*) {
#if XCUDA_HAVE_NVTX
    nvtxRangePop();
#endif
}

const xinfer_backend_api kApi = {
    XINFER_BACKEND_ABI_VERSION,
    "cuda",
    device_count,
    device_props,
    context_create,
    context_destroy,
    last_error,
    alloc,
    free_,
    upload,
    download,
    copy,
    synchronize,
    measure_copy_bandwidth,
    supports_op,
    run_op,
    graph_begin,
    graph_end,
    graph_launch,
    graph_destroy,
    event_record,
    event_elapsed_ms,
    event_destroy,
    range_push,
    range_pop,
    download_async,
    wait_downloads,
    alloc_mapped,
    free_mapped,
};

}  // namespace
}  // namespace xcuda

extern "C" __attribute__((visibility("default"))) const xinfer_backend_api* xinfer_backend_init(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
        cudaGetLastError();
        return nullptr;
    }
    return &xcuda::kApi;
}
