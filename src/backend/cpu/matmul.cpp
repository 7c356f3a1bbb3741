// y = x · wᵀ with x [T, K] f32, w [N, K] f32/bf16/f16, y [T, N] f32, f32 accumulation.
//
// Two regimes:
//  - Few tokens (decode, speculative verification; T < kGemmMinTokens): a GEMV that must stream
//    w at memory bandwidth. Each thread takes a contiguous range of output rows and reads
//    kGemvRows weight rows at once with software prefetch, converting bf16/f16 to f32 in
//    registers (bf16 as the even/odd halves of full-width loads, with x permuted to match) and
//    reusing each loaded weight vector for up to 4 tokens.
//  - Many tokens (prefill): compute bound, so weights must be reused from cache. We compute
//    yᵀ = w · xᵀ with a register-tiled micro-kernel: kRowTile weight rows (broadcast one element
//    at a time) times a panel of up to kPanelVecs·kLanes tokens (vector loads), all f32 FMA.
//    x is packed once into token-contiguous panels ([k][token], cheap: it is reused N times) and
//    w only needs widening to f32, row by row (vectorised), never a transpose. K is blocked by
//    kDepthBlock so the x panels of one block stay in L2 while each thread sweeps its rows; the
//    next row tile's weights are prefetched while the current one computes.
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/simd.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace xinfer::cpu {
namespace {

using namespace simd;

// ---- GEMV regime --------------------------------------------------------------------------------

// Below this many tokens the streaming GEMV (each weight vector reused for 4 tokens straight
// from registers) beats the packed GEMM, whose W widening and 1-vector panels cost more than
// they save (measured crossover between T=24 and T=32 on AVX-512).
constexpr int64_t kGemmMinTokens = 32;
// Weight rows streamed together: more concurrent streams and independent accumulators. 8 beat
// 4 for every T < 32 with AVX-512, even where the 4-token tiles spill a few registers.
constexpr int kGemvRows = kRegisters >= 32 ? 8 : 4;
constexpr int kGemvTokens = 4;  // tokens sharing each loaded weight vector
// Weight prefetch: each of a tile's row streams prefetches kPrefetchElements ahead into L2, and
// past its row's end continues at the same offset of the row one tile further on. A thread's
// rows are contiguous, so for short rows (K = 1024 bf16: 2 KiB) this is the next tile, which the
// hardware prefetchers do not reach because each row stream ends early. On the reference VM
// (Qwen3-0.6B dummy decode) the next-tile rule ran ~8% faster than a 512-byte same-row L1
// prefetch in back-to-back runs (20.6/19.4 vs 18.4/18.0 tokens/s); Qwen3-1.7B (K = 2048) stayed
// within noise.
constexpr int64_t kPairElements = 2 * kLanes;
constexpr int64_t kPrefetchElements = 1024;
// With one or two tokens, a second, nearer prefetch into L1, so that the loads of the FMA loop hit
// L1 rather than wait on L2: the bf16 widening and FMAs fill the reorder window with ~2x the µops
// per byte of f32 weights, which left fewer L2 misses in flight (standalone, 1 GiB of bf16 weights,
// 2 threads, 9 rounds: 21.1 -> 22.9 GB/s median, f32 weights 25.2 GB/s; 128 / 256 / 512 elements
// ahead: 22.3 / 22.9 / 23.0; Qwen3-4B decode, three A/B pairs: 19.6-20.2 -> 21.8-23.9 GB/s). With
// 4-token tiles the extra instructions cost more than they bring (cpu_matmul_bench, T = 4 / 8 / 16:
// 21.8-24.4 / 13.8-16.0 / 8.5-9.3 -> 20.4-21.0 / 11.7-12.3 / 6.0-6.2 GB/s), so those keep one.
constexpr int64_t kNearPrefetchElements = 256;

// y[t, r] for kTokens tokens × kRows rows over the full K. xp is x with each full chunk of
// kPairElements in Weight::load_pair order (permute_pairs), the tail in natural order.
template <typename Weight, int kTokens, int kRows>
void gemv_tile(const float* xp /*[kTokens, ldx]*/, int64_t ldx, const typename Weight::Storage* w /*[kRows, K]*/,
               int64_t K, float* y /*[kTokens, ldy]*/, int64_t ldy) {
    VecF acc[kTokens][kRows];
    for (int t = 0; t < kTokens; ++t)
        for (int r = 0; r < kRows; ++r) acc[t][r] = zero();
    const int64_t k_main = K / kPairElements * kPairElements;
    for (int64_t k = 0; k < k_main; k += kPairElements) {
        VecF wa[kRows], wb[kRows];
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) {
            // See "Weight prefetch" above.
            const int64_t k_ahead = k + kPrefetchElements;
            const char* ahead = reinterpret_cast<const char*>(
                k_ahead < K ? w + r * K + k_ahead : w + (r + kRows) * K + (k_ahead - K));
            for (size_t line = 0; line < kPairElements * sizeof(*w); line += 64) __builtin_prefetch(ahead + line, 0, 2);
            if constexpr (kTokens <= 2) {
                const int64_t k_near = k + kNearPrefetchElements;
                const char* near = reinterpret_cast<const char*>(
                    k_near < K ? w + r * K + k_near : w + (r + kRows) * K + (k_near - K));
                for (size_t line = 0; line < kPairElements * sizeof(*w); line += 64) __builtin_prefetch(near + line, 0, 3);
            }
            Weight::load_pair(w + r * K + k, wa[r], wb[r]);
        }
#pragma GCC unroll 4
        for (int t = 0; t < kTokens; ++t) {
            const VecF xa = load(xp + t * ldx + k), xb = load(xp + t * ldx + k + kLanes);
#pragma GCC unroll 8
            for (int r = 0; r < kRows; ++r) acc[t][r] = fma(wb[r], xb, fma(wa[r], xa, acc[t][r]));
        }
    }
    for (int t = 0; t < kTokens; ++t) {
        for (int r = 0; r < kRows; ++r) {
            float sum = reduce_add(acc[t][r]);
            for (int64_t k = k_main; k < K; ++k) sum += xp[t * ldx + k] * Weight::scalar(w[r * K + k]);
            y[t * ldy + r] = sum;
        }
    }
}

// kRows rows starting at `row`, for all T tokens, in blocks of kGemvTokens: the first block
// streams the rows from memory, the later ones find them in L1/L2.
template <typename Weight, int kRows>
void gemv_rows(const float* xp, int64_t T, int64_t K, const typename Weight::Storage* w, int64_t N, int64_t row,
               float* y) {
    for (int64_t t = 0; t < T; t += kGemvTokens) {
        const float* xt = xp + t * K;
        float* yt = y + t * N + row;
        const auto* wr = w + row * K;
        switch (std::min<int64_t>(kGemvTokens, T - t)) {
            case 1: gemv_tile<Weight, 1, kRows>(xt, K, wr, K, yt, N); break;
            case 2: gemv_tile<Weight, 2, kRows>(xt, K, wr, K, yt, N); break;
            case 3: gemv_tile<Weight, 3, kRows>(xt, K, wr, K, yt, N); break;
            default: gemv_tile<Weight, 4, kRows>(xt, K, wr, K, yt, N); break;
        }
    }
}

std::vector<float>& scratch(int which, size_t n);

template <typename Weight>
void gemv(const float* x, int64_t T, int64_t K, const typename Weight::Storage* w, int64_t N, float* y) {
    const float* xp = x;
    if constexpr (Weight::kEvenOdd) {
        float* permuted = scratch(0, size_t(T * K)).data();
        for (int64_t t = 0; t < T; ++t) permute_pairs(x + t * K, permuted + t * K, K);
        xp = permuted;
    }
    const int64_t row_groups = (N + kGemvRows - 1) / kGemvRows;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < row_groups; ++g) {
        const int64_t row = g * kGemvRows;
        if (row + kGemvRows <= N) {
            gemv_rows<Weight, kGemvRows>(xp, T, K, w, N, row, y);
        } else {
            for (int64_t r = row; r < N; ++r) gemv_rows<Weight, 1>(xp, T, K, w, N, r, y);
        }
    }
}

