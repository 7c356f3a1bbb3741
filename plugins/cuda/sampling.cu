// ARGMAX and SAMPLE, one block per row of logits.
//
// SAMPLE follows the host sampler (src/sample/sampler.cpp) exactly, without sorting the
// vocabulary: "sort by logit descending (ties: lower index), keep top_k, softmax at temperature
// in f64, keep the smallest prefix with mass ≥ top_p, draw u · kept_mass and walk the prefix"
// only ever asks for *the element of the sorted order at which a running sum first crosses a
// target* (the k-th element for top-k, the top-p cut, the drawn token). Giving every element
// the unique 64-bit key (monotone bits of its logit, then the complement of its index), that
// element is found by an MSB-first radix select: per 8-bit digit, a 256-bin histogram of counts
// (or probability mass) of the candidates, a scan from the top digit for the crossing, and on to
// the next digit within the chosen bin, stopping early once the bin holds one element. Each
// pass is one read of the row (L2-resident after the first).
#include "common.h"
#include "device_utils.cuh"

#include <algorithm>

namespace xcuda {
namespace {

constexpr int kThreads = 1024;

// Descending key order = descending logit, then ascending index. NaN sorts below -inf.
__device__ __forceinline__ uint64_t sort_key(float v, int64_t i) {
    uint32_t b = __float_as_uint(v);
    b = isnan(v) ? 0u : ((b & 0x80000000u) ? ~b : (b | 0x80000000u));
    return (uint64_t(b) << 32) | uint64_t(0xffffffffu - uint32_t(i));
}
__device__ __forceinline__ int32_t index_of(uint64_t key) { return int32_t(0xffffffffu - uint32_t(key)); }

struct SelectShared {
    double mass[256];
    unsigned int count[256];
    double above;
    uint64_t key;
    int chosen, unique;
};

struct Row {
    const void* logits;  // [V]
    int dtype;
    int64_t V;
    double max_logit, temperature;
    __device__ float logit(int64_t i) const { return load_f(logits, dtype, i); }
    __device__ double prob(float l) const { return isnan(l) ? 0.0 : exp((double(l) - max_logit) / temperature); }
};

// The key of the first element, in descending key order over {keys ≥ floor}, at which the
// running weight (1 per element, or its probability) reaches `target` (≥, or > when strict).
// Returns false when the total weight never gets there. All threads must call it.
__device__ bool block_select(const Row& row, uint64_t floor, double target, bool strict, bool by_prob,
                             SelectShared& sh, uint64_t* out_key) {
    uint64_t prefix = 0;
    double above = 0.0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) {
            sh.mass[i] = 0.0;
            sh.count[i] = 0;
        }
        __syncthreads();
        for (int64_t i = threadIdx.x; i < row.V; i += blockDim.x) {
            const float l = row.logit(i);
            const uint64_t key = sort_key(l, i);
            if (key < floor || (shift < 56 && (key >> (shift + 8)) != prefix)) continue;
            const int d = int((key >> shift) & 255u);
            atomicAdd(&sh.count[d], 1u);
            if (by_prob) atomicAdd(&sh.mass[d], row.prob(l));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double cum = above;
            int chosen = -1;
            for (int d = 255; d >= 0; --d) {
                if (sh.count[d] == 0) continue;
                const double next = cum + (by_prob ? sh.mass[d] : double(sh.count[d]));
                if (strict ? next > target : next >= target) {
                    chosen = d;
                    break;
                }
                cum = next;
            }
            sh.chosen = chosen;
            sh.above = cum;
            sh.unique = chosen >= 0 && sh.count[chosen] == 1;
        }
        __syncthreads();
        const int chosen = sh.chosen;
        if (chosen < 0) return false;
        above = sh.above;
        prefix = (prefix << 8) | uint64_t(chosen);
        if (sh.unique && shift > 0) {
            // One candidate left: find it instead of resolving the remaining digits.
            for (int64_t i = threadIdx.x; i < row.V; i += blockDim.x) {
                const uint64_t key = sort_key(row.logit(i), i);
                if (key >= floor && (key >> shift) == prefix) sh.key = key;
            }
            __syncthreads();
            *out_key = sh.key;
            __syncthreads();
            return true;
        }
    }
    *out_key = prefix;
    return true;
}

