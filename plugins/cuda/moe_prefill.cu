// MOE_EXPERTS for prefill-sized batches: one cuBLASLt GEMM per expert, called from moe.cu.
//
// With thousands of (token, slot) pairs each expert's rows form a real GEMM (a 4,096-token prefill
// over 8 experts: 4,096 rows each), which cuBLASLt runs near the tensor cores' peak; the custom
// tiled kernel (gemm.cu) reached ~13% of it (ops-test --perf, H200). cuBLASLt needs each expert's
// row count on the host, so this is the one run path that synchronizes and reads device memory:
// only outside graph capture and for P ≥ kPerExpertGemmMinPairs (prefill chunks; decode graphs
// hold at most 64 tokens). XINFER_CUDA_MOE_PER_EXPERT_GEMM=0 turns it off.
//   1. count, plan, scatter (as the tiled path): sorted[P] = pair ids in expert order, counts[E]
//   2. counts → host (the stream's only synchronization)
//   3. xs[i] = x[sorted[i] / top_k] in bf16; inverse[sorted[i]] = i
//   4. per expert: gu[rows_e] = xs[rows_e] · gate_up_eᵀ (bf16, as the tiled path stores it);
//      FP8 experts are first widened to bf16 (fp8 · block scale, rounded as the tiled kernel does)
//   5. swiglu → h (bf16, in xs's place)   6. per expert: dn[rows_e] = h[rows_e] · down_eᵀ (f32)
//   7. combine in slot order, reading dn[inverse[pair]]
#include "moe_prefill.h"

#include "gemm.h"
#include "moe_common.cuh"

#include <algorithm>
#include <vector>

namespace xcuda {
namespace {

// One block per sorted row i: xs[i] = x[sorted[i] / top_k] as bf16, inverse[sorted[i]] = i.
__global__ void gather_pairs_kernel(const void* x /*[T, H]*/, int x_dtype, bool vec, const int32_t* sorted /*[n]*/,
                                    int top_k, int64_t H, __nv_bfloat16* xs /*[n, H]*/, int32_t* inverse /*[P]*/) {
    const int64_t i = blockIdx.x;
    const int32_t p = sorted[i];
    if (threadIdx.x == 0) inverse[p] = int32_t(i);
    const int64_t src = int64_t(p / top_k) * H;
    if (vec) {
        const uint4* from = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(x) + src);
        uint4* to = reinterpret_cast<uint4*>(xs + i * H);
        for (int64_t c = threadIdx.x; c < H / 8; c += blockDim.x) to[c] = from[c];
    } else {
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) xs[i * H + h] = __float2bfloat16_rn(load_f(x, x_dtype, src + h));
    }
}

}  // namespace

bool moe_per_expert_gemm_enabled() {
    static const bool enabled = env_flag("XINFER_CUDA_MOE_PER_EXPERT_GEMM", true);
    return enabled;
}

