/*
 * xinfer backend plugin ABI, version 3.
 *
 * A backend for an accelerator is a shared library `libxinfer-<name>.so` exporting one C
 * symbol, `xinfer_backend_init`, which returns a table of function pointers. xinfer dlopens
 * the library, checks `abi_version`, enumerates devices, and from then on reaches the device
 * only through this table: memory, copies, one stream per context, `supports_op` and `run_op`
 * for the fused ops below, graph capture, and events for the profiler. The built-in CPU
 * backend fills in the same table (src/backend/cpu/), so it is the worked example.
 *
 * Everything crossing this boundary is plain C: no C++ types, no exceptions, no ownership
 * transfer except where stated. Functions returning int return XINFER_OK (0) on success; on
 * failure `last_error(ctx)` describes the problem until the next call on that context.
 *
 * Tensors are contiguous and row-major; `data` is a device pointer from `alloc` (or a host
 * pointer for backends whose memory is host memory). Integer metadata is int32. Semantics of
 * every op are specified next to its enum value and in src/backend/backend.h; the CPU backend
 * is the reference implementation that `xinfer ops-test` compares every backend against.
 */
#ifndef XINFER_BACKEND_ABI_H
#define XINFER_BACKEND_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version 2: upload reads its source before it returns; download_async and wait_downloads.
   Version 3: alloc_mapped and free_mapped (host memory the device reads and writes in place). */
#define XINFER_BACKEND_ABI_VERSION 3

enum {
    XINFER_OK = 0,
    XINFER_ERROR = 1,        /* see last_error */
    XINFER_UNSUPPORTED = 2,  /* op, dtype or shape not implemented by this backend */
    XINFER_OUT_OF_MEMORY = 3,
};

/* Element types; the numbering matches xinfer::DType. */
typedef enum xinfer_dtype {
    XINFER_DTYPE_F32 = 0,
    XINFER_DTYPE_F16 = 1,
    XINFER_DTYPE_BF16 = 2,
    XINFER_DTYPE_F8_E4M3 = 3,
    XINFER_DTYPE_E8M0 = 4,
    XINFER_DTYPE_FP4_E2M1 = 5, /* two per byte, low nibble first */
    XINFER_DTYPE_I32 = 6,
    XINFER_DTYPE_I64 = 7,
    XINFER_DTYPE_U8 = 8,
} xinfer_dtype;

#define XINFER_MAX_RANK 4

typedef struct xinfer_tensor {
    void* data;                      /* NULL with rank 0: "absent" (optional inputs) */
    int32_t dtype;                   /* xinfer_dtype */
    int32_t rank;
    int64_t shape[XINFER_MAX_RANK];  /* shape[0] outermost */
} xinfer_tensor;