// ---- GEMM regime --------------------------------------------------------------------------------

// Register tile: kRowTile weight rows × kPanelVecs vectors of tokens, leaving registers for the
// token vectors and the broadcast weight element.
#if defined(__AVX512F__)
constexpr int kRowTile = 8;
#else
constexpr int kRowTile = 4;
#endif
constexpr int kPanelVecs = 3;
constexpr int64_t kDepthBlock = 512;     // K per block: x panels of one block for T=256 are 512 KiB (L2)
constexpr int64_t kGemmMaxTokens = 512;  // tokens per GEMM call: x panels of one depth block ≤ 1 MiB
constexpr int64_t kPassRowBlocks = 128;  // row blocks per pass: partial sums ≤ 1024 rows × 512 tokens

// Where a micro-kernel's sums over one depth block go. Earlier blocks' sums live in a partial
// tile (yᵀ layout); the last block adds them and writes y directly, transposing through a small
// stack tile, so no separate transpose pass over y is needed.
struct TileOutput {
    float* partial;  // [kRowTile, ld_partial]: sums of the depth blocks before this one
    int64_t ld_partial;
    bool first, last;  // first: no earlier sums; last: write y instead of partial
    float* y;          // y[t0, n0] of a row-major [T, ldy] y
    int64_t ldy;
    int64_t rows, tokens;  // valid extent of the tile in y
};