int moe_per_expert_gemm(Context* c, const PerExpertArgs& a) {
    const int64_t P = a.T * a.top_k, E = a.E, H = a.H, I = a.I;
    const bool any_fp8 = a.gate_up->dtype == XINFER_DTYPE_F8_E4M3 || a.down->dtype == XINFER_DTYPE_F8_E4M3;
    const int64_t max_tiles = ceil_div(P, kGemmTileM) + std::min(E, P);
    ScratchPlan plan;
    const size_t off_counts = plan.add(size_t(E) * 4), off_cursor = plan.add(size_t(E) * 4),
                 off_tile_offset = plan.add(size_t(E) * 4), off_n_tiles = plan.add(4),
                 off_tiles = plan.add(size_t(max_tiles) * sizeof(int4)), off_sorted = plan.add(size_t(P) * 4),
                 off_inverse = plan.add(size_t(P) * 4), off_xs = plan.add(size_t(P * std::max(H, I)) * 2),
                 off_gu = plan.add(size_t(P * 2 * I) * 2), off_dn = plan.add(size_t(P * H) * 4),
                 off_wide = plan.add(any_fp8 ? size_t(2 * I * H) * 2 : 0);
    if (int rc = ensure_scratch(c, plan.total)) return rc;
    char* s = c->scratch;
    auto* counts = reinterpret_cast<int32_t*>(s + off_counts);
    auto* cursor = reinterpret_cast<int32_t*>(s + off_cursor);
    auto* sorted = reinterpret_cast<int32_t*>(s + off_sorted);
    auto* inverse = reinterpret_cast<int32_t*>(s + off_inverse);
    auto* xs = reinterpret_cast<__nv_bfloat16*>(s + off_xs);  // [n, H], then h [n, I]
    auto* gu = reinterpret_cast<__nv_bfloat16*>(s + off_gu);  // [n, 2I]
    auto* dn = reinterpret_cast<float*>(s + off_dn);          // [n, H] in expert order
    auto* wide = reinterpret_cast<__nv_bfloat16*>(s + off_wide);

    const int threads = 256;
    const int blocks = int(std::max<int64_t>(1, std::min<int64_t>(ceil_div(P, threads), c->sm_count * 4)));
    XCUDA_TRY(c, cudaMemsetAsync(counts, 0, size_t(E) * 4, c->stream));
    count_kernel<<<blocks, threads, 0, c->stream>>>(a.ids, P, int(E), counts);
    XCUDA_CHECK_LAUNCH(c, "count_kernel");
    plan_kernel<<<1, 256, 0, c->stream>>>(counts, int(E), cursor, reinterpret_cast<int32_t*>(s + off_tile_offset),
                                          reinterpret_cast<int4*>(s + off_tiles),
                                          reinterpret_cast<int32_t*>(s + off_n_tiles));
    XCUDA_CHECK_LAUNCH(c, "plan_kernel");
    scatter_kernel<<<blocks, threads, 0, c->stream>>>(a.ids, P, int(E), cursor, sorted);
    XCUDA_CHECK_LAUNCH(c, "scatter_kernel");
    std::vector<int32_t> rows_of(static_cast<size_t>(E));
    XCUDA_TRY(c, cudaMemcpyAsync(rows_of.data(), counts, size_t(E) * 4, cudaMemcpyDeviceToHost, c->stream));
    XCUDA_TRY(c, cudaStreamSynchronize(c->stream));
    int64_t n = 0;  // valid pairs (ids outside [0, E) are left out; combine makes their tokens NaN)
    for (int32_t r : rows_of) n += r;

    if (n > 0) {
        const bool vec = a.x->dtype == XINFER_DTYPE_BF16 && H % 8 == 0 && pointer_alignment(a.x->data) >= 16;
        gather_pairs_kernel<<<unsigned(n), 128, 0, c->stream>>>(a.x->data, a.x->dtype, vec, sorted, int(a.top_k), H,
                                                                  xs, inverse);
        XCUDA_CHECK_LAUNCH(c, "gather_pairs_kernel");
    }
    // y[rows] = act[rows] · w[N, K]ᵀ for one expert; the custom tiled kernel if cuBLASLt declines.
    const auto expert_gemm = [&](const __nv_bfloat16* act, const void* w, void* y, int64_t rows, int64_t N, int64_t K,
                                 int y_dtype) -> int {
        const int rc = lt_matmul(c, act, w, y, rows, N, K, XINFER_DTYPE_BF16, y_dtype);
        if (rc != XINFER_UNSUPPORTED) return rc;
        GroupedGemm g;
        g.a = act;
        g.lda = K;
        g.b = w;
        g.n = N;
        g.k = K;
        g.c = y;
        g.c_dtype = y_dtype;
        g.ldc = N;
        g.m = rows;
        return launch_grouped_gemm(c, g, ceil_div(rows, kGemmTileM));
    };
    // Expert e's weights [rows, cols] as bf16: in place, or widened from e4m3 into `wide`.
    const auto expert_weights = [&](const xinfer_tensor& w, const xinfer_tensor& scale, int64_t e, int64_t rows,
                                    int64_t cols, const void** out) -> int {
        if (w.dtype == XINFER_DTYPE_BF16) {
            *out = static_cast<const __nv_bfloat16*>(w.data) + e * rows * cols;
            return XINFER_OK;
        }
        const int64_t scale_rows = scale.shape[1], scale_cols = scale.shape[2];
        *out = wide;
        return launch_widen_fp8(c, static_cast<const uint8_t*>(w.data) + e * rows * cols,
                                static_cast<const float*>(scale.data) + e * scale_rows * scale_cols, rows, cols,
                                scale_cols, a.block_rows, a.block_cols, rows, scale_rows, wide);
    };
    int64_t row = 0;
    for (int64_t e = 0; e < E; row += rows_of[size_t(e)], ++e) {
        if (rows_of[size_t(e)] == 0) continue;
        const void* w = nullptr;
        if (int rc = expert_weights(*a.gate_up, *a.gate_up_scale, e, 2 * I, H, &w)) return rc;
        if (int rc = expert_gemm(xs + row * H, w, gu + row * 2 * I, rows_of[size_t(e)], 2 * I, H, XINFER_DTYPE_BF16))
            return rc;
    }
    __nv_bfloat16* h = xs;  // xs is dead once every gate_up GEMM has run (stream order)
    if (int rc = launch_swiglu(c, gu, XINFER_DTYPE_BF16, h, XINFER_DTYPE_BF16, n, I)) return rc;
    row = 0;
    for (int64_t e = 0; e < E; row += rows_of[size_t(e)], ++e) {
        if (rows_of[size_t(e)] == 0) continue;
        const void* w = nullptr;
        if (int rc = expert_weights(*a.down, *a.down_scale, e, H, I, &w)) return rc;
        if (int rc = expert_gemm(h + row * I, w, dn + row * H, rows_of[size_t(e)], H, I, XINFER_DTYPE_F32)) return rc;
    }
    return launch_combine(c, dn, inverse, a.ids, a.weights, int(a.top_k), int(E), a.T, H, a.out->data, a.out->dtype);
}

}  // namespace xcuda
