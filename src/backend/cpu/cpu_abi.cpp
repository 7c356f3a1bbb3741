// The CPU backend as a plugin table: the same xinfer_backend_api an accelerator vendor fills in
// (docs/PLUGINS.md uses this file as the worked example). It runs synchronously on the calling
// thread plus the OpenMP pool; memory is host memory, so upload/download are copies.
#include "backend/cpu/cpu_ops.h"
#include "backend/op_desc.h"

#include <omp.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace xinfer::cpu {
namespace {

struct Context {
    std::string last_error;
};

RopeParams rope_params(const xinfer_op& op) { return {op.params.rope.rotary_dim, op.params.rope.theta}; }

AttentionBatch attention_batch(const xinfer_op& op) {
    AttentionBatch b;
    b.n_seqs = op.batch.n_seqs;
    b.max_pages_per_seq = op.batch.max_pages_per_seq;
    b.cu_q_lens = from_abi(op.batch.cu_q_lens);
    b.kv_lens = from_abi(op.batch.kv_lens);
    b.positions = from_abi(op.batch.positions);
    b.page_table = from_abi(op.batch.page_table);
    b.slot_mapping = from_abi(op.batch.slot_mapping);
    b.page_stride = op.batch.page_stride;
    return b;
}

AttentionParams attention_params(const xinfer_op& op) {
    const xinfer_attention_params& p = op.params.attention;
    AttentionParams out;
    out.n_q_heads = p.n_q_heads;
    out.n_kv_heads = p.n_kv_heads;
    out.head_dim_k = p.head_dim_k;
    out.head_dim_v = p.head_dim_v;
    out.softmax_scale = p.softmax_scale;
    out.window = p.window;
    out.causal = p.causal != 0;
    out.page_size = op.batch.page_size;
    return out;
}

// Runs one op; throws Error on bad arguments (the kernels validate) or unsupported variants.
void dispatch(const xinfer_op& op) {
    auto src = [&](int i) { return from_abi(op.src[i]); };
    auto dst = [&](int i) { return from_abi(op.dst[i]); };
    switch (op.type) {
        case XINFER_OP_EMBEDDING: return embedding(src(0), src(1), dst(0));
        case XINFER_OP_RMSNORM: return rmsnorm(src(0), src(1), op.params.norm.eps, dst(0));
        case XINFER_OP_ADD_RMSNORM: return add_rmsnorm(src(0), src(1), src(2), op.params.norm.eps, dst(0));
        case XINFER_OP_MATMUL:
            if (op.src[2].data) fail("cpu: matmul with block-scaled fp8 weights is not supported (dequantize at load)");
            return matmul(src(0), src(1), dst(0));
        case XINFER_OP_ROPE: return rope(src(0), src(1), rope_params(op));
        case XINFER_OP_SWIGLU: return swiglu(src(0), dst(0));
        case XINFER_OP_SCALE: return scale(src(0), op.params.scale.factor);
        case XINFER_OP_ADD: return add(src(0), src(1));
        case XINFER_OP_CONVERT: return convert(src(0), dst(0));
        case XINFER_OP_KV_STORE: return kv_store(src(0), src(1), src(2), src(3), attention_batch(op));
        case XINFER_OP_ROPE_KV_STORE: {  // the four ops it stands for, in their order (backend_abi.h)
            const auto& p = op.params.rope_kv_store;
            rope(src(4), src(5), {p.rotary_dim, p.theta});
            rope(src(0), src(5), {p.rotary_dim, p.theta});
            if (p.value_scale != 1.f) scale(src(1), p.value_scale);
            return kv_store(src(0), src(1), src(2), src(3), attention_batch(op));
        }
        case XINFER_OP_ADD_RMSNORM_MATMUL: {  // the two ops it stands for (backend_abi.h): normed, then y from it
            if (op.src[4].data)
                fail("cpu: add_rmsnorm_matmul with block-scaled fp8 weights is not supported (dequantize at load)");
            const float eps = op.params.norm_matmul.eps;
            if (op.src[1].rank > 0) {
                add_rmsnorm(src(0), src(1), src(2), eps, dst(1));
            } else {
                rmsnorm(src(0), src(2), eps, dst(1));
            }
            return matmul(dst(1), src(3), dst(0));
        }
        case XINFER_OP_ATTENTION:
            if (op.params.attention.k_scale != 1.f || op.params.attention.v_scale != 1.f)
                fail("cpu: attention with per-tensor k_scale {} / v_scale {} (expected 1; fp8 caches carry per-row "
                     "scales in their pages)",
                     op.params.attention.k_scale, op.params.attention.v_scale);
            return attention(src(0), src(1), src(2), src(3), attention_batch(op), attention_params(op), dst(0));
        case XINFER_OP_MOE_ROUTE: return moe_route(src(0), src(1), router_params(op.params.route), dst(0), dst(1));
        case XINFER_OP_MOE_EXPERTS:
            return moe_experts(src(0), src(1), src(2), src(3), src(4), dst(0), src(5), src(6),
                               op.params.matmul.block_rows > 0 ? op.params.matmul.block_rows : 128,
                               op.params.matmul.block_cols > 0 ? op.params.matmul.block_cols : 128);
        case XINFER_OP_MOE_ROUTE_EXPERTS: {  // the two ops it stands for (backend_abi.h), ids and weights on the side
            const auto& p = op.params.route_experts;
            const Tensor logits = src(1);
            if (logits.rank != 2) fail("cpu: moe_route_experts logits must be [T, E], got rank {}", logits.rank);
            const int64_t T = logits.dim(0), k = p.route.top_k;
            if (k < 1) fail("cpu: moe_route_experts top_k {} must be at least 1", k);
            std::vector<int32_t> ids(size_t(T * k));
            std::vector<float> weights(size_t(T * k));
            const Tensor id_tensor(ids.data(), DType::i32, {T, k}), weight_tensor(weights.data(), DType::f32, {T, k});
            moe_route(logits, src(2), router_params(p.route), id_tensor, weight_tensor);
            return moe_experts(src(0), id_tensor, weight_tensor, src(3), src(4), dst(0), src(5), src(6),
                               p.block_rows > 0 ? p.block_rows : 128, p.block_cols > 0 ? p.block_cols : 128);
        }
        case XINFER_OP_ARGMAX: return argmax(src(0), dst(0));
        case XINFER_OP_SAMPLE: return sample(src(0), src(1), src(2), src(3), src(4), dst(0));
        default: fail("cpu: unknown op type {}", op.type);
    }
}

int device_count() { return 1; }

int device_props(int device, xinfer_device_props* out) {
    if (device != 0) return XINFER_ERROR;
    *out = {};
    std::snprintf(out->name, sizeof(out->name), "cpu (%d threads)", omp_get_max_threads());
    const long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    out->total_memory = uint64_t(pages) * uint64_t(page);
    out->free_memory = uint64_t(avail) * uint64_t(page);
    out->host_memory = 1;
    return XINFER_OK;
}

int context_create(int device, void** ctx) {
    if (device != 0) return XINFER_ERROR;
    *ctx = new Context();
    return XINFER_OK;
}
void context_destroy(void* ctx) { delete static_cast<Context*>(ctx); }
const char* last_error(void* ctx) { return static_cast<Context*>(ctx)->last_error.c_str(); }

// Runs `body`, turning exceptions into a status code plus last_error.
template <typename Body>
int guarded(void* ctx, int failure, Body&& body) {
    try {
        body();
        return XINFER_OK;
    } catch (const std::exception& e) {
        static_cast<Context*>(ctx)->last_error = e.what();
        return failure;
    }
}

int alloc(void* ctx, size_t bytes, void** ptr) {
    return guarded(ctx, XINFER_OUT_OF_MEMORY, [&] { *ptr = host_alloc(bytes); });
}
void free_memory(void*, void* ptr) { std::free(ptr); }
int copy_bytes(void*, void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    return XINFER_OK;
}
// Host memory is all the device has: a mapped buffer is an ordinary allocation, seen by both sides
// at the same address.
int alloc_mapped(void* ctx, size_t bytes, void** host, void** device) {
    return guarded(ctx, XINFER_OUT_OF_MEMORY, [&] { *host = *device = host_alloc(bytes); });
}
int synchronize(void*) { return XINFER_OK; }
int measure_bandwidth(void* ctx, double* gbps) {
    return guarded(ctx, XINFER_ERROR, [&] { *gbps = measure_copy_bandwidth_gbps(); });
}

// The CPU implements every op, in every variant its kernels accept, except MATMUL (and the
// matmul of ADD_RMSNORM_MATMUL) on FP8 block-scaled weights (the CPU dequantizes them at load);
// a wrong dtype or shape is reported by run_op's validation with a precise message.
int supports_op(void*, const xinfer_op* op) {
    if (op->type == XINFER_OP_MATMUL && op->src[2].rank > 0) return 0;
    if (op->type == XINFER_OP_ADD_RMSNORM_MATMUL && op->src[4].rank > 0) return 0;
    return op->type > 0 && op->type < XINFER_OP_COUNT;
}

int run_op(void* ctx, const xinfer_op* op) {
    return guarded(ctx, XINFER_ERROR, [&] { dispatch(*op); });
}

const xinfer_backend_api kCpuApi = {
    XINFER_BACKEND_ABI_VERSION,
    "cpu",
    device_count,
    device_props,
    context_create,
    context_destroy,
    last_error,
    alloc,
    free_memory,
    copy_bytes,  // upload
    copy_bytes,  // download
    copy_bytes,  // copy
    synchronize,
    measure_bandwidth,
    supports_op,
    run_op,
    nullptr,  // graph_begin: nothing to capture on a synchronous host backend
    nullptr,
    nullptr,
    nullptr,
    nullptr,  // event_record: host timestamps are exact here
    nullptr,
    nullptr,
    nullptr,  // range_push
    nullptr,
    nullptr,  // download_async: ops run synchronously, so a download is never behind queued work
    nullptr,
    alloc_mapped,
    free_memory,  // free_mapped
};

}  // namespace
}  // namespace xinfer::cpu

namespace xinfer {
const xinfer_backend_api* cpu_backend_api() { return &cpu::kCpuApi; }
}  // namespace xinfer