/* The ops. src[i] / dst[i] roles are listed per op; shapes use T = tokens, H = hidden. */
typedef enum xinfer_op_type {
    /* dst0[T,H] = table[ids[t]]                          src: table[V,H], ids[T] */
    XINFER_OP_EMBEDDING = 1,
    /* dst0 = x / sqrt(mean(x^2)+eps) * w, per row         src: x[R,N], w[N]               params.norm */
    XINFER_OP_RMSNORM = 2,
    /* src0 += src1 (in place), dst0 = rmsnorm(src0)       src: residual[R,N], x[R,N], w[N] */
    XINFER_OP_ADD_RMSNORM = 3,
    /* dst0[T,N] = x · wᵀ; optional block scales for f8 w   src: x[T,K], w[N,K], w_scale[ceil(N/br),ceil(K/bc)] f32 */
    XINFER_OP_MATMUL = 4,
    /* in place on src0's first rotary_dim dims per head    src: x[T,heads,D], positions[T]     params.rope
       positions are host-written, as the attention batch's tensors (see xinfer_attention_batch). */
    XINFER_OP_ROPE = 5,
    /* dst0[T,I] = silu(gate) * up                          src: gate_up[T,2I] */
    XINFER_OP_SWIGLU = 6,
    /* src0 *= factor (in place)                            params.scale */
    XINFER_OP_SCALE = 7,
    /* src0 += src1 (in place) */
    XINFER_OP_ADD = 8,
    /* write new K/V into cache slots                       src: k[T,kv,dk], v[T,kv,dv], k_cache, v_cache; batch
       Caches are f32/bf16/f16, or F8_E4M3 with per-row scales (see "FP8 KV caches" below). */
    XINFER_OP_KV_STORE = 9,
    /* paged attention                                      src: q[T,nq,dk], k_cache, v_cache, sinks[nq] f32 (opt);
                                                            dst0: out[T,nq,dv]; params.attention; batch */
    XINFER_OP_ATTENTION = 10,
    /* router top-k                                         src: logits[T,E] f32, bias[E] f32 (opt);
                                                            dst0: ids[T,k] i32, dst1: weights[T,k] f32; params.route */
    XINFER_OP_MOE_ROUTE = 11,
    /* grouped experts                                      src: x[T,H], ids[T,k], weights[T,k], gate_up[E,2I,H],
                                                            down[E,H,I], gate_up_scale (opt), down_scale (opt);
                                                            dst0: out[T,H]; params.matmul for scale blocks */
    XINFER_OP_MOE_EXPERTS = 12,
    /* dst0[R] i32 = argmax of each row (lowest index on ties)   src: logits[R,V] */
    XINFER_OP_ARGMAX = 13,
    /* dst0[R] i32 sampled with temperature / top-k / top-p, drawing with the given uniforms
       src: logits[R,V] f32, temperature[R] f32, top_p[R] f32, top_k[R] i32, uniform[R] f32 in [0,1) */
    XINFER_OP_SAMPLE = 14,
    /* dst0 = src0 converted to dst0's dtype (same shape) */
    XINFER_OP_CONVERT = 15,
    /* the attention block's prologue as one op: exactly ROPE(q), ROPE(k), SCALE(v, value_scale),
       KV_STORE(k, v), in that order (q, k, v in place)   src: k[T,kv,dk], v[T,kv,dv], k_cache,
       v_cache (as KV_STORE), q[T,nq,dk], positions[T]; params.rope_kv_store; batch.
       Optional: a backend may answer supports_op = 0 and xinfer runs the four ops instead. */
    XINFER_OP_ROPE_KV_STORE = 16,
    /* the norm before a projection as one op: exactly ADD_RMSNORM(src0, src1, src2 -> dst1), or
       RMSNORM(src0, src2 -> dst1) when src1 is absent, then MATMUL(dst1, src3, src4 -> dst0)
       src: residual[R,K] (+= x in place when x is present), x[R,K] (opt), norm weight[K], w[N,K],
       w_scale (opt, f8 block scales as MATMUL's); dst0: y[R,N], dst1: normed[R,K]; params.norm_matmul.
       Results are those of the two ops: y is computed from normed as stored in dst1's dtype.
       Optional: a backend may answer supports_op = 0 and xinfer runs the two ops instead. */
    XINFER_OP_ADD_RMSNORM_MATMUL = 17,
    /* the router and the experts as one op: exactly MOE_ROUTE(src1, src2 -> ids, weights) then
       MOE_EXPERTS(src0, ids, weights, src3..src6 -> dst0), ids and weights kept inside the op
       src: x[T,H], logits[T,E] f32, bias[E] f32 (opt), gate_up[E,2I,H], down[E,H,I], gate_up_scale
       (opt), down_scale (opt); dst0: out[T,H]; params.route_experts (the route's, and the scale
       blocks as MOE_EXPERTS's params.matmul).
       Optional: a backend may answer supports_op = 0 and xinfer runs the two ops instead. */
    XINFER_OP_MOE_ROUTE_EXPERTS = 18,
    XINFER_OP_COUNT
} xinfer_op_type;

/* The op's name as xinfer's tools print it ("attention"); "unknown" for values outside the enum.
   Plugins use it in their error messages so that one table names every op. */
static inline const char* xinfer_op_type_name(int type) {
    switch (type) {
        case XINFER_OP_EMBEDDING: return "embedding";
        case XINFER_OP_RMSNORM: return "rmsnorm";
        case XINFER_OP_ADD_RMSNORM: return "add_rmsnorm";
        case XINFER_OP_MATMUL: return "matmul";
        case XINFER_OP_ROPE: return "rope";
        case XINFER_OP_SWIGLU: return "swiglu";
        case XINFER_OP_SCALE: return "scale";
        case XINFER_OP_ADD: return "add";
        case XINFER_OP_KV_STORE: return "kv_store";
        case XINFER_OP_ATTENTION: return "attention";
        case XINFER_OP_MOE_ROUTE: return "moe_route";
        case XINFER_OP_MOE_EXPERTS: return "moe_experts";
        case XINFER_OP_ARGMAX: return "argmax";
        case XINFER_OP_SAMPLE: return "sample";
        case XINFER_OP_CONVERT: return "convert";
        case XINFER_OP_ROPE_KV_STORE: return "rope_kv_store";
        case XINFER_OP_ADD_RMSNORM_MATMUL: return "add_rmsnorm_matmul";
        case XINFER_OP_MOE_ROUTE_EXPERTS: return "moe_route_experts";
        default: return "unknown";
    }
}

