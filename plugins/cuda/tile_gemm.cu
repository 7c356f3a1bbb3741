// The tiled tensor-core GEMM (FP8 block-scaled weights dequantized tile by tile into shared
// memory as bf16; dense, or over a device-built tile list for the grouped expert GEMMs of moe.cu)
// and the warp-per-column few-row GEMV. Declared in gemm.h; MATMUL's routing is in gemm.cu.
#include "gemm.h"

#include "device_utils.cuh"

#include <mma.h>

namespace xcuda {
namespace {

using namespace nvcuda;

// ---- the custom GEMM kernel ------------------------------------------------------------------------

constexpr int kBM = kGemmTileM, kBN = kGemmTileN, kBK = 32;
constexpr int kLds = kBK + 8;        // bf16 row stride in shared memory: 80 B keeps 16-B stores aligned and
                                     // spreads the 16 rows a fragment load touches over the banks
constexpr int kLdc = kBN + 4;        // f32 staging stride for the epilogue
constexpr int kGemmThreads = 128;    // 4 warps, 2×2, each a 32×32 block of C (2×2 wmma 16×16 fragments)

struct GemmFlags {
    bool a_vec, b_vec;  // 16-byte vector loads are legal (alignment and strides)
};

__global__ void __launch_bounds__(kGemmThreads) grouped_gemm_kernel(GroupedGemm p, GemmFlags flags) {
    __shared__ __align__(128) __nv_bfloat16 As[2][kBM][kLds];
    __shared__ __align__(128) __nv_bfloat16 Bs[2][kBN][kLds];
    __shared__ __align__(128) float Cs[kBM][kLdc];

    int64_t group = 0, row_begin, row_end;
    if (p.tiles) {
        if (int(blockIdx.x) >= *p.n_tiles) return;
        const int4 t = p.tiles[blockIdx.x];
        group = t.x;
        row_begin = t.y;
        row_end = t.z;
    } else {
        row_begin = int64_t(blockIdx.x) * kBM;
        row_end = min(p.m, row_begin + kBM);
    }
    const int64_t n0 = int64_t(blockIdx.y) * kBN;
    const int tid = threadIdx.x;

    // A: each thread stages two 8-element chunks per K step, rows tid/4 and tid/4 + 32.
    const int a_col = (tid % 4) * 8;
    const __nv_bfloat16* a_ptr[2];
    for (int i = 0; i < 2; ++i) {
        const int64_t r = row_begin + tid / 4 + 32 * i;
        a_ptr[i] = nullptr;
        if (r < row_end) {
            const int64_t src = p.a_rows ? int64_t(p.a_rows[r]) / p.a_row_div : r;
            a_ptr[i] = p.a + src * p.lda;
        }
    }
    // B bf16: like A. B f8: one 16-byte chunk per thread, row tid/2, columns (tid%2)·16.
    const bool b_fp8 = p.b_dtype == XINFER_DTYPE_F8_E4M3;
    const int b_col = b_fp8 ? (tid % 2) * 16 : (tid % 4) * 8;
    const int b_row0 = b_fp8 ? tid / 2 : tid / 4;
    const char* b_base = static_cast<const char*>(p.b) + group * p.b_group_stride * (b_fp8 ? 1 : 2);
    const float* scale = b_fp8 ? p.b_scale + group * p.scale_group_stride : nullptr;
    // Each thread stages the same weight row at every K step, so its scale row is fixed.
    const float* scale_row = nullptr;
    if (b_fp8 && n0 + b_row0 < p.n) {
        const int64_t row = n0 + b_row0;
        scale_row = scale + ((row / p.shard_rows) * p.blocks_per_shard + (row % p.shard_rows) / p.block_rows) * p.scale_cols;
    }
    const int block_cols = int(p.block_cols);

    uint4 a_reg[2], b_reg[2];
    float b_scale_reg[16];
    const int64_t K = p.k;

    auto load_tile = [&](int64_t k0) {
        for (int i = 0; i < 2; ++i) {
            const int64_t kc = k0 + a_col;
            if (!a_ptr[i]) {
                a_reg[i] = make_uint4(0, 0, 0, 0);
            } else if (flags.a_vec && kc + 8 <= K) {
                a_reg[i] = *reinterpret_cast<const uint4*>(a_ptr[i] + kc);
            } else {
                __nv_bfloat16 v[8];
                for (int e = 0; e < 8; ++e) v[e] = kc + e < K ? a_ptr[i][kc + e] : __float2bfloat16(0.f);
                a_reg[i] = *reinterpret_cast<uint4*>(v);
            }
        }
        if (!b_fp8) {
            for (int i = 0; i < 2; ++i) {
                const int64_t row = n0 + b_row0 + 32 * i, kc = k0 + b_col;
                const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(b_base) + row * K;
                if (row >= p.n) {
                    b_reg[i] = make_uint4(0, 0, 0, 0);
                } else if (flags.b_vec && kc + 8 <= K) {
                    b_reg[i] = *reinterpret_cast<const uint4*>(w + kc);
                } else {
                    __nv_bfloat16 v[8];
                    for (int e = 0; e < 8; ++e) v[e] = kc + e < K ? w[kc + e] : __float2bfloat16(0.f);
                    b_reg[i] = *reinterpret_cast<uint4*>(v);
                }
            }
        } else {
            const int64_t row = n0 + b_row0, kc = k0 + b_col;
            const uint8_t* w = reinterpret_cast<const uint8_t*>(b_base) + row * K;
            if (row >= p.n) {
                b_reg[0] = make_uint4(0, 0, 0, 0);
                for (int e = 0; e < 16; ++e) b_scale_reg[e] = 0.f;
            } else {
                if (flags.b_vec && kc + 16 <= K) {
                    b_reg[0] = *reinterpret_cast<const uint4*>(w + kc);
                } else {
                    uint8_t v[16];
                    for (int e = 0; e < 16; ++e) v[e] = kc + e < K ? w[kc + e] : uint8_t(0);
                    b_reg[0] = *reinterpret_cast<uint4*>(v);
                }
                // One scale for the chunk unless it straddles a scale block (block_cols % 16 != 0).
                const int first = int(kc), last = int(min(kc + 15, K - 1));
                if (kc >= K || first / block_cols == last / block_cols) {
                    const float s = kc < K ? scale_row[first / block_cols] : 0.f;
                    for (int e = 0; e < 16; ++e) b_scale_reg[e] = s;
                } else {
                    for (int e = 0; e < 16; ++e) b_scale_reg[e] = first + e < K ? scale_row[(first + e) / block_cols] : 0.f;
                }
            }
        }
    };

    auto store_tile = [&](int buf) {
        for (int i = 0; i < 2; ++i) *reinterpret_cast<uint4*>(&As[buf][tid / 4 + 32 * i][a_col]) = a_reg[i];
        if (!b_fp8) {
            for (int i = 0; i < 2; ++i) *reinterpret_cast<uint4*>(&Bs[buf][b_row0 + 32 * i][b_col]) = b_reg[i];
        } else {
            const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&b_reg[0]);
            __nv_bfloat16 v[16];
#pragma unroll
            for (int e = 0; e < 16; ++e) v[e] = __float2bfloat16_rn(fp8_to_float(bytes[e]) * b_scale_reg[e]);
            *reinterpret_cast<uint4*>(&Bs[buf][b_row0][b_col]) = *reinterpret_cast<uint4*>(&v[0]);
            *reinterpret_cast<uint4*>(&Bs[buf][b_row0][b_col + 8]) = *reinterpret_cast<uint4*>(&v[8]);
        }
    };