// Σ prob over keys ≥ floor.
__device__ double block_mass(const Row& row, uint64_t floor, double* shared) {
    double local = 0.0;
    for (int64_t i = threadIdx.x; i < row.V; i += blockDim.x) {
        const float l = row.logit(i);
        if (sort_key(l, i) >= floor) local += row.prob(l);
    }
    return block_sum(local, shared);
}

__device__ ArgBest row_argmax(const void* logits, int dtype, int64_t V, ArgBest* shared) {
    ArgBest best{0.f, -1};
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
        best = arg_better(best, ArgBest{load_f(logits, dtype, i), int32_t(i)});
    return block_arg_best(best, shared);
}

__global__ void __launch_bounds__(kThreads) argmax_kernel(const void* logits /*[R, V]*/, int dtype, int64_t V,
                                                          int32_t* out /*[R]*/) {
    __shared__ ArgBest shared[32];
    pdl_begin();
    const int64_t r = blockIdx.x;
    const ArgBest best = row_argmax(static_cast<const char*>(logits) + r * V * int64_t(dtype_bytes(dtype)), dtype, V,
                                    shared);
    if (threadIdx.x == 0) out[r] = best.index < 0 ? 0 : best.index;
}

// Long rows (a 152K-entry vocabulary) in slices: one block per row walked ~150 loads per thread
// and took 66 µs on H200 (ncu, a batch-1 decode step). argmax_slice_kernel reduces slice s of
// row r to one candidate, argmax_merge_kernel picks each row's best in slice order; arg_better
// is a total order (larger value, then lower index; NaN never wins), so the result is the
// one-block result.
constexpr int kSliceThreads = 256;
constexpr int64_t kSliceLength = 2048;
constexpr int kMaxSlices = 128;

__global__ void __launch_bounds__(kSliceThreads) argmax_slice_kernel(const void* logits /*[R, V]*/, int dtype,
                                                                     int64_t V, int64_t slice,
                                                                     ArgBest* partial /*[R, slices]*/) {
    __shared__ ArgBest shared[32];
    pdl_begin();
    const int64_t r = blockIdx.x, begin = int64_t(blockIdx.y) * slice, end = min(V, begin + slice);
    const char* row = static_cast<const char*>(logits) + r * V * int64_t(dtype_bytes(dtype));
    ArgBest best{0.f, -1};
#pragma unroll 8
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
        best = arg_better(best, ArgBest{load_f(row, dtype, i), int32_t(i)});
    best = block_arg_best(best, shared);
    if (threadIdx.x == 0) partial[r * gridDim.y + blockIdx.y] = best;
}

// One warp per row.
__global__ void argmax_merge_kernel(const ArgBest* partial /*[R, slices]*/, int slices, int32_t* out /*[R]*/) {
    pdl_begin();
    const int64_t r = blockIdx.x;
    ArgBest best{0.f, -1};
    for (int s = threadIdx.x; s < slices; s += 32) best = arg_better(best, partial[r * slices + s]);
    best = warp_arg_best(best);
    if (threadIdx.x == 0) out[r] = best.index < 0 ? 0 : best.index;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const void* logits /*[R, V]*/, int dtype, int64_t V,
                                                          const float* temperature /*[R]*/, const float* top_p /*[R]*/,
                                                          const int32_t* top_k /*[R]*/, const float* uniform /*[R]*/,
                                                          int32_t* out /*[R]*/) {
    __shared__ SelectShared sh;
    __shared__ ArgBest arg_shared[32];
    __shared__ double sum_shared[32];
    const int64_t r = blockIdx.x;
    const void* row_logits = static_cast<const char*>(logits) + r * V * int64_t(dtype_bytes(dtype));
    const ArgBest best = row_argmax(row_logits, dtype, V, arg_shared);
    const float temp = temperature[r];
    if (!(temp > 0.f) || best.index < 0) {
        if (threadIdx.x == 0) out[r] = best.index < 0 ? 0 : best.index;
        return;
    }
    const Row row{row_logits, dtype, V, double(best.value), double(temp)};

    uint64_t floor = 0;  // keys ≥ floor are kept
    const int k = top_k[r];
    if (k > 0 && k < V) block_select(row, 0, double(k), false, false, sh, &floor);
    const double total = block_mass(row, floor, sum_shared);
    const float p = top_p[r];
    if (p < 1.f) {
        uint64_t cut;
        if (block_select(row, floor, double(p) * total, false, true, sh, &cut)) floor = cut;
    }
    const double kept = block_mass(row, floor, sum_shared);
    uint64_t drawn = floor;  // rounding left the draw past the end: the last kept token
    block_select(row, floor, double(uniform[r]) * kept, true, true, sh, &drawn);
    if (threadIdx.x == 0) out[r] = index_of(drawn);
}