// Cache lines to pull into L2 while a micro-kernel computes: the next row tile's weight slice
// (rows × lines_per_row lines, row_stride bytes apart). Spreading them over the k loop keeps the
// weight stream overlapped with compute without flooding the line-fill buffers.
struct PrefetchPlan {
    const char* base = nullptr;
    int64_t row_stride = 0, rows = 0, lines_per_row = 0;
};

// Σ_k wb[r, k] · xp[k, :] for kRowTile rows × kVecs·kLanes tokens.
template <int kVecs>
void gemm_micro_kernel(const float* wb /*[kRowTile, kc]*/, const float* xp /*[kc, kVecs*kLanes]*/, int64_t kc,
                       const TileOutput& out, const PrefetchPlan& prefetch) {
    constexpr int kWidth = kVecs * kLanes;
    constexpr int kUnroll = 4;
    VecF acc[kRowTile][kVecs];
#pragma GCC unroll 8
    for (int r = 0; r < kRowTile; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) acc[r][v] = zero();
    const int64_t total_lines = prefetch.rows * prefetch.lines_per_row;
    const int64_t groups = kc / kUnroll;
    const int64_t lines_per_group = groups > 0 ? (total_lines + groups - 1) / groups : 0;
    int64_t line = 0;
    auto step = [&](int64_t k) {
        VecF xv[kVecs];
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) xv[v] = load(xp + k * kWidth + v * kLanes);
#pragma GCC unroll 8
        for (int r = 0; r < kRowTile; ++r) {
            const VecF wv = broadcast(wb[r * kc + k]);
#pragma GCC unroll 4
            for (int v = 0; v < kVecs; ++v) acc[r][v] = fma(wv, xv[v], acc[r][v]);
        }
    };
    int64_t k = 0;
    for (; k + kUnroll <= kc; k += kUnroll) {
        for (int64_t i = 0; i < lines_per_group && line < total_lines; ++i, ++line)
            __builtin_prefetch(
                prefetch.base + (line % prefetch.rows) * prefetch.row_stride + (line / prefetch.rows) * 64, 0, 2);
#pragma GCC unroll 4
        for (int u = 0; u < kUnroll; ++u) step(k + u);
    }
    for (; k < kc; ++k) step(k);
    if (!out.first) {
#pragma GCC unroll 8
        for (int r = 0; r < kRowTile; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < kVecs; ++v)
                acc[r][v] = add(acc[r][v], load(out.partial + r * out.ld_partial + v * kLanes));
    }
    if (!out.last) {
#pragma GCC unroll 8
        for (int r = 0; r < kRowTile; ++r)
#pragma GCC unroll 4
            for (int v = 0; v < kVecs; ++v) store(out.partial + r * out.ld_partial + v * kLanes, acc[r][v]);
        return;
    }
    alignas(64) float tile[kRowTile][kWidth];
#pragma GCC unroll 8
    for (int r = 0; r < kRowTile; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) store(&tile[r][v * kLanes], acc[r][v]);
    for (int64_t j = 0; j < out.tokens; ++j)
        for (int64_t r = 0; r < out.rows; ++r) out.y[j * out.ldy + r] = tile[r][j];
}

// Per-thread scratch that survives between calls, so steady-state matmuls do not allocate.
std::vector<float>& scratch(int which, size_t n) {
    static thread_local std::vector<float> buffers[2];
    auto& buffer = buffers[which];
    if (buffer.size() < n) buffer.resize(n);
    return buffer;
}

// Token panels: ceil(T / kPanelTokens) panels with the token vectors spread evenly over them
// (T=64 → 32 + 32 rather than 48 + 16), since narrow panels run the weaker 1-vector kernel.
struct PanelLayout {
    int64_t n_panels, total_vecs;
    int64_t vecs(int64_t p) const { return total_vecs / n_panels + (p < total_vecs % n_panels ? 1 : 0); }
    int64_t first_vec(int64_t p) const { return p * (total_vecs / n_panels) + std::min(p, total_vecs % n_panels); }
};