    const int warp = tid / 32, wm = warp / 2, wn = warp % 2;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

    const int64_t k_steps = (K + kBK - 1) / kBK;
    load_tile(0);
    store_tile(0);
    __syncthreads();
    // Two shared buffers: step s computes from buf s&1 while the loads for s+1 are in flight;
    // one barrier per step suffices because buf (s+1)&1 was last read during step s-1.
    for (int64_t s = 0; s < k_steps; ++s) {
        const int buf = int(s & 1);
        if (s + 1 < k_steps) load_tile((s + 1) * kBK);
#pragma unroll
        for (int kk = 0; kk < kBK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &As[buf][wm * 32 + i * 16][kk], kLds);
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &Bs[buf][wn * 32 + j * 16][kk], kLds);
            for (int i = 0; i < 2; ++i)
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        if (s + 1 < k_steps) store_tile(buf ^ 1);
        __syncthreads();
    }

    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(&Cs[wm * 32 + i * 16][wn * 32 + j * 16], acc[i][j], kLdc, wmma::mem_row_major);
    __syncthreads();
    for (int idx = tid; idx < kBM * kBN; idx += kGemmThreads) {
        const int r = idx / kBN, col = idx % kBN;
        const int64_t row = row_begin + r, n = n0 + col;
        if (row >= row_end || n >= p.n) continue;
        const int64_t dst = p.c_rows ? int64_t(p.c_rows[row]) : row;
        store_f(p.c, p.c_dtype, dst * p.ldc + n, Cs[r][col]);
    }
}