bool logits_ok(const xinfer_tensor& t) { return t.rank == 2 && is_act(t.dtype); }

}  // namespace

int op_argmax(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &logits = op->src[0], &out = op->dst[0];
    if (!logits_ok(logits) || out.dtype != XINFER_DTYPE_I32 || numel(out) != logits.shape[0] ||
        logits.shape[1] >= (int64_t(1) << 31))
        return unsupported(c, op, "logits %s, out %s: expected logits [R, V] f32/bf16, out [R] i32",
                           shape_str(logits).c_str(), shape_str(out).c_str());
    const int64_t R = logits.shape[0], V = logits.shape[1];
    if (!run || R == 0) return XINFER_OK;
    const int slices = int(std::min<int64_t>(kMaxSlices, ceil_div(V, kSliceLength)));
    if (slices < 4 || R > 65535)
        return launch_pdl(c, "argmax_kernel", argmax_kernel, dim3(unsigned(R)), dim3(kThreads), 0, logits.data,
                          logits.dtype, V, static_cast<int32_t*>(out.data));
    ScratchPlan plan;
    const size_t off_partial = plan.add(size_t(R) * slices * sizeof(ArgBest));
    if (int rc = ensure_scratch(c, plan.total)) return rc;
    auto* partial = reinterpret_cast<ArgBest*>(c->scratch + off_partial);
    if (int rc = launch_pdl(c, "argmax_slice_kernel", argmax_slice_kernel, dim3(unsigned(R), unsigned(slices)),
                            dim3(kSliceThreads), 0, logits.data, logits.dtype, V, ceil_div(V, slices), partial))
        return rc;
    return launch_pdl(c, "argmax_merge_kernel", argmax_merge_kernel, dim3(unsigned(R)), dim3(32), 0,
                      static_cast<const ArgBest*>(partial), slices, static_cast<int32_t*>(out.data));
}

int op_sample(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &logits = op->src[0], &temperature = op->src[1], &top_p = op->src[2], &top_k = op->src[3],
                        &uniform = op->src[4], &out = op->dst[0];
    const int64_t R = logits.rank == 2 ? logits.shape[0] : -1;
    auto per_row = [&](const xinfer_tensor& t, int dtype) { return t.dtype == dtype && numel(t) == R; };
    if (!logits_ok(logits) || logits.shape[1] >= (int64_t(1) << 31) || !per_row(temperature, XINFER_DTYPE_F32) ||
        !per_row(top_p, XINFER_DTYPE_F32) || !per_row(top_k, XINFER_DTYPE_I32) ||
        !per_row(uniform, XINFER_DTYPE_F32) || !per_row(out, XINFER_DTYPE_I32))
        return unsupported(c, op, "logits %s, temperature %s, top_p %s, top_k %s, uniform %s, out %s: expected logits "
                           "[R, V] f32/bf16, per-row f32/f32/i32/f32, out [R] i32",
                           shape_str(logits).c_str(), shape_str(temperature).c_str(), shape_str(top_p).c_str(),
                           shape_str(top_k).c_str(), shape_str(uniform).c_str(), shape_str(out).c_str());
    if (!run || R == 0) return XINFER_OK;
    sample_kernel<<<unsigned(R), kThreads, 0, c->stream>>>(
        logits.data, logits.dtype, logits.shape[1], static_cast<const float*>(temperature.data),
        static_cast<const float*>(top_p.data), static_cast<const int32_t*>(top_k.data),
        static_cast<const float*>(uniform.data), static_cast<int32_t*>(out.data));
    XCUDA_CHECK_LAUNCH(c, "sample_kernel");
    return XINFER_OK;
}

}  // namespace xcuda
