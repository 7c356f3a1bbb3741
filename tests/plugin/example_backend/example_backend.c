/*
 * libxinfer-example.so: a minimal out-of-tree xinfer backend, written against
 * include/xinfer/backend_abi.h alone (plain C, no xinfer sources, no xinfer library).
 *
 * It is what a vendor's first day of porting looks like: memory, copies and five ops done
 * simply on the host (EMBEDDING, RMSNORM, ADD, SCALE, and MATMUL with f32 weights), in f32 or
 * bf16 activations; supports_op says 0 for everything else, so `xinfer ops-test --backend
 * example` reports those cases UNSUPPORTED and the engine knows not to route them here. No graph
 * capture, no events (both optional in the ABI). docs/PLUGINS.md walks through this file.
 *
 * Test hooks (environment, read when a context is created):
 *   XINFER_EXAMPLE_DEVICE_MEMORY=1  report host_memory = 0, as an accelerator would; ops-test
 *                                   then runs bf16 activations where supports_op accepts them
 *   XINFER_EXAMPLE_FAULT=rmsnorm_unwritten | matmul_off
 *                                   leave the last element of every RMSNORM output unwritten /
 *                                   scale MATMUL outputs by 1.001: bugs ops-test must catch
 * Built with -DEXAMPLE_ABI_VERSION=999 it reports a wrong ABI version (the loader must refuse it).
 */
#include "xinfer/backend_abi.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef EXAMPLE_ABI_VERSION
#define EXAMPLE_ABI_VERSION XINFER_BACKEND_ABI_VERSION
#endif

#define EXPORT __attribute__((visibility("default")))

enum { FAULT_NONE, FAULT_RMSNORM_UNWRITTEN, FAULT_MATMUL_OFF };

/* One context = one device + one in-order stream. Here the "stream" is the calling thread:
   every call completes before it returns, so synchronize has nothing to wait for. */
typedef struct context {
    char error[512];
    int fault;
} context;

static int device_memory_mode(void) {
    const char* v = getenv("XINFER_EXAMPLE_DEVICE_MEMORY");
    return v && strcmp(v, "1") == 0;
}

static int set_error(context* c, int status, const char* format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(c->error, sizeof c->error, format, args);
    va_end(args);
    return status;
}

/* ---- tensors -------------------------------------------------------------------------------- */

static int present(const xinfer_tensor* t) { return t->rank > 0; }

static int64_t numel(const xinfer_tensor* t) {
    int64_t n = 1;
    for (int i = 0; i < t->rank; ++i) n *= t->shape[i];
    return t->rank > 0 ? n : 0;
}

static int64_t cols(const xinfer_tensor* t) { return t->rank > 0 ? t->shape[t->rank - 1] : 0; }
static int64_t rows(const xinfer_tensor* t) { return cols(t) > 0 ? numel(t) / cols(t) : 0; }

/* Activations may be f32 or bf16; weights f32 or bf16 (MATMUL: f32 only, for now). */
static int is_act(int dtype) { return dtype == XINFER_DTYPE_F32 || dtype == XINFER_DTYPE_BF16; }

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float get(const xinfer_tensor* t, int64_t i) {
    if (t->dtype == XINFER_DTYPE_F32) return ((const float*)t->data)[i];
    return bf16_to_f32(((const uint16_t*)t->data)[i]);
}

static void put(const xinfer_tensor* t, int64_t i, float v) {
    if (t->dtype == XINFER_DTYPE_F32) ((float*)t->data)[i] = v;
    else ((uint16_t*)t->data)[i] = f32_to_bf16(v);
}

