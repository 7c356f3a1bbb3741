// Row-wise and elementwise ops: embedding, rmsnorm, add_rmsnorm, rope, swiglu, scale, add,
// convert. All are memory bound. Activations may be f32, bf16 or f16 (dtype chosen at run time,
// see device_utils.cuh); arithmetic is f32, RMSNorm statistics f32, RoPE angles f64 (as the CPU
// oracle: position · inv_freq in f32 loses ~log2(position) bits).
#include "common.h"
#include "device_utils.cuh"

#include <algorithm>

namespace xcuda {
namespace {

constexpr int kThreads = 256;

int grid_for(const Context* c, int64_t n) {
    return int(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, kThreads), int64_t(c->sm_count) * 16)));
}

// ---- kernels -------------------------------------------------------------------------------------

// out[t, :] = table[ids[t], :]; an id outside [0, vocab) yields a NaN row (the CPU oracle fails).
// Grid (T, hidden chunks of blockDim): one element per thread.
__global__ void embedding_kernel(const void* table /*[vocab, hidden]*/, int table_dtype, const int32_t* ids /*[T]*/,
                                 int64_t vocab, int64_t hidden, void* out /*[T, hidden]*/, int out_dtype) {
    pdl_begin();
    const int64_t t = blockIdx.x, h = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
    if (h >= hidden) return;
    const int32_t id = ids[t];
    const bool valid = id >= 0 && id < vocab;
    const float v = valid ? load_f(table, table_dtype, int64_t(id) * hidden + h) : __int_as_float(0x7fc00000);
    store_f(out, out_dtype, t * hidden + h, v);
}

// One block per row. With `delta` set (add_rmsnorm), x += delta first, rounded to x's dtype and
// written back, and the statistics use the rounded (stored) values, as a model computing its
// residual stream in that dtype would.
//
// Latency, not bandwidth, bounds a decode-sized row (4096 elements): each thread loads all
// kNormPerThread of its elements of a chunk before it stores any, so the loads go out together.
// A loop that stores x[i] before loading x[i + stride] serialises every load behind the previous
// store (the pointers may alias): 16 dependent memory round trips, 14 µs per call on the H200.
constexpr int kNormPerThread = 8;

// kAct >= 0: x, delta and out hold that dtype, kW >= 0: the weight does, fixed at compile time.
// The generic instance (-1, -1) switches on every access's dtype: ~7,000 PTX lines against ~1,000,
// and at one block per decode row the launch is mostly instruction fetch (the same as
// rope_kv_store_kernel's, whose bf16 instance went from 9.3 to 6.5 µs).
template <int kAct, int kW>
__global__ void rmsnorm_kernel(void* x /*[rows, n]*/, int x_dtype, const void* delta /*[rows, n] or null*/,
                               int delta_dtype, const void* weight /*[n]*/, int w_dtype, int64_t n, float eps,
                               void* out /*[rows, n]*/, int out_dtype, int early) {
    if constexpr (kAct >= 0) x_dtype = delta_dtype = out_dtype = kAct;
    if constexpr (kW >= 0) w_dtype = kW;
    __shared__ float partial[32];
    if (!early) pdl_begin();
    const int64_t row = blockIdx.x, base = row * n, chunk = int64_t(kNormPerThread) * blockDim.x;
    // The weights of the first chunk (all of a decode row's) are constant: loaded before pdl_wait,
    // their latency hides behind the previous kernel instead of following the reduction.
    float w_first[kNormPerThread];
#pragma unroll
    for (int k = 0; k < kNormPerThread; ++k) {
        const int64_t i = k * int64_t(blockDim.x) + threadIdx.x;
        w_first[k] = i < n ? load_f(weight, w_dtype, i) : 0.f;
    }
    pdl_begin();
    float sum_squares = 0.f;
    // The first chunk's (rounded) values stay in registers for the second pass: a decode row is
    // one chunk, and reading back what the thread stored was one more L2 round trip after the
    // reduction, on the decode step's dependency chain (H200, batch-1 MiMo decode, the graph alone:
    // bf16 8.470 -> 8.457 ms, FP8 5.752 -> 5.748 ms).
    float v_first[kNormPerThread];
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        float v[kNormPerThread], d[kNormPerThread];
#pragma unroll
        for (int k = 0; k < kNormPerThread; ++k) {
            const int64_t i = c0 + k * int64_t(blockDim.x) + threadIdx.x;
            v[k] = i < n ? load_f(x, x_dtype, base + i) : 0.f;
            d[k] = delta && i < n ? load_f(delta, delta_dtype, base + i) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < kNormPerThread; ++k) {
            const int64_t i = c0 + k * int64_t(blockDim.x) + threadIdx.x;
            if (delta && i < n) {
                v[k] = round_to(x_dtype, v[k] + d[k]);
                store_f(x, x_dtype, base + i, v[k]);
            }
            sum_squares += v[k] * v[k];
            if (c0 == 0) v_first[k] = v[k];
        }
    }
    const float total = block_sum(sum_squares, partial);
    const float inv_rms = rsqrtf(total / float(n) + eps);
    // Later chunks: each thread rereads only the elements it wrote itself, so no barrier is needed.
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        float v[kNormPerThread], w[kNormPerThread];
#pragma unroll
        for (int k = 0; k < kNormPerThread; ++k) {
            const int64_t i = c0 + k * int64_t(blockDim.x) + threadIdx.x;
            v[k] = c0 == 0 ? v_first[k] : i < n ? load_f(x, x_dtype, base + i) : 0.f;
            w[k] = c0 == 0 ? w_first[k] : i < n ? load_f(weight, w_dtype, i) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < kNormPerThread; ++k) {
            const int64_t i = c0 + k * int64_t(blockDim.x) + threadIdx.x;
            if (i < n) store_f(out, out_dtype, base + i, v[k] * inv_rms * w[k]);
        }
    }
}

