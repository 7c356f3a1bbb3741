// cuda-op-check: a standalone driver that dlopens libxinfer-cuda.so exactly as the engine will
// (through include/xinfer/backend_abi.h only), runs every op on random inputs against host
// references, checks graph capture, events and error reporting, and times the ops on
// MiMo-V2-Flash shapes.
//
//   cuda-op-check [--plugin PATH] [--summary FILE] [--no-timing]
//
// Exit status 0 when every check passed. Stands in for `xinfer ops-test --backend cuda` until
// that exists, and keeps testing shapes the CPU oracle is too slow for.
#include "check_util.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdarg>
#include <fstream>

namespace check {
void check_ops();
void check_attention();
void time_attention();

namespace {

const int bf = XINFER_DTYPE_BF16, f32 = XINFER_DTYPE_F32, i32 = XINFER_DTYPE_I32, f8 = XINFER_DTYPE_F8_E4M3;

std::string fmt_line(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string fmt_line(const char* format, ...) {
    char buf[512];
    va_list args;
    va_start(args, format);
    vsnprintf(buf, sizeof buf, format, args);
    va_end(args);
    return buf;
}

// Graph capture replays the same work with the same pointers and gives the same bits; scratch
// growth inside a capture is refused with an error instead of breaking the capture.
void check_graphs() {
    const int T = 4, H = 512, N = 1024;
    Buf x = upload(random_vector(size_t(T) * H, 1), bf), w = upload(random_vector(size_t(H), 2, 0.5f, 1.5f), bf);
    Buf wm = upload(random_vector(size_t(N) * H, 3, -0.05f, 0.05f), bf);
    Buf normed(size_t(T) * H * 2), y(size_t(T) * N * 4), ids(size_t(T) * 4);
    Buf temp = upload(std::vector<float>(T, 0.8f), f32), top_p = upload(std::vector<float>(T, 0.9f), f32),
        top_k = upload_i32(std::vector<int32_t>(T, 40)), uni = upload(std::vector<float>{0.1f, 0.5f, 0.7f, 0.99f}, f32);
    xinfer_op norm = make_op(XINFER_OP_RMSNORM, "norm");
    norm.src[0] = tensor(x, bf, {T, H});
    norm.src[1] = tensor(w, bf, {H});
    norm.dst[0] = tensor(normed, bf, {T, H});
    norm.params.norm.eps = 1e-5f;
    xinfer_op mm = make_op(XINFER_OP_MATMUL, "lm_head");
    mm.src[0] = tensor(normed, bf, {T, H});
    mm.src[1] = tensor(wm, bf, {N, H});
    mm.dst[0] = tensor(y, f32, {T, N});
    xinfer_op sample = make_op(XINFER_OP_SAMPLE, "sample");
    sample.src[0] = tensor(y, f32, {T, N});
    sample.src[1] = tensor(temp, f32, {T});
    sample.src[2] = tensor(top_p, f32, {T});
    sample.src[3] = tensor(top_k, i32, {T});
    sample.src[4] = tensor(uni, f32, {T});
    sample.dst[0] = tensor(ids, i32, {T});
    auto step = [&] { return run("graph: eager step", norm) && run("graph: eager step", mm) && run("graph: eager step", sample); };
    if (!step()) return;
    const auto y_eager = download(y, f32, size_t(T) * N);
    const auto ids_eager = download_i32(ids, T);
    poison(y);
    poison(ids);

    void* graph = nullptr;
    if (api->graph_begin(ctx) != XINFER_OK) {
        record("graph: capture", false, api->last_error(ctx));
        return;
    }
    api->run_op(ctx, &norm);
    api->run_op(ctx, &mm);
    api->run_op(ctx, &sample);
    if (api->graph_end(ctx, &graph) != XINFER_OK) {
        record("graph: capture", false, api->last_error(ctx));
        return;
    }
    bool ok = true;
    for (int rep = 0; rep < 3; ++rep) ok &= api->graph_launch(ctx, graph) == XINFER_OK;
    api->synchronize(ctx);
    const auto y_graph = download(y, f32, size_t(T) * N);
    const auto ids_graph = download_i32(ids, T);
    ok &= std::memcmp(y_graph.data(), y_eager.data(), y_eager.size() * 4) == 0 && ids_graph == ids_eager;
    record("graph: rmsnorm + matmul + sample replayed 3x, bitwise equal", ok, "");
    const double eager_ms = time_ms([&] { api->run_op(ctx, &norm); api->run_op(ctx, &mm); api->run_op(ctx, &sample); }, 50);
    const double graph_ms = time_ms([&] { api->graph_launch(ctx, graph); }, 50);
    timing(fmt_line("graph of 3 small ops: eager %.3f ms, replay %.3f ms", eager_ms, graph_ms));
    api->graph_destroy(ctx, graph);

    // An op needing more scratch than exists, inside a capture, fails cleanly.
    const int E = 8, k = 2, Tm = 4096, I = 256;
    Buf xm(size_t(Tm) * H * 2), idm = upload_i32(std::vector<int32_t>(size_t(Tm) * k, 1)),
        wt = upload(std::vector<float>(size_t(Tm) * k, 0.5f), f32), gu(size_t(E) * 2 * I * H * 2), dn(size_t(E) * H * I * 2),
        out(size_t(Tm) * H * 2);
    xinfer_op moe = make_op(XINFER_OP_MOE_EXPERTS, "experts");
    moe.src[0] = tensor(xm, bf, {Tm, H});
    moe.src[1] = tensor(idm, i32, {Tm, k});
    moe.src[2] = tensor(wt, f32, {Tm, k});
    moe.src[3] = tensor(gu, bf, {E, 2 * I, H});
    moe.src[4] = tensor(dn, bf, {E, H, I});
    moe.dst[0] = tensor(out, bf, {Tm, H});
    api->graph_begin(ctx);
    const int rc = api->run_op(ctx, &moe);
    const std::string message = api->last_error(ctx);
    void* g2 = nullptr;
    const int end_rc = api->graph_end(ctx, &g2);
    if (g2) api->graph_destroy(ctx, g2);
    record("graph: scratch growth during capture is refused", rc == XINFER_ERROR,
           "rc " + std::to_string(rc) + ", graph_end rc " + std::to_string(end_rc) + ": " + message.substr(0, 80));
    // ... and succeeds outside the capture.
    record("graph: same op outside capture runs", api->run_op(ctx, &moe) == XINFER_OK && api->synchronize(ctx) == XINFER_OK,
           api->last_error(ctx));
    api->range_push(ctx, "nvtx-range-test");
    api->range_pop(ctx);
}

void time_ops() {
    double gbps = 0;
    if (api->measure_copy_bandwidth(ctx, &gbps) == XINFER_OK)
        timing(fmt_line("copy bandwidth (1 GiB D2D, read+write): %.0f GB/s", gbps));
    else
        record("measure_copy_bandwidth", false, api->last_error(ctx));

    // Dense GEMMs (cuBLASLt for bf16; the custom kernel for fp8).
    struct Gemm {
        const char* name;
        int64_t T, N, K;
        int wd, yd;
    };
    const Gemm gemms[] = {
        {"bf16 4096x4096x4096 (cuBLASLt)", 4096, 4096, 4096, bf, bf},
        {"bf16 8192x8192x8192 (cuBLASLt)", 8192, 8192, 8192, bf, bf},
        {"bf16 decode T=1 q_proj 12288x4096", 1, 12288, 4096, bf, bf},
        {"bf16 T=32 q_proj 12288x4096", 32, 12288, 4096, bf, bf},
        {"bf16 lm_head T=1 152576x4096 -> f32", 1, 152576, 4096, bf, f32},
        {"fp8 4096x4096x4096 (custom, dequant to bf16)", 4096, 4096, 4096, f8, bf},
        {"fp8 decode T=1 q_proj 12288x4096 (custom)", 1, 12288, 4096, f8, bf},
        {"fp8 T=32 q_proj 12288x4096 (custom)", 32, 12288, 4096, f8, bf},
    };
    for (const Gemm& g : gemms) {
        const size_t w_bytes = size_t(g.N * g.K) * (g.wd == f8 ? 1 : 2);
        Buf x(size_t(g.T * g.K) * 2), w(w_bytes), y(size_t(g.T * g.N) * (g.yd == f32 ? 4 : 2));
        fill_random_large(x, 1, false);
        fill_random_large(w, 2, g.wd == f8);
        Buf scale = upload(std::vector<float>(size_t(((g.N + 127) / 128) * ((g.K + 127) / 128)), 0.01f), f32);
        xinfer_op op = make_op(XINFER_OP_MATMUL, "gemm");
        op.src[0] = tensor(x, bf, {g.T, g.K});
        op.src[1] = tensor(w, g.wd, {g.N, g.K});
        if (g.wd == f8) op.src[2] = tensor(scale, f32, {(g.N + 127) / 128, (g.K + 127) / 128});
        op.dst[0] = tensor(y, g.yd, {g.T, g.N});
        if (!run(std::string("gemm timing ") + g.name, op)) continue;
        const double ms = time_ms([&] { api->run_op(ctx, &op); }, g.T >= 4096 ? 10 : 50);
        const double flops = 2.0 * g.T * g.N * g.K;
        const double bytes = double(w_bytes) + double(g.T * g.K) * 2 + double(y.bytes);
        timing(fmt_line("matmul %-44s %8.3f ms  %7.1f TFLOP/s  %7.0f GB/s", g.name, ms, flops / ms / 1e9,
                        bytes / ms / 1e6));
    }

    // MoE experts on MiMo-V2-Flash shapes: 256 experts, H 4096, I 2048, top 8, fp8 weights.
    {
        const int E = 256, H = 4096, I = 2048, k = 8;
        Buf gu(size_t(E) * 2 * I * H), dn(size_t(E) * H * I);
        fill_random_large(gu, 3, true);
        fill_random_large(dn, 4, true);
        Buf gus = upload(std::vector<float>(size_t(E) * (2 * I / 128) * (H / 128), 0.01f), f32);
        Buf dns = upload(std::vector<float>(size_t(E) * (H / 128) * (I / 128), 0.01f), f32);
        for (int T : {1, 32, 512, 4096}) {
            std::mt19937 rng(static_cast<uint32_t>(T));
            std::vector<int32_t> ids(size_t(T) * k);
            for (int t = 0; t < T; ++t) {
                for (int s = 0; s < k; ++s) {
                    int32_t e;
                    bool dup;
                    do {
                        e = int32_t(rng() % E);
                        dup = false;
                        for (int q = 0; q < s; ++q) dup |= ids[size_t(t * k + q)] == e;
                    } while (dup);
                    ids[size_t(t * k + s)] = e;
                }
            }
            std::vector<bool> used(E, false);
            for (int32_t e : ids) used[size_t(e)] = true;
            const int n_used = int(std::count(used.begin(), used.end(), true));
            Buf x(size_t(T) * H * 2), ib = upload_i32(ids), wb = upload(std::vector<float>(size_t(T) * k, 0.125f), f32),
                out(size_t(T) * H * 2);
            fill_random_large(x, 5, false);
            xinfer_op op = make_op(XINFER_OP_MOE_EXPERTS, "experts");
            op.src[0] = tensor(x, bf, {T, H});
            op.src[1] = tensor(ib, i32, {T, k});
            op.src[2] = tensor(wb, f32, {T, k});
            op.src[3] = tensor(gu, f8, {E, 2 * I, H});
            op.src[4] = tensor(dn, f8, {E, H, I});
            op.src[5] = tensor(gus, f32, {E, 2 * I / 128, H / 128});
            op.src[6] = tensor(dns, f32, {E, H / 128, I / 128});
            op.dst[0] = tensor(out, bf, {T, H});
            op.params.matmul.block_rows = op.params.matmul.block_cols = 128;
            if (!run("moe timing T " + std::to_string(T), op)) continue;
            const double ms = time_ms([&] { api->run_op(ctx, &op); }, T >= 4096 ? 5 : 20);
            const double flops = 2.0 * T * k * 3.0 * double(H) * I;
            const double weight_bytes = double(n_used) * 3.0 * H * I;
            timing(fmt_line("moe_experts fp8 E256 H4096 I2048 top8 T=%-5d %8.3f ms  %7.1f TFLOP/s  %7.0f GB/s of "
                            "touched expert weights (%d experts)",
                            T, ms, flops / ms / 1e9, weight_bytes / ms / 1e6, n_used));
        }
    }

    // Memory-bound ops.
    {
        const int R = 4096, N = 4096;
        Buf x(size_t(R) * N * 2), w(size_t(N) * 2), out(size_t(R) * N * 2);
        fill_random_large(x, 6, false);
        fill_random_large(w, 7, false);
        xinfer_op op = make_op(XINFER_OP_RMSNORM, "norm");
        op.src[0] = tensor(x, bf, {R, N});
        op.src[1] = tensor(w, bf, {N});
        op.dst[0] = tensor(out, bf, {R, N});
        op.params.norm.eps = 1e-5f;
        const double ms = time_ms([&] { api->run_op(ctx, &op); }, 20);
        timing(fmt_line("rmsnorm bf16 [4096, 4096]                          %8.3f ms  %7.0f GB/s", ms,
                        2.0 * R * N * 2 / ms / 1e6));
        Buf pos = upload_i32(std::vector<int32_t>(4096, 1000));
        xinfer_op rope = make_op(XINFER_OP_ROPE, "rope");
        rope.src[0] = tensor(x, bf, {4096, 16, 192});  // fits the [4096, 4096] buffer
        rope.params.rope = {64, 5e6f};
        rope.src[1] = tensor(pos, i32, {4096});
        const double rms = time_ms([&] { api->run_op(ctx, &rope); }, 20);
        timing(fmt_line("rope bf16 [4096, 16, 192] rotary 64                %8.3f ms  %7.0f GB/s (rotary part)", rms,
                        2.0 * 4096 * 16 * 64 * 2 / rms / 1e6));
    }
    {
        const int R = 32, V = 152576;
        Buf logits(size_t(R) * V * 4), out(size_t(R) * 4);
        std::vector<float> host = random_vector(size_t(R) * V, 8, -10.f, 10.f);
        logits = upload(host, f32);
        Buf temp = upload(std::vector<float>(R, 0.8f), f32), top_p = upload(std::vector<float>(R, 0.95f), f32),
            top_k = upload_i32(std::vector<int32_t>(R, 0)), uni = upload(std::vector<float>(R, 0.37f), f32);
        xinfer_op am = make_op(XINFER_OP_ARGMAX, "argmax");
        am.src[0] = tensor(logits, f32, {R, V});
        am.dst[0] = tensor(out, i32, {R});
        xinfer_op sm = make_op(XINFER_OP_SAMPLE, "sample");
        sm.src[0] = tensor(logits, f32, {R, V});
        sm.src[1] = tensor(temp, f32, {R});
        sm.src[2] = tensor(top_p, f32, {R});
        sm.src[3] = tensor(top_k, i32, {R});
        sm.src[4] = tensor(uni, f32, {R});
        sm.dst[0] = tensor(out, i32, {R});
        timing(fmt_line("argmax [32, 152576] f32                            %8.3f ms",
                        time_ms([&] { api->run_op(ctx, &am); }, 20)));
        timing(fmt_line("sample [32, 152576] f32 top_p 0.95                 %8.3f ms",
                        time_ms([&] { api->run_op(ctx, &sm); }, 20)));
    }
    time_attention();
}

}  // namespace
}  // namespace check

int main(int argc, char** argv) {
    using namespace check;
    std::string plugin, summary;
    bool timing_on = true;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--plugin" && i + 1 < argc) plugin = argv[++i];
        else if (a == "--summary" && i + 1 < argc) summary = argv[++i];
        else if (a == "--no-timing") timing_on = false;
        else {
            std::fprintf(stderr, "usage: %s [--plugin PATH] [--summary FILE] [--no-timing]\n", argv[0]);
            return 2;
        }
    }
    if (plugin.empty()) {
        // Next to this executable, as the engine looks for plugins.
        char self[4096] = {};
        const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        std::string dir = n > 0 ? std::string(self, size_t(n)) : std::string(argv[0]);
        dir = dir.substr(0, dir.find_last_of('/') + 1);
        plugin = dir + "libxinfer-cuda.so";
    }
    void* lib = dlopen(plugin.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        std::fprintf(stderr, "dlopen %s: %s\n", plugin.c_str(), dlerror());
        return 2;
    }
    auto init = reinterpret_cast<xinfer_backend_init_fn>(dlsym(lib, XINFER_BACKEND_INIT_SYMBOL));
    if (!init || !(api = init())) {
        std::fprintf(stderr, "%s: no usable CUDA device (init returned NULL)\n", plugin.c_str());
        return 3;
    }
    if (api->abi_version != XINFER_BACKEND_ABI_VERSION) {
        std::fprintf(stderr, "ABI version %u, expected %d\n", api->abi_version, XINFER_BACKEND_ABI_VERSION);
        return 2;
    }
    xinfer_device_props props{};
    api->device_props(0, &props);
    std::printf("plugin %s (%s), %d device(s); device 0: %s, %.1f GiB total, %.1f GiB free\n", plugin.c_str(),
                api->name, api->device_count(), props.name, double(props.total_memory) / (1 << 30),
                double(props.free_memory) / (1 << 30));
    if (api->context_create(0, &ctx) != XINFER_OK) {
        std::fprintf(stderr, "context_create failed\n");
        return 2;
    }
    const auto start = std::chrono::steady_clock::now();
    check_ops();
    check_attention();
    check_graphs();
    if (timing_on) time_ops();
    const int sync_rc = api->synchronize(ctx);
    record("no sticky CUDA error at the end", sync_rc == XINFER_OK, sync_rc ? api->last_error(ctx) : "");
    fill_chunks[0] = Buf();
    fill_chunks[1] = Buf();
    api->context_destroy(ctx);

    int failed = 0;
    for (const Result& r : results) failed += !r.pass;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("\n%zu checks, %d failed, %.1f s\n", results.size(), failed, seconds);
    if (!summary.empty()) {
        std::ofstream f(summary);
        f << "cuda-op-check on " << props.name << ": " << results.size() << " checks, " << failed << " failed\n";
        for (const Result& r : results) f << (r.pass ? "PASS  " : "FAIL  ") << r.name << "  " << r.detail << "\n";
        for (const std::string& t : timings) f << "TIME  " << t << "\n";
    }
    return failed ? 1 : 0;
}