static int same_shape(const xinfer_tensor* a, const xinfer_tensor* b) {
    if (a->rank != b->rank) return 0;
    for (int i = 0; i < a->rank; ++i)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

/* ---- which ops, dtypes and shapes this backend accepts (tensor data may be NULL here) ------- */

static int check_op(context* c, const xinfer_op* op) {
    const xinfer_tensor* s = op->src;
    const xinfer_tensor* d = op->dst;
    switch (op->type) {
        case XINFER_OP_EMBEDDING: /* table [V, H] f32|bf16, ids [T] i32, out [T, H] */
            if (s[0].rank == 2 && is_act(s[0].dtype) && s[1].dtype == XINFER_DTYPE_I32 && is_act(d[0].dtype) &&
                rows(&d[0]) == numel(&s[1]) && cols(&d[0]) == s[0].shape[1])
                return XINFER_OK;
            break;
        case XINFER_OP_RMSNORM: /* x [R, N], w [N] f32|bf16, out like x */
            if (is_act(s[0].dtype) && is_act(s[1].dtype) && is_act(d[0].dtype) && numel(&s[1]) == cols(&s[0]) &&
                rows(&d[0]) == rows(&s[0]) && cols(&d[0]) == cols(&s[0]))
                return XINFER_OK;
            break;
        case XINFER_OP_ADD: /* x += y, same shape */
            if (is_act(s[0].dtype) && is_act(s[1].dtype) && same_shape(&s[0], &s[1])) return XINFER_OK;
            break;
        case XINFER_OP_SCALE:
            if (is_act(s[0].dtype)) return XINFER_OK;
            break;
        case XINFER_OP_MATMUL: /* x [T, K], w [N, K] f32 (no block scales), y [T, N] */
            if (is_act(s[0].dtype) && s[1].rank == 2 && s[1].dtype == XINFER_DTYPE_F32 && !present(&s[2]) &&
                is_act(d[0].dtype) && cols(&s[0]) == s[1].shape[1] && rows(&d[0]) == rows(&s[0]) &&
                cols(&d[0]) == s[1].shape[0])
                return XINFER_OK;
            break;
        default: return set_error(c, XINFER_UNSUPPORTED, "example: op type %d is not implemented", op->type);
    }
    return set_error(c, XINFER_UNSUPPORTED, "example: op type %d: these dtypes or shapes are not implemented",
                     op->type);
}

/* ---- the ops ------------------------------------------------------------------------------------ */

static int run_embedding(context* c, const xinfer_op* op) {
    const xinfer_tensor *table = &op->src[0], *ids = &op->src[1], *out = &op->dst[0];
    const int64_t vocab = table->shape[0], hidden = table->shape[1], T = numel(ids);
    for (int64_t t = 0; t < T; ++t) {
        const int32_t id = ((const int32_t*)ids->data)[t];
        if (id < 0 || id >= vocab)
            return set_error(c, XINFER_ERROR, "example embedding: token id %d at %lld is outside [0, %lld)", id,
                             (long long)t, (long long)vocab);
        for (int64_t h = 0; h < hidden; ++h) put(out, t * hidden + h, get(table, (int64_t)id * hidden + h));
    }
    return XINFER_OK;
}

static int run_rmsnorm(context* c, const xinfer_op* op) {
    const xinfer_tensor *x = &op->src[0], *w = &op->src[1], *out = &op->dst[0];
    const int64_t R = rows(x), N = cols(x);
    for (int64_t r = 0; r < R; ++r) {
        double sum_squares = 0;
        for (int64_t i = 0; i < N; ++i) {
            const double v = get(x, r * N + i);
            sum_squares += v * v;
        }
        const float inv_rms = (float)(1.0 / sqrt(sum_squares / (double)N + op->params.norm.eps));
        int64_t n_written = N;
        if (c->fault == FAULT_RMSNORM_UNWRITTEN && r == R - 1) n_written = N - 1;
        for (int64_t i = 0; i < n_written; ++i) put(out, r * N + i, get(x, r * N + i) * inv_rms * get(w, i));
    }
    return XINFER_OK;
}

static int run_add(const xinfer_op* op) {
    const xinfer_tensor *x = &op->src[0], *y = &op->src[1];
    for (int64_t i = 0, n = numel(x); i < n; ++i) put(x, i, get(x, i) + get(y, i));
    return XINFER_OK;
}

static int run_scale(const xinfer_op* op) {
    const xinfer_tensor* x = &op->src[0];
    for (int64_t i = 0, n = numel(x); i < n; ++i) put(x, i, get(x, i) * op->params.scale.factor);
    return XINFER_OK;
}

static int run_matmul(context* c, const xinfer_op* op) {
    const xinfer_tensor *x = &op->src[0], *w = &op->src[1], *y = &op->dst[0];
    const int64_t T = rows(x), K = cols(x), N = w->shape[0];
    const float* wd = (const float*)w->data;
    const float off = c->fault == FAULT_MATMUL_OFF ? 1.001f : 1.f;
    float* row = malloc(sizeof(float) * (size_t)(K > 0 ? K : 1));
    if (!row) return set_error(c, XINFER_OUT_OF_MEMORY, "example matmul: no memory for a row of %lld", (long long)K);
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t k = 0; k < K; ++k) row[k] = get(x, t * K + k);
        for (int64_t n = 0; n < N; ++n) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; ++k) acc += row[k] * wd[n * K + k];
            put(y, t * N + n, acc * off);
        }
    }
    free(row);
    return XINFER_OK;
}