// NeoX rotate-half on the first rotary_dim dims of every head, in place. Thread → (token
// blockIdx.x, pair j, a group of kRopeHeads heads): it computes its angle once (f64, as the CPU)
// and loads all its heads' pairs before storing any, so the loads of a decode token go out in
// one round trip instead of one per head.
constexpr int kRopeHeads = 8;

__global__ void rope_kernel(void* x /*[T, heads, head_dim]*/, int dtype, const int32_t* positions /*[T]*/,
                            int64_t heads, int64_t head_dim, int rotary_dim, float theta, int early) {
    if (!early) pdl_begin();
    const int half = rotary_dim / 2;
    const int64_t t = blockIdx.x;
    const int64_t p = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;  // (head group, j)
    const int j = int(p % half);
    const int64_t h0 = p / half * kRopeHeads;
    if (h0 >= heads) return;
    // The angle depends only on positions, which the host writes (backend_abi.h): the f64 pow and
    // sincos (~1 µs of dependent math) run before pdl_wait, while the previous kernel finishes.
    const double inv_freq = pow(double(theta), -2.0 * j / double(rotary_dim));
    double s, co;
    sincos(double(positions[t]) * inv_freq, &s, &co);
    pdl_begin();
    float lo[kRopeHeads], hi[kRopeHeads];
#pragma unroll
    for (int k = 0; k < kRopeHeads; ++k) {
        const int64_t base = (t * heads + h0 + k) * head_dim;
        lo[k] = h0 + k < heads ? load_f(x, dtype, base + j) : 0.f;
        hi[k] = h0 + k < heads ? load_f(x, dtype, base + j + half) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kRopeHeads; ++k) {
        if (h0 + k >= heads) break;
        const int64_t base = (t * heads + h0 + k) * head_dim;
        store_f(x, dtype, base + j, lo[k] * float(co) - hi[k] * float(s));
        store_f(x, dtype, base + j + half, hi[k] * float(co) + lo[k] * float(s));
    }
}

__global__ void swiglu_kernel(const void* gate_up /*[rows, 2*inner]*/, int gu_dtype, void* out /*[rows, inner]*/,
                              int out_dtype, int64_t rows, int64_t inner) {
    const int64_t n = rows * inner;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t r = i / inner, j = i % inner;
        const float g = load_f(gate_up, gu_dtype, r * 2 * inner + j);
        const float u = load_f(gate_up, gu_dtype, r * 2 * inner + inner + j);
        store_f(out, out_dtype, i, g / (1.f + expf(-g)) * u);
    }
}

__global__ void scale_kernel(void* x /*[n]*/, int dtype, int64_t n, float factor) {
    pdl_begin();
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        store_f(x, dtype, i, load_f(x, dtype, i) * factor);
}

__global__ void add_kernel(void* x /*[n]*/, int x_dtype, const void* y /*[n]*/, int y_dtype, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        store_f(x, x_dtype, i, load_f(x, x_dtype, i) + load_f(y, y_dtype, i));
}

__global__ void convert_kernel(const void* src /*[n]*/, int src_dtype, void* dst /*[n]*/, int dst_dtype, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        store_f(dst, dst_dtype, i, load_f(src, src_dtype, i));
}

// ---- validation helpers ------------------------------------------------------------------------

bool same_rows_cols(const xinfer_tensor& a, const xinfer_tensor& b) {
    return rows_of(a) == rows_of(b) && cols_of(a) == cols_of(b);
}