/* Per-step paged-KV metadata shared by KV_STORE and ATTENTION (one per layer group).
   What a backend may rely on to start an op before the previous one on its stream has finished:
   these tensors are written by the host before the forward, never by an op; and a sequence's
   tokens are its newest keys (kv_len - q_len .. kv_len - 1, in order; xinfer's batch builders
   check it), so a forward's KV_STORE (or ROPE_KV_STORE) never rewrites an older key: those were
   stored by earlier forwards. (The CUDA plugin's decode attention reads them while the store
   before it runs.) */
typedef struct xinfer_attention_batch {
    int32_t n_seqs;
    int32_t max_pages_per_seq;
    int32_t page_size;          /* tokens per page in this group */
    int64_t page_stride;        /* elements between consecutive pages of one layer's K (and of V);
                                   0 = contiguous [pages, page_size, n_kv, d] */
    xinfer_tensor cu_q_lens;    /* [n_seqs+1] rows of sequence s: [cu[s], cu[s+1]) */
    xinfer_tensor kv_lens;      /* [n_seqs] keys 0..kv_len-1 exist after KV_STORE */
    xinfer_tensor positions;    /* [T] absolute position = key index of each query */
    xinfer_tensor page_table;   /* [n_seqs, max_pages_per_seq] physical page, -1 = not resident */
    xinfer_tensor slot_mapping; /* [T] page*page_size+offset for each new token; -1 = skip */
} xinfer_attention_batch;

typedef struct xinfer_attention_params {
    int32_t n_q_heads, n_kv_heads; /* GQA: q head h reads kv head h / (n_q/n_kv) */
    int32_t head_dim_k, head_dim_v;
    float softmax_scale;           /* on q·k; sinks are in these scaled units */
    int32_t window;                /* 0 = none; causal: p-j < window; non-causal: |p-j| < window */
    int32_t causal;                /* 1 causal, 0 non-causal block (DFlash drafter) */
    float k_scale, v_scale;        /* per-tensor cache scales: reserved, always 1 (fp8 caches carry
                                      per-row scales in their pages, see below); refuse other values */
} xinfer_attention_params;

/* FP8 KV caches. A KV_STORE / ATTENTION cache tensor of dtype XINFER_DTYPE_F8_E4M3, shape
   [pages, page_size, n_kv, d], holds in each page its page_size·n_kv·d e4m3 bytes (row (slot, head)
   at byte (slot·n_kv + head)·d) followed by page_size·n_kv f32 scales (row r's at byte
   page_size·n_kv·d + 4·r). Pages are batch.page_stride bytes apart, or page_size·n_kv·(d + 4) when
   page_stride is 0. Scales are 4-byte aligned when d and page_stride are multiples of 4 and the
   cache pointer is (xinfer's pools are); a backend may refuse other layouts in supports_op.
   KV_STORE quantizes each new (token, head) row x[d]: amax = max|x_i| (NaN propagates),
   scale = amax / 448 in f32 (1 if that is 0), q_i = e4m3(x_i / scale) rounded to nearest even,
   saturating to ±448, NaN kept. ATTENTION reads float(q_i) · scale. The stored bytes must match
   the CPU backend exactly (src/backend/cpu/kv_fp8.h is the reference). A backend without fp8
   caches answers supports_op = 0. */

typedef struct xinfer_route_params {
    int32_t scoring;               /* 0 softmax, 1 sigmoid */
    int32_t top_k, n_group, topk_group;
    int32_t norm_topk_prob;        /* renormalise chosen weights (sum + 1e-20) */
    float routed_scaling_factor;   /* applied after renormalisation */
} xinfer_route_params;

typedef struct xinfer_op {
    int32_t type;                  /* xinfer_op_type */
    int32_t layer;                 /* model layer the op belongs to, -1 outside layers (profiling, errors) */
    const char* name;              /* model-level tag ("q_proj", "attention"); may be NULL */
    xinfer_tensor src[8];
    xinfer_tensor dst[2];
    union {
        struct { float eps; } norm;
        struct { int32_t rotary_dim; float theta; } rope;
        struct { int32_t rotary_dim; float theta; float value_scale; } rope_kv_store;
        struct { float eps; int32_t block_rows, block_cols; } norm_matmul; /* blocks as matmul's */
        struct { float factor; } scale;
        struct { int32_t block_rows, block_cols; } matmul; /* f8 weight scale blocks */
        xinfer_attention_params attention;
        xinfer_route_params route;
        struct { xinfer_route_params route; int32_t block_rows, block_cols; } route_experts;
    } params;
    xinfer_attention_batch batch;  /* KV_STORE, ATTENTION, ROPE_KV_STORE */
} xinfer_op;