template <typename Weight>
void gemm(const float* x, int64_t T, int64_t K, const typename Weight::Storage* w, int64_t N, float* y) {
    const int64_t total_vecs = (T + kLanes - 1) / kLanes;
    const PanelLayout panels{(total_vecs + kPanelVecs - 1) / kPanelVecs, total_vecs};
    const int64_t t_padded = total_vecs * kLanes;
    const int64_t row_blocks = (N + kRowTile - 1) / kRowTile;
    const int64_t depth_blocks = (K + kDepthBlock - 1) / kDepthBlock;
    // xp: for each depth block [k0, k0+kc): for each panel: [kc, panel width] token-contiguous,
    // zero beyond T.
    float* xp = scratch(0, size_t(t_padded * K)).data();
    auto panel_offset = [&](int64_t k0, int64_t kc, int64_t p) {
        return k0 * t_padded + kc * panels.first_vec(p) * kLanes;
    };

#pragma omp parallel
    {
        // Pack x: one (depth block, panel) per work item. O(T·K) against O(T·K·N) for the
        // product, so a plain gather is fine.
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < depth_blocks; ++b) {
            for (int64_t p = 0; p < panels.n_panels; ++p) {
                const int64_t k0 = b * kDepthBlock, kc = std::min(kDepthBlock, K - k0);
                const int64_t width = panels.vecs(p) * kLanes, t0 = panels.first_vec(p) * kLanes;
                const int64_t count = std::min(width, T - t0);
                float* dst = xp + panel_offset(k0, kc, p);
                for (int64_t k = 0; k < kc; ++k) {
                    for (int64_t j = 0; j < count; ++j) dst[k * width + j] = x[(t0 + j) * K + k0 + k];
                    for (int64_t j = count; j < width; ++j) dst[k * width + j] = 0.f;
                }
            }
        }  // implicit barrier: every thread reads all panels below

        // Each thread owns a contiguous range of row blocks and sweeps it in passes of
        // kPassRowBlocks: per pass, depth blocks outer (one block of xp stays in L2) and row
        // blocks inner, with the pass's partial sums in a thread-private yᵀ buffer.
        const int n_threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t rb_begin = row_blocks * thread / n_threads, rb_end = row_blocks * (thread + 1) / n_threads;
        static thread_local std::vector<float> wb_storage, partial_storage;
        if (wb_storage.size() < size_t(kRowTile * kDepthBlock)) wb_storage.resize(size_t(kRowTile * kDepthBlock));
        float* wb = wb_storage.data();
        float* partial = nullptr;
        if (depth_blocks > 1) {
            const size_t partial_size = size_t(kPassRowBlocks * kRowTile * t_padded);
            if (partial_storage.size() < partial_size) partial_storage.resize(partial_size);
            partial = partial_storage.data();
        }
        const int64_t weight_bytes = int64_t(sizeof(typename Weight::Storage));
        // The tile after (rb, k0) in this thread's sweep, as a prefetch plan (empty at the end).
        auto next_tile = [&](int64_t rb, int64_t k0, int64_t pass_begin, int64_t pass_end) {
            int64_t next_rb = rb + 1, next_k0 = k0;
            if (next_rb == pass_end) {
                next_rb = pass_begin;
                next_k0 = k0 + kDepthBlock;
                if (next_k0 >= K) {
                    next_rb = pass_end;
                    next_k0 = 0;
                }
            }
            PrefetchPlan plan;
            if (next_rb >= rb_end) return plan;
            const int64_t n0 = next_rb * kRowTile;
            plan.base = reinterpret_cast<const char*>(w + n0 * K + next_k0);
            plan.row_stride = K * weight_bytes;
            plan.rows = std::min<int64_t>(kRowTile, N - n0);
            plan.lines_per_row = (std::min(kDepthBlock, K - next_k0) * weight_bytes + 63) / 64;
            return plan;
        };

        for (int64_t pass_begin = rb_begin; pass_begin < rb_end; pass_begin += kPassRowBlocks) {
            const int64_t pass_end = std::min(rb_end, pass_begin + kPassRowBlocks);
            for (int64_t k0 = 0; k0 < K; k0 += kDepthBlock) {
                const int64_t kc = std::min(kDepthBlock, K - k0);
                for (int64_t rb = pass_begin; rb < pass_end; ++rb) {
                    const int64_t n0 = rb * kRowTile, rows = std::min<int64_t>(kRowTile, N - n0);
                    // This row tile's slice of w as f32 [kRowTile, kc]: 16 KiB, L1-resident while
                    // every token panel streams past it.
                    for (int r = 0; r < kRowTile; ++r) {
                        if (r < rows) {
                            widen_row<Weight>(w + (n0 + r) * K + k0, wb + r * kc, kc);
                        } else {
                            std::fill(wb + r * kc, wb + (r + 1) * kc, 0.f);
                        }
                    }
                    // Short row slices defeat the hardware prefetcher: the first panel's kernel
                    // fetches the next tile's slice into L2 while it computes.
                    const PrefetchPlan prefetch = next_tile(rb, k0, pass_begin, pass_end);
                    for (int64_t p = 0; p < panels.n_panels; ++p) {
                        const int64_t t0 = panels.first_vec(p) * kLanes;
                        const TileOutput out{partial ? partial + (rb - pass_begin) * kRowTile * t_padded + t0 : nullptr,
                                             t_padded,
                                             k0 == 0,
                                             k0 + kc == K,
                                             y + t0 * N + n0,
                                             N,
                                             rows,
                                             std::min(panels.vecs(p) * kLanes, T - t0)};
                        const float* panel = xp + panel_offset(k0, kc, p);
                        const PrefetchPlan& plan = p == 0 ? prefetch : PrefetchPlan{};
                        switch (panels.vecs(p)) {
                            case 1: gemm_micro_kernel<1>(wb, panel, kc, out, plan); break;
                            case 2: gemm_micro_kernel<2>(wb, panel, kc, out, plan); break;
                            default: gemm_micro_kernel<3>(wb, panel, kc, out, plan); break;
                        }
                    }
                }
            }
        }
    }
}