int check_norm(Context* c, const xinfer_op* op, const xinfer_tensor& x, const xinfer_tensor& w,
               const xinfer_tensor& out) {
    if (!is_float(x.dtype) || !is_float(w.dtype) || !is_float(out.dtype))
        return unsupported(c, op, "dtypes x %s, weight %s, out %s (f32/bf16/f16 only)", shape_str(x).c_str(),
                           shape_str(w).c_str(), shape_str(out).c_str());
    if (x.rank < 1 || numel(w) != cols_of(x) || !same_rows_cols(x, out))
        return unsupported(c, op, "shapes x %s, weight %s, out %s: expected x [rows, n], weight [n], out like x",
                           shape_str(x).c_str(), shape_str(w).c_str(), shape_str(out).c_str());
    return XINFER_OK;
}

int norm_threads(int64_t n) { return n >= 4096 ? 512 : n >= 1024 ? 256 : 128; }

}  // namespace

// ---- shared launchers ----------------------------------------------------------------------------

int launch_convert(Context* c, const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n) {
    if (n <= 0) return XINFER_OK;
    if (src_dtype == dst_dtype) {
        XCUDA_TRY(c, cudaMemcpyAsync(dst, src, size_t(n) * dtype_size(src_dtype), cudaMemcpyDeviceToDevice, c->stream));
        return XINFER_OK;
    }
    convert_kernel<<<grid_for(c, n), kThreads, 0, c->stream>>>(src, src_dtype, dst, dst_dtype, n);
    XCUDA_CHECK_LAUNCH(c, "convert_kernel");
    return XINFER_OK;
}

int launch_swiglu(Context* c, const void* gate_up, int gu_dtype, void* out, int out_dtype, int64_t rows,
                  int64_t inner) {
    if (rows * inner <= 0) return XINFER_OK;
    swiglu_kernel<<<grid_for(c, rows * inner), kThreads, 0, c->stream>>>(gate_up, gu_dtype, out, out_dtype, rows,
                                                                         inner);
    XCUDA_CHECK_LAUNCH(c, "swiglu_kernel");
    return XINFER_OK;
}

// ---- ops -----------------------------------------------------------------------------------------

int op_embedding(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &table = op->src[0], &ids = op->src[1], &out = op->dst[0];
    if (!is_float(table.dtype) || ids.dtype != XINFER_DTYPE_I32 || !is_float(out.dtype))
        return unsupported(c, op, "dtypes table %s, ids %s, out %s (table/out f32/bf16/f16, ids i32)",
                           shape_str(table).c_str(), shape_str(ids).c_str(), shape_str(out).c_str());
    const int64_t T = numel(ids);
    if (table.rank != 2 || rows_of(out) != T || cols_of(out) != table.shape[1])
        return unsupported(c, op, "shapes table %s, ids %s, out %s: expected table [vocab, hidden], out [T, hidden]",
                           shape_str(table).c_str(), shape_str(ids).c_str(), shape_str(out).c_str());
    if (!run || T == 0) return XINFER_OK;
    return launch_pdl(c, "embedding_kernel", embedding_kernel,
                      dim3(unsigned(T), unsigned(ceil_div(table.shape[1], kThreads))), dim3(kThreads), 0, table.data,
                      table.dtype, static_cast<const int32_t*>(ids.data), table.shape[0], table.shape[1], out.data,
                      out.dtype);
}

// RMSNORM / ADD_RMSNORM (delta = the added x, or null): the bf16-activation instances when every
// activation is bf16, else the generic one.
int launch_rmsnorm(Context* c, int64_t rows, int64_t n, void* x, int x_dtype, const void* delta, int delta_dtype,
                   const xinfer_tensor& w, float eps, const xinfer_tensor& out) {
    const char* what = delta ? "rmsnorm_kernel(add)" : "rmsnorm_kernel";
    constexpr int bf16 = XINFER_DTYPE_BF16, f32 = XINFER_DTYPE_F32;
    auto kernel = rmsnorm_kernel<-1, -1>;
    if (x_dtype == bf16 && delta_dtype == bf16 && out.dtype == bf16) {
        if (w.dtype == bf16) kernel = rmsnorm_kernel<bf16, bf16>;
        if (w.dtype == f32) kernel = rmsnorm_kernel<bf16, f32>;
    }
    return launch_pdl(c, what, kernel, dim3(unsigned(rows)), dim3(norm_threads(n)), 0, x, x_dtype, delta, delta_dtype,
                      static_cast<const void*>(w.data), w.dtype, n, eps, out.data, out.dtype, int(early_reads()));
}

int op_rmsnorm(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &x = op->src[0], &w = op->src[1], &out = op->dst[0];
    if (int rc = check_norm(c, op, x, w, out)) return rc;
    const int64_t rows = rows_of(x), n = cols_of(x);
    if (!run || rows == 0) return XINFER_OK;
    return launch_rmsnorm(c, rows, n, x.data, x.dtype, nullptr, x.dtype, w, op->params.norm.eps, out);
}