typedef struct xinfer_device_props {
    char name[128];
    uint64_t total_memory;         /* bytes */
    uint64_t free_memory;          /* bytes, when queried */
    int32_t host_memory;           /* 1: pointers are host pointers (CPU-like backends) */
} xinfer_device_props;

typedef struct xinfer_backend_api {
    uint32_t abi_version;          /* XINFER_BACKEND_ABI_VERSION */
    const char* name;              /* "cpu", "cuda", ... */

    int (*device_count)(void);
    int (*device_props)(int device, xinfer_device_props* out);

    /* A context is one device and one in-order stream; it is not thread-safe. */
    int (*context_create)(int device, void** ctx);
    void (*context_destroy)(void* ctx);
    const char* (*last_error)(void* ctx);

    int (*alloc)(void* ctx, size_t bytes, void** ptr);
    void (*free)(void* ctx, void* ptr);
    int (*upload)(void* ctx, void* dst_device, const void* src_host, size_t bytes);     /* stream-ordered; src_host is read before it returns */
    int (*download)(void* ctx, void* dst_host, const void* src_device, size_t bytes);   /* completes before return */
    int (*copy)(void* ctx, void* dst_device, const void* src_device, size_t bytes);
    int (*synchronize)(void* ctx);
    /* (bytes read + bytes written) / s / 1e9 of a large device-to-device copy, measured now */
    int (*measure_copy_bandwidth)(void* ctx, double* gbps);

    /* 1 if run_op would accept this op (dtypes, shapes, params), else 0. Tensor data may be NULL. */
    int (*supports_op)(void* ctx, const xinfer_op* op);
    int (*run_op)(void* ctx, const xinfer_op* op);

    /* Optional (NULL if unsupported): capture the ops run between begin and end into a graph
       that replays them with the same pointers. */
    int (*graph_begin)(void* ctx);
    int (*graph_end)(void* ctx, void** graph);
    int (*graph_launch)(void* ctx, void* graph);
    void (*graph_destroy)(void* ctx, void* graph);

    /* Optional: device timestamps for the profiler. */
    int (*event_record)(void* ctx, void** event);
    int (*event_elapsed_ms)(void* ctx, void* start, void* end, float* ms); /* synchronizes on end */
    void (*event_destroy)(void* ctx, void* event);
    /* Optional: named ranges for vendor profilers (NVTX on CUDA). */
    void (*range_push)(void* ctx, const char* name);
    void (*range_pop)(void* ctx);

    /* Optional (NULL: xinfer downloads synchronously instead): a stream-ordered copy into host
       memory that returns at once; the bytes are in dst_host once wait_downloads returns, which
       waits for the downloads queued so far and not for work queued after them. The host can
       then queue the next decode step (reading this step's token ids on the device) before it
       waits for this step's ids. Not allowed during graph capture. */
    int (*download_async)(void* ctx, void* dst_host, const void* src_device, size_t bytes);
    int (*wait_downloads)(void* ctx);

    /* Optional (NULL: xinfer stages through upload and download instead): host memory the device
       reads and writes in place (pinned and mapped on CUDA), so that a captured graph can take a
       step's inputs from the host and leave its results there without a copy of its own on the
       stream. Ops and copies take *device; the host reads and writes *host. download and
       download_async accept such memory as their source: they then only wait for the work queued
       before them and copy on the host. The host must not write bytes that queued work may still
       read, nor read bytes it may still write, before waiting for that work. */
    int (*alloc_mapped)(void* ctx, size_t bytes, void** host, void** device);
    void (*free_mapped)(void* ctx, void* host);
} xinfer_backend_api;

/* The one symbol a plugin exports. Returns NULL when no usable device exists on this system. */
typedef const xinfer_backend_api* (*xinfer_backend_init_fn)(void);
#define XINFER_BACKEND_INIT_SYMBOL "xinfer_backend_init"

#ifdef __cplusplus
}
#endif

#endif /* XINFER_BACKEND_ABI_H */