/* ---- the table's entry points ----------------------------------------------------------------- */

static int device_count(void) { return 1; }

static int device_props(int device, xinfer_device_props* out) {
    if (device != 0) return XINFER_ERROR;
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "example host backend");
    out->total_memory = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGE_SIZE);
    out->free_memory = (uint64_t)sysconf(_SC_AVPHYS_PAGES) * (uint64_t)sysconf(_SC_PAGE_SIZE);
    out->host_memory = device_memory_mode() ? 0 : 1;
    return XINFER_OK;
}

static int context_create(int device, void** out) {
    *out = NULL;
    if (device != 0) return XINFER_ERROR;
    context* c = calloc(1, sizeof(context));
    if (!c) return XINFER_OUT_OF_MEMORY;
    const char* fault = getenv("XINFER_EXAMPLE_FAULT");
    if (fault && strcmp(fault, "rmsnorm_unwritten") == 0) c->fault = FAULT_RMSNORM_UNWRITTEN;
    if (fault && strcmp(fault, "matmul_off") == 0) c->fault = FAULT_MATMUL_OFF;
    *out = c;
    return XINFER_OK;
}

static void context_destroy(void* ctx) { free(ctx); }
static const char* last_error(void* ctx) { return ((context*)ctx)->error; }

static int alloc(void* ctx, size_t bytes, void** ptr) {
    /* 64-byte aligned; aligned_alloc needs a size that is a multiple of the alignment. */
    *ptr = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!*ptr) return set_error(ctx, XINFER_OUT_OF_MEMORY, "example: cannot allocate %zu bytes", bytes);
    return XINFER_OK;
}
static void free_memory(void* ctx, void* ptr) {
    (void)ctx;
    free(ptr);
}
/* Host memory: upload, download and device copies are all memcpy, complete on return. */
static int copy_bytes(void* ctx, void* dst, const void* src, size_t bytes) {
    (void)ctx;
    if (bytes) memcpy(dst, src, bytes);
    return XINFER_OK;
}
static int synchronize(void* ctx) {
    (void)ctx;
    return XINFER_OK;
}

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* (bytes read + bytes written) / s of a 64 MiB memcpy, best of 3. */
static int measure_copy_bandwidth(void* ctx, double* gbps) {
    const size_t bytes = (size_t)64 << 20;
    char* src = malloc(bytes);
    char* dst = malloc(bytes);
    if (!src || !dst) {
        free(src);
        free(dst);
        return set_error(ctx, XINFER_OUT_OF_MEMORY, "example: no memory for the bandwidth probe");
    }
    memset(src, 1, bytes);
    memcpy(dst, src, bytes);
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
        const double start = seconds();
        memcpy(dst, src, bytes);
        const double elapsed = seconds() - start;
        if (elapsed < best) best = elapsed;
    }
    free(src);
    free(dst);
    *gbps = 2.0 * (double)bytes / best / 1e9;
    return XINFER_OK;
}

static int supports_op(void* ctx, const xinfer_op* op) { return check_op(ctx, op) == XINFER_OK; }

static int run_op(void* ctx, const xinfer_op* op) {
    context* c = ctx;
    const int status = check_op(c, op);
    if (status != XINFER_OK) return status;
    switch (op->type) {
        case XINFER_OP_EMBEDDING: return run_embedding(c, op);
        case XINFER_OP_RMSNORM: return run_rmsnorm(c, op);
        case XINFER_OP_ADD: return run_add(op);
        case XINFER_OP_SCALE: return run_scale(op);
        case XINFER_OP_MATMUL: return run_matmul(c, op);
        default: return set_error(c, XINFER_UNSUPPORTED, "example: op type %d is not implemented", op->type);
    }
}

static const xinfer_backend_api example_api = {
    .abi_version = EXAMPLE_ABI_VERSION,
    .name = "example",
    .device_count = device_count,
    .device_props = device_props,
    .context_create = context_create,
    .context_destroy = context_destroy,
    .last_error = last_error,
    .alloc = alloc,
    .free = free_memory,
    .upload = copy_bytes,
    .download = copy_bytes,
    .copy = copy_bytes,
    .synchronize = synchronize,
    .measure_copy_bandwidth = measure_copy_bandwidth,
    .supports_op = supports_op,
    .run_op = run_op,
    /* graph_*, event_*, range_*, download_async, wait_downloads: NULL (optional) */
};

/* The one exported symbol. Returning NULL would mean "no usable device on this machine". */
EXPORT const xinfer_backend_api* xinfer_backend_init(void) { return &example_api; }