// ---- the few-row GEMV kernel -----------------------------------------------------------------------

constexpr int kGemvWarps = 8;

__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(Gemv g) {
    const GroupedGemm& p = g.w;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t n = int64_t(blockIdx.x) * kGemvWarps + warp;
    if (n >= p.n) return;  // no block-level synchronisation below
    const int64_t r0 = int64_t(blockIdx.y) * g.rows_per_group;
    const int rows = int(min(int64_t(g.rows_per_group), g.rows - r0));
    const int group = g.group_of ? g.group_of[blockIdx.y] : 0;
    if (group < 0 || group >= g.n_groups) {
        if (lane == 0)
            for (int j = 0; j < rows; ++j) store_f(p.c, p.c_dtype, (r0 + j) * p.ldc + n, __int_as_float(0x7fc00000));
        return;
    }
    const bool fp8 = p.b_dtype == XINFER_DTYPE_F8_E4M3;
    const int64_t K = p.k;
    const int chunk = fp8 ? 16 : 8;  // weight elements per 16-byte load
    const char* w_row = static_cast<const char*>(p.b) + (int64_t(group) * p.b_group_stride + n * K) * (fp8 ? 1 : 2);
    const float* scale = fp8 ? p.b_scale + int64_t(group) * p.scale_group_stride : nullptr;
    const bool one_scale = fp8 && p.block_cols % 16 == 0;
    // The scale row depends only on n; the column block is a 32-bit division per 16 weights.
    const float* scale_row = fp8 ? scale + ((n / p.shard_rows) * p.blocks_per_shard + (n % p.shard_rows) / p.block_rows) *
                                               p.scale_cols
                                 : nullptr;
    const int block_cols = int(p.block_cols);
    const __nv_bfloat16* a_rows[kGemvMaxRows];
#pragma unroll
    for (int j = 0; j < kGemvMaxRows; ++j) a_rows[j] = p.a + ((r0 + min(j, rows - 1)) / p.a_row_div) * p.lda;

    float acc[kGemvMaxRows];
#pragma unroll
    for (int j = 0; j < kGemvMaxRows; ++j) acc[j] = 0.f;
#pragma unroll 4
    for (int64_t k0 = int64_t(lane) * chunk; k0 < K; k0 += 32 * chunk) {
        float w[16];
        const uint4 raw = *reinterpret_cast<const uint4*>(w_row + k0 * (fp8 ? 1 : 2));
        if (fp8) {
            const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[e], __NV_E4M3)));
                w[2 * e] = f.x;
                w[2 * e + 1] = f.y;
            }
            if (one_scale) {
                const float s0 = scale_row[int(k0) / block_cols];
#pragma unroll
                for (int e = 0; e < 16; ++e) w[e] *= s0;
            } else {
#pragma unroll
                for (int e = 0; e < 16; ++e) w[e] *= scale_row[(int(k0) + e) / block_cols];
            }
        } else {
            const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
            for (int e = 0; e < 8; ++e) w[e] = __bfloat162float(h[e]);
        }