int op_add_rmsnorm(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &residual = op->src[0], &x = op->src[1], &w = op->src[2], &out = op->dst[0];
    if (int rc = check_norm(c, op, residual, w, out)) return rc;
    if (!is_float(x.dtype) || !same_rows_cols(x, residual))
        return unsupported(c, op, "x %s must match residual %s (f32/bf16/f16)", shape_str(x).c_str(),
                           shape_str(residual).c_str());
    const int64_t rows = rows_of(x), n = cols_of(x);
    if (!run || rows == 0) return XINFER_OK;
    return launch_rmsnorm(c, rows, n, residual.data, residual.dtype, x.data, x.dtype, w, op->params.norm.eps, out);
}

int op_rope(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &x = op->src[0], &positions = op->src[1];
    const int rotary_dim = op->params.rope.rotary_dim;
    if (!is_float(x.dtype) || positions.dtype != XINFER_DTYPE_I32)
        return unsupported(c, op, "dtypes x %s, positions %s (x f32/bf16/f16, positions i32)", shape_str(x).c_str(),
                           shape_str(positions).c_str());
    if (x.rank != 3 || numel(positions) != x.shape[0] || rotary_dim <= 0 || rotary_dim % 2 != 0 ||
        rotary_dim > x.shape[2])
        return unsupported(c, op, "x %s, positions %s, rotary_dim %d: expected x [T, heads, head_dim], positions [T], "
                           "even rotary_dim in (0, head_dim]",
                           shape_str(x).c_str(), shape_str(positions).c_str(), rotary_dim);
    const int64_t T = x.shape[0];
    if (!run || T == 0) return XINFER_OK;
    const int64_t pairs = ceil_div(x.shape[1], kRopeHeads) * (rotary_dim / 2);
    return launch_pdl(c, "rope_kernel", rope_kernel, dim3(unsigned(T), unsigned(ceil_div(pairs, 64))), dim3(64), 0,
                      x.data, x.dtype, static_cast<const int32_t*>(positions.data), x.shape[1], x.shape[2],
                      rotary_dim, op->params.rope.theta, int(early_reads()));
}

int op_swiglu(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &gate_up = op->src[0], &out = op->dst[0];
    if (!is_float(gate_up.dtype) || !is_float(out.dtype))
        return unsupported(c, op, "dtypes gate_up %s, out %s (f32/bf16/f16)", shape_str(gate_up).c_str(),
                           shape_str(out).c_str());
    const int64_t rows = rows_of(out), inner = cols_of(out);
    if (out.rank < 1 || rows_of(gate_up) != rows || cols_of(gate_up) != 2 * inner)
        return unsupported(c, op, "gate_up %s must be [T, 2*I] for out %s = [T, I]", shape_str(gate_up).c_str(),
                           shape_str(out).c_str());
    if (!run) return XINFER_OK;
    return launch_swiglu(c, gate_up.data, gate_up.dtype, out.data, out.dtype, rows, inner);
}

int op_scale(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor& x = op->src[0];
    if (!is_float(x.dtype) || x.rank < 1)
        return unsupported(c, op, "x %s (f32/bf16/f16)", shape_str(x).c_str());
    const int64_t n = numel(x);
    if (!run || n == 0) return XINFER_OK;
    return launch_pdl(c, "scale_kernel", scale_kernel, dim3(grid_for(c, n)), dim3(kThreads), 0, x.data, x.dtype, n,
                      op->params.scale.factor);
}

int op_add(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &x = op->src[0], &y = op->src[1];
    if (!is_float(x.dtype) || !is_float(y.dtype) || x.rank < 1 || !same_rows_cols(x, y))
        return unsupported(c, op, "x %s, y %s: f32/bf16/f16 of the same [rows, n]", shape_str(x).c_str(),
                           shape_str(y).c_str());
    const int64_t n = numel(x);
    if (!run || n == 0) return XINFER_OK;
    add_kernel<<<grid_for(c, n), kThreads, 0, c->stream>>>(x.data, x.dtype, y.data, y.dtype, n);
    XCUDA_CHECK_LAUNCH(c, "add_kernel");
    return XINFER_OK;
}

int op_convert(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &src = op->src[0], &dst = op->dst[0];
    if (!is_float(src.dtype) || !is_float(dst.dtype) || src.rank < 1 || numel(src) != numel(dst))
        return unsupported(c, op, "src %s, dst %s: f32/bf16/f16 with equal element counts", shape_str(src).c_str(),
                           shape_str(dst).c_str());
    if (!run) return XINFER_OK;
    return launch_convert(c, src.data, src.dtype, dst.data, dst.dtype, numel(src));
}

}  // namespace xcuda