template <typename Weight>
void matmul_typed(const float* x, int64_t T, int64_t K, const void* w, int64_t N, float* y) {
    const auto* wt = static_cast<const typename Weight::Storage*>(w);
    if (T < kGemmMinTokens) {
        gemv<Weight>(x, T, K, wt, N, y);
        return;
    }
    // Long prompts in chunks, so one depth block of packed x stays L2-sized; each chunk widens
    // w again, which costs ~1% at kGemmMaxTokens.
    for (int64_t t0 = 0; t0 < T; t0 += kGemmMaxTokens) {
        const int64_t count = std::min(kGemmMaxTokens, T - t0);
        // A short remainder goes to the GEMV path rather than a mostly empty panel.
        if (count < kGemmMinTokens) {
            gemv<Weight>(x + t0 * K, count, K, wt, N, y + t0 * N);
        } else {
            gemm<Weight>(x + t0 * K, count, K, wt, N, y + t0 * N);
        }
    }
}

}  // namespace

void matmul_raw(const float* x, int64_t T, int64_t K, const void* w, DType w_dtype, int64_t N, float* y) {
    if (T == 0 || N == 0) return;
    if (K == 0) {
        std::fill(y, y + T * N, 0.f);
        return;
    }
    switch (w_dtype) {
        case DType::f32: matmul_typed<WeightF32>(x, T, K, w, N, y); return;
        case DType::bf16: matmul_typed<WeightBf16>(x, T, K, w, N, y); return;
        case DType::f16: matmul_typed<WeightF16>(x, T, K, w, N, y); return;
        default: fail("matmul: weight dtype {} is not supported on the CPU (f32, bf16, f16)", dtype_name(w_dtype));
    }
}

void matmul(const Tensor& x, const Tensor& w, const Tensor& y) {
    check_dtype("matmul", "x", x, {DType::f32});
    check_dtype("matmul", "w", w, {DType::f32, DType::bf16, DType::f16});
    check_dtype("matmul", "y", y, {DType::f32});
    check_rank("matmul", "w", w, 2);
    const int64_t T = x.rows(), K = x.cols(), N = w.dim(0);
    if (w.dim(1) != K)
        fail("matmul: x {} and w {} disagree on the input dim ({} vs {})", x.shape_string(), w.shape_string(), K,
             w.dim(1));
    if (y.rows() != T || y.cols() != N)
        fail("matmul: y is {}, expected [{}, {}] for x {} · w {}ᵀ", y.shape_string(), T, N, x.shape_string(),
             w.shape_string());
    matmul_raw(x.as<float>(), T, K, w.data, w.dtype, N, y.as<float>());
}

}  // namespace xinfer::cpu
