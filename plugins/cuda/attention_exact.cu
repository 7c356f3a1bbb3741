// Exact f32 attention: one block per (query token, KV head) holds the group's query rows and
// walks the allowed keys [lo, hi] in tiles of kTile, gathering K/V rows through the page table
// into shared memory; scores, the online softmax (initialised with the sink as one extra logit,
// as the CPU does) and the P·V accumulation all stay in f32. A needed key on a released page
// (-1) makes that row's output NaN (the CPU raises an error there).
#include "attention_exact.h"
#include "device_utils.cuh"

#include <cmath>

namespace xcuda {
namespace {

constexpr int kTile = 16;      // keys per shared-memory tile
constexpr int kThreads = 128;

// Shared memory: q [G, dk], k [kTile, dk], v [kTile, dv], p [G, kTile], acc [G, dv], m, l,
// correction [G] — floats.
size_t exact_smem_floats(int group, int dk, int dv) {
    return size_t(group) * dk + size_t(kTile) * (dk + dv) + size_t(group) * kTile + size_t(group) * dv + 3 * size_t(group);
}

// Element d of a cache row as f32: an FP8 value times its row's scale (attention.cu's page
// layout: the page's rows_per_page·dim values, then one f32 scale per row), else the value.
__device__ float cache_value(const void* cache, int dtype, int64_t page_base, int64_t row, int d, int dim,
                             int64_t rows_per_page) {
    if (dtype != XINFER_DTYPE_F8_E4M3) return load_f(cache, dtype, page_base + row * dim + d);
    const float value = fp8_to_float(static_cast<const uint8_t*>(cache)[page_base + row * dim + d]);
    return value * load_fp8_row_scale(cache, page_base + rows_per_page * dim + row * 4);
}

__global__ void exact_attention_kernel(AttnArgs a) {
    extern __shared__ float smem[];
    const int t = blockIdx.x, g = blockIdx.y, group = a.nq / a.nkv;
    float* q = smem;                          // [G, dk]
    float* k = q + group * a.dk;              // [kTile, dk]
    float* v = k + kTile * a.dk;              // [kTile, dv]
    float* p = v + kTile * a.dv;              // [G, kTile]
    float* acc = p + group * kTile;           // [G, dv]
    float* m = acc + group * a.dv;            // [G]
    float* l = m + group;                     // [G]
    float* correction = l + group;            // [G]
    __shared__ int missing_page;

    // The sequence of token t (cu_q_lens is sorted; n_seqs is small).
    int s = 0;
    while (s + 1 < a.n_seqs && a.cu_q_lens[s + 1] <= t) ++s;
    int lo, hi;
    attention_key_range(a.positions[t], a.kv_lens[s], a.causal, a.window, lo, hi);

    for (int i = threadIdx.x; i < group * a.dk; i += blockDim.x)
        q[i] = static_cast<const float*>(a.q)[(int64_t(t) * a.nq + int64_t(g) * group) * a.dk + i];
    for (int i = threadIdx.x; i < group * a.dv; i += blockDim.x) acc[i] = 0.f;
    for (int h = threadIdx.x; h < group; h += blockDim.x) {
        m[h] = a.sinks ? a.sinks[g * group + h] : -INFINITY;
        l[h] = a.sinks ? 1.f : 0.f;
    }
    if (threadIdx.x == 0) missing_page = 0;
    const int64_t rows_per_page = int64_t(a.page_size) * a.nkv;
    __syncthreads();

    for (int64_t j0 = lo; j0 <= hi; j0 += kTile) {
        const int n = int(min(int64_t(kTile), hi - j0 + 1));
        for (int i = threadIdx.x; i < n * (a.dk + a.dv); i += blockDim.x) {
            const int j = i / (a.dk + a.dv), d = i % (a.dk + a.dv);
            const int64_t key = j0 + j;
            const int page = a.page_table[int64_t(s) * a.max_pages + key / a.page_size];
            if (page < 0) {
                missing_page = 1;
                continue;
            }
            const int64_t row = (key % a.page_size) * a.nkv + g;
            if (d < a.dk) k[j * a.dk + d] = cache_value(a.k_cache, a.k_dtype, page * a.k_page_stride, row, d, a.dk, rows_per_page);
            else v[j * a.dv + d - a.dk] = cache_value(a.v_cache, a.v_dtype, page * a.v_page_stride, row, d - a.dk, a.dv, rows_per_page);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < group * n; i += blockDim.x) {
            const int h = i / n, j = i % n;
            float dot = 0.f;
            for (int d = 0; d < a.dk; ++d) dot += q[h * a.dk + d] * k[j * a.dk + d];
            p[h * kTile + j] = a.scale * dot;
        }
        __syncthreads();
        for (int h = threadIdx.x; h < group; h += blockDim.x) {
            float tile_max = m[h];
            for (int j = 0; j < n; ++j) tile_max = fmaxf(tile_max, p[h * kTile + j]);
            float sum = 0.f;
            for (int j = 0; j < n; ++j) {
                p[h * kTile + j] = expf(p[h * kTile + j] - tile_max);
                sum += p[h * kTile + j];
            }
            correction[h] = expf(m[h] - tile_max);
            l[h] = l[h] * correction[h] + sum;
            m[h] = tile_max;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < group * a.dv; i += blockDim.x) {
            const int h = i / a.dv, d = i % a.dv;
            float sum = acc[i] * correction[h];
            for (int j = 0; j < n; ++j) sum += p[h * kTile + j] * v[j * a.dv + d];
            acc[i] = sum;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < group * a.dv; i += blockDim.x) {
        const int h = i / a.dv;
        static_cast<float*>(a.out)[(int64_t(t) * a.nq + int64_t(g) * group) * a.dv + i] = missing_page ? NAN : acc[i] / l[h];
    }
}

}  // namespace

bool exact_attention_supported(int q_dtype, int out_dtype, int k_dtype, int v_dtype) {
    const auto cache_ok = [](int d) {
        return d == XINFER_DTYPE_F32 || d == XINFER_DTYPE_BF16 || d == XINFER_DTYPE_F16 || d == XINFER_DTYPE_F8_E4M3;
    };
    return q_dtype == XINFER_DTYPE_F32 && out_dtype == XINFER_DTYPE_F32 && cache_ok(k_dtype) && cache_ok(v_dtype) &&
           (k_dtype == XINFER_DTYPE_F8_E4M3) == (v_dtype == XINFER_DTYPE_F8_E4M3);
}

int launch_exact_attention(Context* c, const AttnArgs& a) {
    if (a.T == 0 || a.n_seqs == 0) return XINFER_OK;
    const size_t smem = exact_smem_floats(a.nq / a.nkv, a.dk, a.dv) * sizeof(float);
    if (smem > c->smem_optin) {
        set_error(c, "exact f32 attention needs %zu bytes of shared memory, device allows %zu", smem, c->smem_optin);
        return XINFER_ERROR;
    }
    if (smem > 48 * 1024)
        XCUDA_TRY(c, cudaFuncSetAttribute(exact_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    exact_attention_kernel<<<dim3(unsigned(a.T), unsigned(a.nkv)), kThreads, smem, c->stream>>>(a);
    XCUDA_CHECK_LAUNCH(c, "exact_attention_kernel");
    return XINFER_OK;
}

}  // namespace xcuda