#pragma unroll
        for (int j = 0; j < kGemvMaxRows; ++j) {
            if (j >= rows) break;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                if (half == 1 && !fp8) break;
                const uint4 xv = *reinterpret_cast<const uint4*>(a_rows[j] + k0 + half * 8);
                const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&xv);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j] = fmaf(w[half * 8 + e], __bfloat162float(x[e]), acc[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < kGemvMaxRows; ++j) {
        if (j >= rows) break;
        const float total = warp_sum(acc[j]);
        if (lane == 0) store_f(p.c, p.c_dtype, (r0 + j) * p.ldc + n, total);
    }
}

}  // namespace

int launch_grouped_gemm(Context* c, const GroupedGemm& g, int64_t max_tiles) {
    const int64_t row_tiles = g.tiles ? max_tiles : ceil_div(g.m, kBM);
    const int64_t col_tiles = ceil_div(g.n, kBN);
    if (row_tiles <= 0 || col_tiles <= 0) return XINFER_OK;
    if (col_tiles > 65535) {
        set_error(c, "cuda gemm: N = %lld needs %lld column tiles (limit 65535)", (long long)g.n, (long long)col_tiles);
        return XINFER_ERROR;
    }
    const size_t b_elem = g.b_dtype == XINFER_DTYPE_F8_E4M3 ? 1 : 2;
    GemmFlags flags;
    flags.a_vec = g.lda % 8 == 0 && g.k % 8 == 0 && pointer_alignment(g.a) >= 16;
    flags.b_vec = (g.k * int64_t(b_elem)) % 16 == 0 && (g.b_group_stride * int64_t(b_elem)) % 16 == 0 &&
                  pointer_alignment(g.b) >= 16;
    GroupedGemm p = g;
    if (p.shard_rows <= 0) p.shard_rows = p.n;
    if (p.blocks_per_shard <= 0) p.blocks_per_shard = ceil_div(p.shard_rows, p.block_rows);
    grouped_gemm_kernel<<<dim3(unsigned(row_tiles), unsigned(col_tiles)), kGemmThreads, 0, c->stream>>>(p, flags);
    XCUDA_CHECK_LAUNCH(c, "grouped_gemm_kernel");
    return XINFER_OK;
}

bool gemv_fits(const Gemv& g) {
    const GroupedGemm& p = g.w;
    const int64_t chunk = p.b_dtype == XINFER_DTYPE_F8_E4M3 ? 16 : 8;
    const int64_t esize = p.b_dtype == XINFER_DTYPE_F8_E4M3 ? 1 : 2;
    return (p.b_dtype == XINFER_DTYPE_F8_E4M3 || p.b_dtype == XINFER_DTYPE_BF16) && p.k % chunk == 0 &&
           p.lda % 8 == 0 && pointer_alignment(p.a) >= 16 && pointer_alignment(p.b) >= 16 &&
           (p.b_group_stride * esize) % 16 == 0 && g.rows_per_group >= 1 && g.rows_per_group <= kGemvMaxRows;
}

int launch_gemv(Context* c, const Gemv& g) {
    const int64_t col_blocks = ceil_div(g.w.n, kGemvWarps), row_groups = ceil_div(g.rows, g.rows_per_group);
    if (col_blocks <= 0 || row_groups <= 0) return XINFER_OK;
    if (row_groups > 65535) {
        set_error(c, "cuda gemv: %lld row groups (limit 65535)", (long long)row_groups);
        return XINFER_ERROR;
    }
    Gemv p = g;
    if (p.w.shard_rows <= 0) p.w.shard_rows = p.w.n;
    if (p.w.blocks_per_shard <= 0) p.w.blocks_per_shard = ceil_div(p.w.shard_rows, p.w.block_rows);
    gemv_kernel<<<dim3(unsigned(col_blocks), unsigned(row_groups)), kGemvWarps * 32, 0, c->stream>>>(p);
    XCUDA_CHECK_LAUNCH(c, "gemv_kernel");
    return XINFER_OK;
}

}  // namespace xcuda
