// Paged KV cache: KV_STORE writes new tokens' K/V into their slots; ATTENTION reads them back
// through each sequence's page table with a flash-style kernel (online softmax, f32 state,
// bf16 tensor cores for Q·Kᵀ and P·V). Most ATTENTION ops run on the split-KV kernel of
// attention_decode.cu; the flash kernel here takes FP8 caches and heads wider than that
// kernel's limits (and everything with XINFER_CUDA_DECODE_ATTENTION=0).
//
// Work decomposition. For one sequence and one KV head g, the query rows are the pairs
// (query token i, head h of g's group), token-major: row = i·G + h. A block takes 64 such rows
// (so decode with G = 16 packs 4 tokens' heads, prefill with G = 1 packs 64 tokens) and walks the
// union of their allowed key ranges in tiles of 32 keys gathered through the page table. Each
// of the 4 warps owns 16 rows end to end (scores, softmax, its slice of the output), so warps
// synchronise only around the shared K/V tile. grid = (row tiles, n_kv, kv splits).
//
// Split-KV: when rows × heads give fewer blocks than 2 per SM (decode), the key range of each
// tile is cut into n_split chunks handled by separate blocks that write unnormalised partials
// (m, l, O) to scratch; a combine kernel merges them (and adds the sink). n_split is chosen on
// the host from upper bounds (max_pages_per_seq · page_size), never from device values.
//
// Masking: causal p - j < window / non-causal |p - j| < window; a key is loaded only if some
// row of the tile may see it, so unwritten slots and released pages (-1) are never read. A key
// that some row needs but whose page is -1 becomes NaN for exactly the rows that need it (the
// CPU oracle raises an error there).
//
// FP8 caches (e4m3 + one f32 scale per (token, kv head) row after each page's values, the ABI's
// "FP8 KV caches"): KV_STORE quantizes each row with the CPU's rule (src/backend/cpu/kv_fp8.h:
// scale = amax / 448, q = e4m3_rn_satfinite(x / scale); the bytes must match exactly), and
// ATTENTION dequantizes float(q) · scale while filling the bf16 K/V tiles, so the tensor-core
// path is the same for every cache dtype.
#include "attention_common.cuh"
#include "attention_exact.h"
#include "common.h"
#include "device_utils.cuh"

#include <mma.h>

#include <algorithm>

namespace xcuda {
namespace {

using namespace nvcuda;

constexpr int kBQ = 64;       // query rows per block
constexpr int kBKeys = 32;    // keys per tile (one per lane in the softmax step)
constexpr int kThreads = 128; // 4 warps × 16 rows
constexpr int kMaxHeadDim = 256;


// Cache element of any cache dtype, fp8 without its row scale.
__device__ __forceinline__ float load_cache(const void* cache, int dtype, int64_t i) {
    if (dtype == XINFER_DTYPE_F8_E4M3) return fp8_to_float(static_cast<const uint8_t*>(cache)[i]);
    return load_f(cache, dtype, i);
}

// Shared-memory layout (bytes), identical on host and device.
struct AttnSmem {
    int ldq, ldv, lds, ldp, ldo;
    int q, k, v, s, p, o, m, l, corr, lo, hi, ksrc, vsrc, kscale, vscale, range, total;
};
__host__ __device__ inline AttnSmem attn_smem(int dk_pad, int dv_pad) {
    AttnSmem L;
    L.ldq = dk_pad + 8;
    L.ldv = dv_pad + 8;
    L.lds = kBKeys + 4;
    L.ldp = kBKeys + 8;
    L.ldo = dv_pad + 4;
    int off = 0;
    auto take = [&](int bytes) {
        const int at = off;
        off += (bytes + 127) / 128 * 128;
        return at;
    };
    L.q = take(kBQ * L.ldq * 2);
    L.k = take(kBKeys * L.ldq * 2);
    L.v = take(kBKeys * L.ldv * 2);
    L.s = take(kBQ * L.lds * 4);
    L.p = take(kBQ * L.ldp * 2);
    L.o = take(kBQ * L.ldo * 4);
    L.m = take(kBQ * 4);
    L.l = take(kBQ * 4);
    L.corr = take(kBQ * 4);
    L.lo = take(kBQ * 4);
    L.hi = take(kBQ * 4);
    L.ksrc = take(kBKeys * 8);
    L.vsrc = take(kBKeys * 8);
    L.kscale = take(kBKeys * 4);
    L.vscale = take(kBKeys * 4);
    L.range = take(16);
    L.total = off;
    return L;
}

constexpr int64_t kSrcZero = -1, kSrcNaN = -2;

// Fills one bf16 shared row [pad] from a cache row [len] (or zeros / NaN), lanes of one warp;
// fp8 rows are multiplied by their row scale (1 for other dtypes).
__device__ __forceinline__ void load_row(__nv_bfloat16* dst, const void* cache, int dtype, int64_t src, int len,
                                         int pad, bool vec, float scale, int lane) {
    for (int c8 = lane * 8; c8 < pad; c8 += 32 * 8) {
        if (src >= 0 && vec && c8 + 8 <= len) {
            if (dtype == XINFER_DTYPE_F8_E4M3) {
                const uint2 bytes = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(cache) + src + c8);
                const uint8_t* b = reinterpret_cast<const uint8_t*>(&bytes);
                __nv_bfloat16 v[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = __float2bfloat16_rn(fp8_to_float(b[e]) * scale);
                *reinterpret_cast<uint4*>(dst + c8) = *reinterpret_cast<uint4*>(v);
            } else {
                *reinterpret_cast<uint4*>(dst + c8) =
                    *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(cache) + src + c8);
            }
            continue;
        }
        __nv_bfloat16 v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int d = c8 + e;
            float x = 0.f;
            if (d < len) {
                if (src >= 0) x = load_cache(cache, dtype, src + d) * scale;
                else if (src == kSrcNaN) x = __int_as_float(0x7fc00000);
            }
            v[e] = __float2bfloat16_rn(x);
        }
        *reinterpret_cast<uint4*>(dst + c8) = *reinterpret_cast<uint4*>(v);
    }
}

__global__ void __launch_bounds__(kThreads) attention_kernel(AttnArgs a) {
    extern __shared__ __align__(128) unsigned char smem[];
    const AttnSmem L = attn_smem(a.dk_pad, a.dv_pad);
    auto* Qs = reinterpret_cast<__nv_bfloat16*>(smem + L.q);
    auto* Ks = reinterpret_cast<__nv_bfloat16*>(smem + L.k);
    auto* Vs = reinterpret_cast<__nv_bfloat16*>(smem + L.v);
    auto* Ss = reinterpret_cast<float*>(smem + L.s);
    auto* Ps = reinterpret_cast<__nv_bfloat16*>(smem + L.p);
    auto* Os = reinterpret_cast<float*>(smem + L.o);
    auto* row_m = reinterpret_cast<float*>(smem + L.m);
    auto* row_l = reinterpret_cast<float*>(smem + L.l);
    auto* row_corr = reinterpret_cast<float*>(smem + L.corr);
    auto* tok_lo = reinterpret_cast<int*>(smem + L.lo);
    auto* tok_hi = reinterpret_cast<int*>(smem + L.hi);
    auto* ksrc = reinterpret_cast<int64_t*>(smem + L.ksrc);
    auto* vsrc = reinterpret_cast<int64_t*>(smem + L.vsrc);
    auto* kscale = reinterpret_cast<float*>(smem + L.kscale);
    auto* vscale = reinterpret_cast<float*>(smem + L.vscale);
    auto* range = reinterpret_cast<int*>(smem + L.range);

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = blockIdx.y, split = blockIdx.z, G = a.group;

    // Which sequence and which 64 of its rows this block owns (same answer in every thread).
    const BlockRows b = block_rows(find_row_tile(a.cu_q_lens, a.n_seqs, G, kBQ, blockIdx.x), kBQ, G, a.cu_q_lens, a.kv_lens);
    if (b.seq < 0) return;
    const int s = b.seq, rows = b.rows, tok_first = b.tok_first, ntok = b.ntok;
    const int token_base = b.token_base;  // the tile's first token in the batch
    const int64_t row0 = b.row0;
    store_token_ranges(b, a.positions, a.causal, a.window, kThreads, tok_lo, tok_hi);
    // Q rows as bf16, zero-padded to dk_pad; rows past `rows` are zero.
    for (int r = warp; r < kBQ; r += kThreads / 32) {
        __nv_bfloat16* dst = Qs + r * L.ldq;
        if (r < rows) {
            const int64_t flat = row0 + r;
            const int64_t t = token_base + (flat / G - tok_first);
            const int head = g * G + int(flat % G);
            const int64_t base = (t * a.nq + head) * a.dk;
            for (int d = lane; d < a.dk_pad; d += 32)
                dst[d] = __float2bfloat16_rn(d < a.dk ? load_f(a.q, a.q_dtype, base + d) : 0.f);
        } else {
            for (int d = lane; d < a.dk_pad; d += 32) dst[d] = __float2bfloat16_rn(0.f);
        }
    }
    for (int i = tid; i < kBQ * L.ldo; i += kThreads) Os[i] = 0.f;
    for (int r = tid; r < kBQ; r += kThreads) {
        row_m[r] = -INFINITY;
        row_l[r] = 0.f;
    }
    __syncthreads();
    if (tid == 0) {
        int lo, hi;
        key_union(tok_lo, tok_hi, ntok, lo, hi);
        if (a.n_split > 1 && lo <= hi) {
            const int len = hi - lo + 1;
            const int chunk = ((len + a.n_split - 1) / a.n_split + kBKeys - 1) / kBKeys * kBKeys;
            const int my_lo = lo + split * chunk;
            hi = min(hi, my_lo + chunk - 1);
            lo = my_lo;
        }
        range[0] = lo;
        range[1] = hi;
    }
    __syncthreads();
    const int key_lo = range[0], key_hi = range[1];

    for (int kb = key_lo; kb <= key_hi; kb += kBKeys) {
        // Where each key of the tile comes from; only keys some row may see are loaded.
        if (tid < kBKeys) {
            const int j = kb + tid;
            int64_t ks = kSrcZero, vs = kSrcZero;
            float k_row_scale = 1.f, v_row_scale = 1.f;
            bool needed = false;
            if (j <= key_hi)
                for (int i = 0; i < ntok && !needed; ++i) needed = j >= tok_lo[i] && j <= tok_hi[i];
            if (needed) {
                const int page = a.page_table[int64_t(s) * a.max_pages + j / a.page_size];
                if (page < 0) {
                    ks = kSrcNaN;
                } else {
                    const int64_t slot_row = int64_t(j % a.page_size) * a.nkv + g;
                    ks = int64_t(page) * a.k_page_stride + slot_row * a.dk;
                    vs = int64_t(page) * a.v_page_stride + slot_row * a.dv;
                    // fp8: the page's row scales follow its page_size·nkv·d values.
                    const int64_t rows_per_page = int64_t(a.page_size) * a.nkv;
                    if (a.k_dtype == XINFER_DTYPE_F8_E4M3)
                        k_row_scale = load_fp8_row_scale(a.k_cache, int64_t(page) * a.k_page_stride + rows_per_page * a.dk +
                                                                slot_row * 4);
                    if (a.v_dtype == XINFER_DTYPE_F8_E4M3)
                        v_row_scale = load_fp8_row_scale(a.v_cache, int64_t(page) * a.v_page_stride + rows_per_page * a.dv +
                                                                slot_row * 4);
                }
            }
            ksrc[tid] = ks;
            vsrc[tid] = vs;
            kscale[tid] = k_row_scale;
            vscale[tid] = v_row_scale;
        }
        __syncthreads();
        for (int key = warp; key < kBKeys; key += kThreads / 32) {
            load_row(Ks + key * L.ldq, a.k_cache, a.k_dtype, ksrc[key], a.dk, a.dk_pad, a.k_vec, kscale[key], lane);
            load_row(Vs + key * L.ldv, a.v_cache, a.v_dtype, vsrc[key], a.dv, a.dv_pad, a.v_vec, vscale[key], lane);
        }
        __syncthreads();

        // S[16 rows of this warp, 32 keys] = Q · Kᵀ.
        {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> sacc[2];
            wmma::fill_fragment(sacc[0], 0.f);
            wmma::fill_fragment(sacc[1], 0.f);
            for (int kk = 0; kk < a.dk_pad; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fq;
                wmma::load_matrix_sync(fq, Qs + warp * 16 * L.ldq + kk, L.ldq);
                for (int j = 0; j < 2; ++j) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fk;
                    wmma::load_matrix_sync(fk, Ks + j * 16 * L.ldq + kk, L.ldq);
                    wmma::mma_sync(sacc[j], fq, fk, sacc[j]);
                }
            }
            for (int j = 0; j < 2; ++j)
                wmma::store_matrix_sync(Ss + warp * 16 * L.lds + j * 16, sacc[j], L.lds, wmma::mem_row_major);
        }
        __syncwarp();

        // Online softmax over this tile, one row at a time, lane = key.
        for (int rr = 0; rr < 16; ++rr) {
            const int r = warp * 16 + rr, j = kb + lane;
            bool allowed = false;
            if (r < rows && j <= key_hi) {
                const int tok = int((row0 + r) / G) - tok_first;
                allowed = j >= tok_lo[tok] && j <= tok_hi[tok];
            }
            const float sc = allowed ? Ss[r * L.lds + lane] * a.scale : -INFINITY;
            const float m_old = row_m[r];
            const float m_new = fmaxf(m_old, warp_max(sc));
            const float p = allowed ? __expf(sc - m_new) : 0.f;
            const float corr = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
            const float sum = warp_sum(p);
            Ps[r * L.ldp + lane] = __float2bfloat16_rn(p);
            __syncwarp();
            if (lane == 0) {
                row_l[r] = row_l[r] * corr + sum;
                row_m[r] = m_new;
                row_corr[r] = corr;
            }
            __syncwarp();
        }
        // Rescale this warp's output rows, then O += P · V.
        for (int idx = lane; idx < 16 * a.dv_pad; idx += 32) {
            const int rr = idx / a.dv_pad, d = idx % a.dv_pad;
            Os[(warp * 16 + rr) * L.ldo + d] *= row_corr[warp * 16 + rr];
        }
        __syncwarp();
        for (int cb = 0; cb < a.dv_pad; cb += 16) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> oacc;
            float* o_tile = Os + warp * 16 * L.ldo + cb;
            wmma::load_matrix_sync(oacc, o_tile, L.ldo, wmma::mem_row_major);
            for (int kk = 0; kk < kBKeys; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fp;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fv;
                wmma::load_matrix_sync(fp, Ps + warp * 16 * L.ldp + kk, L.ldp);
                wmma::load_matrix_sync(fv, Vs + kk * L.ldv + cb, L.ldv);
                wmma::mma_sync(oacc, fp, fv, oacc);
            }
            wmma::store_matrix_sync(o_tile, oacc, L.ldo, wmma::mem_row_major);
        }
        __syncthreads();  // K/V/ksrc of this tile are overwritten next
    }

    // Finalize this warp's rows: normalise (with the sink), or write partials for the combine.
    __syncwarp();
    for (int rr = 0; rr < 16; ++rr) {
        const int r = warp * 16 + rr;
        if (r >= rows) break;
        const int64_t flat = row0 + r;
        const int64_t t = token_base + (flat / G - tok_first);
        const int head = g * G + int(flat % G);
        const int64_t R = t * a.nq + head;
        const float m = row_m[r], l = row_l[r];
        const float* o = Os + r * L.ldo;
        if (a.n_split == 1) {
            float alpha = 1.f, denom = l;
            if (a.sinks) {
                const float sink = a.sinks[head];
                const float M = fmaxf(m, sink);
                alpha = m == -INFINITY ? 0.f : __expf(m - M);
                denom = l * alpha + __expf(sink - M);
            }
            const float inv = denom == 0.f ? 0.f : alpha / denom;
            for (int d = lane; d < a.dv; d += 32) store_f(a.out, a.out_dtype, R * a.dv + d, o[d] * inv);
        } else {
            const int64_t P = int64_t(split) * a.T * a.nq + R;
            for (int d = lane; d < a.dv; d += 32) a.part_o[P * a.dv + d] = o[d];
            if (lane == 0) {
                a.part_ml[P * 2] = m;
                a.part_ml[P * 2 + 1] = l;
            }
        }
    }
}

// One block per (token, head) row: merges the n_split partials and the sink.
__global__ void attention_combine_kernel(const float* part_o /*[n_split, rows, dv]*/,
                                         const float* part_ml /*[n_split, rows, 2]*/, const float* sinks /*[nq]*/,
                                         int n_split, int64_t n_rows, int nq, int dv, void* out /*[rows, dv]*/,
                                         int out_dtype) {
    const int64_t R = blockIdx.x;
    float M = -INFINITY;
    for (int z = 0; z < n_split; ++z) M = fmaxf(M, part_ml[(z * n_rows + R) * 2]);
    if (sinks) M = fmaxf(M, sinks[R % nq]);
    float denom = sinks ? __expf(sinks[R % nq] - M) : 0.f;
    for (int z = 0; z < n_split; ++z) {
        const float m = part_ml[(z * n_rows + R) * 2];
        denom += m == -INFINITY ? 0.f * part_ml[(z * n_rows + R) * 2 + 1]
                                : part_ml[(z * n_rows + R) * 2 + 1] * __expf(m - M);
    }
    const float inv = denom == 0.f ? 0.f : 1.f / denom;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float acc = 0.f;
        for (int z = 0; z < n_split; ++z) {
            const float m = part_ml[(z * n_rows + R) * 2];
            const float w = m == -INFINITY ? 0.f : __expf(m - M);
            acc += part_o[(z * n_rows + R) * dv + d] * w;
        }
        store_f(out, out_dtype, R * dv + d, acc * inv);
    }
}

// k/v rows of token t go to slot slot_mapping[t] = page · page_size + offset; -1 = skip. Grid
// (T, row chunks): one element of K and one of V per thread, loaded before either is stored, so
// a decode token costs one memory round trip rather than a chain of load-after-store ones.
constexpr int kStoreThreads = 256;

__global__ void kv_store_kernel(const void* k /*[T, nkv, dk]*/, int k_dtype, const void* v /*[T, nkv, dv]*/,
                                int v_dtype, void* k_cache, int kc_dtype, void* v_cache, int vc_dtype,
                                const int32_t* slot_mapping /*[T]*/, int page_size, int64_t k_page_stride,
                                int64_t v_page_stride, int64_t k_row /*nkv·dk*/, int64_t v_row /*nkv·dv*/,
                                int early) {
    if (!early) pdl_begin();
    const int64_t t = blockIdx.x, i = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
    const int32_t slot = slot_mapping[t];  // host-written batch metadata: read before pdl_wait
    pdl_begin();
    if (slot < 0) return;
    const int64_t page = slot / page_size, offset = slot % page_size;
    const float kv = i < k_row ? load_f(k, k_dtype, t * k_row + i) : 0.f;
    const float vv = i < v_row ? load_f(v, v_dtype, t * v_row + i) : 0.f;
    if (i < k_row) store_f(k_cache, kc_dtype, page * k_page_stride + offset * k_row + i, kv);
    if (i < v_row) store_f(v_cache, vc_dtype, page * v_page_stride + offset * v_row + i, vv);
}

// max with NaN propagating (fmaxf drops NaN): the CPU's amax keeps a NaN once seen.
__device__ __forceinline__ float nan_max(float a, float b) { return a != a || b != b ? __int_as_float(0x7fc00000) : fmaxf(a, b); }

// fp8 caches: one warp per (token, head) row of K or V. Quantizes exactly as the CPU
// (src/backend/cpu/kv_fp8.h): amax (NaN propagating), scale = amax / 448 (1 if 0),
// q = e4m3_rn_satfinite(x / scale), scale stored after the page's values.
__global__ void kv_store_fp8_kernel(const void* k /*[T, nkv, dk]*/, int k_dtype, const void* v /*[T, nkv, dv]*/,
                                    int v_dtype, uint8_t* k_cache, uint8_t* v_cache,
                                    const int32_t* slot_mapping /*[T]*/, int page_size, int nkv, int dk, int dv,
                                    int64_t k_page_stride /*bytes*/, int64_t v_page_stride /*bytes*/) {
    const int64_t t = blockIdx.x;
    const int32_t slot = slot_mapping[t];
    if (slot < 0) return;
    const int64_t page = slot / page_size, offset = slot % page_size;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    for (int r = warp; r < 2 * nkv; r += n_warps) {
        const bool is_k = r < nkv;
        const int g = is_k ? r : r - nkv, d = is_k ? dk : dv, dtype = is_k ? k_dtype : v_dtype;
        const void* src = is_k ? k : v;
        const int64_t src_base = (t * nkv + g) * d, row = offset * nkv + g;
        uint8_t* page_base = (is_k ? k_cache : v_cache) + page * (is_k ? k_page_stride : v_page_stride);
        float amax = 0.f;
        for (int i = lane; i < d; i += 32) amax = nan_max(amax, fabsf(load_f(src, dtype, src_base + i)));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        float scale = amax / 448.f;
        if (scale == 0.f) scale = 1.f;
        uint8_t* q = page_base + row * d;
        for (int i = lane; i < d; i += 32) q[i] = float_to_fp8(load_f(src, dtype, src_base + i) / scale);
        if (lane < 4) {  // the scale's 4 bytes, little-endian, alignment-free
            const uint32_t bits = uint32_t(__float_as_int(scale));
            page_base[int64_t(page_size) * nkv * d + row * 4 + lane] = uint8_t(bits >> (8 * lane));
        }
    }
}

// ROPE_KV_STORE (backend_abi.h): ROPE(q), ROPE(k), SCALE(v), KV_STORE(k, v) in one launch. Grid
// (T, item chunks); a thread owns one item of its token:
//   - a rotation item: pair j of up to kPrologueHeads consecutive heads of [q heads, k heads]; the
//     angle once per thread (f64, before pdl_wait, as rope_kernel), every pair loaded before any
//     store. A rotated k value goes to k as ROPE writes it (rounded to k's dtype) and from there
//     to the cache, as KV_STORE would copy it;
//   - a copy item: a k element past rotary_dim, or a v element times value_scale (rounded to v's
//     dtype, as SCALE writes it), to the cache.
// Padding tokens (slot -1) are rotated and scaled but not stored, as by the four ops. store = 0
// (fp8 caches): rotate and scale only, kv_store_fp8_kernel stores afterwards.
constexpr int kPrologueThreads = 128, kPrologueHeads = 8;

struct PrologueArgs {
    void *q, *k, *v, *k_cache, *v_cache;
    int q_dtype, k_dtype, v_dtype, kc_dtype, vc_dtype;
    const int32_t* positions;     // [T]
    const int32_t* slot_mapping;  // [T]
    int nq, nkv, dk, dv, rotary_dim, page_size;
    float theta, value_scale;
    int64_t k_page_stride, v_page_stride;  // elements
    bool store, early;
};

// Items of one token: rotation items first, then k's unrotated elements, then v's elements.
__host__ __device__ inline int prologue_rotation_items(int nq, int nkv, int rotary_dim) {
    return (nq + nkv + kPrologueHeads - 1) / kPrologueHeads * (rotary_dim / 2);
}

// kDtype >= 0: every tensor holds that dtype (the decoder's case), fixed at compile time; the
// generic instance (-1) switches on each tensor's dtype per access and is ~3x the code, which cost
// ~5 µs per launch at batch 1 (instruction fetch; ncu: 9.3 µs against 3.9 for rope_kernel).
template <int kDtype>
__global__ void __launch_bounds__(kPrologueThreads) rope_kv_store_kernel(PrologueArgs a) {
    if constexpr (kDtype >= 0) a.q_dtype = a.k_dtype = a.v_dtype = a.kc_dtype = a.vc_dtype = kDtype;
    if (!a.early) pdl_begin();
    const int64_t t = blockIdx.x;
    const int item = int(blockIdx.y) * kPrologueThreads + int(threadIdx.x);
    const int half = a.rotary_dim / 2, k_rest = a.dk - a.rotary_dim;
    const int rotation_items = prologue_rotation_items(a.nq, a.nkv, a.rotary_dim);
    if (item >= rotation_items + a.nkv * (k_rest + a.dv)) return;
    // Host-written batch metadata: read before pdl_wait.
    const int32_t slot = a.store ? a.slot_mapping[t] : -1;
    const int64_t page = slot >= 0 ? slot / a.page_size : 0, offset = slot >= 0 ? slot % a.page_size : 0;
    const auto k_slot = [&](int g, int d) { return page * a.k_page_stride + (offset * a.nkv + g) * a.dk + d; };
    if (item < rotation_items) {
        const int j = item % half, h0 = item / half * kPrologueHeads;
        const double inv_freq = pow(double(a.theta), -2.0 * j / double(a.rotary_dim));
        double s, co;
        sincos(double(a.positions[t]) * inv_freq, &s, &co);
        pdl_begin();
        float lo[kPrologueHeads], hi[kPrologueHeads];
#pragma unroll
        for (int u = 0; u < kPrologueHeads; ++u) {
            const int h = h0 + u;
            lo[u] = hi[u] = 0.f;
            if (h < a.nq) {
                const int64_t base = (t * a.nq + h) * a.dk;
                lo[u] = load_f(a.q, a.q_dtype, base + j);
                hi[u] = load_f(a.q, a.q_dtype, base + j + half);
            } else if (h < a.nq + a.nkv) {
                const int64_t base = (t * a.nkv + (h - a.nq)) * a.dk;
                lo[u] = load_f(a.k, a.k_dtype, base + j);
                hi[u] = load_f(a.k, a.k_dtype, base + j + half);
            }
        }
#pragma unroll
        for (int u = 0; u < kPrologueHeads; ++u) {
            const int h = h0 + u;
            if (h >= a.nq + a.nkv) break;
            const float r_lo = lo[u] * float(co) - hi[u] * float(s), r_hi = hi[u] * float(co) + lo[u] * float(s);
            if (h < a.nq) {
                const int64_t base = (t * a.nq + h) * a.dk;
                store_f(a.q, a.q_dtype, base + j, r_lo);
                store_f(a.q, a.q_dtype, base + j + half, r_hi);
            } else {
                const int g = h - a.nq;
                const int64_t base = (t * a.nkv + g) * a.dk;
                store_f(a.k, a.k_dtype, base + j, r_lo);
                store_f(a.k, a.k_dtype, base + j + half, r_hi);
                if (slot >= 0) {
                    store_f(a.k_cache, a.kc_dtype, k_slot(g, j), round_to(a.k_dtype, r_lo));
                    store_f(a.k_cache, a.kc_dtype, k_slot(g, j + half), round_to(a.k_dtype, r_hi));
                }
            }
        }
        return;
    }
    pdl_begin();
    const int c = item - rotation_items;
    if (c < a.nkv * k_rest) {  // a k element past the rotary dims: copied
        const int g = c / k_rest, d = a.rotary_dim + c % k_rest;
        if (slot >= 0) store_f(a.k_cache, a.kc_dtype, k_slot(g, d), load_f(a.k, a.k_dtype, (t * a.nkv + g) * a.dk + d));
        return;
    }
    const int e = c - a.nkv * k_rest, g = e / a.dv, d = e % a.dv;  // a v element: scaled, copied
    const int64_t src = (t * a.nkv + g) * a.dv + d;
    const float x = round_to(a.v_dtype, load_f(a.v, a.v_dtype, src) * a.value_scale);
    if (a.value_scale != 1.f) store_f(a.v, a.v_dtype, src, x);
    if (slot >= 0) store_f(a.v_cache, a.vc_dtype, page * a.v_page_stride + (offset * a.nkv + g) * a.dv + d, x);
}

bool is_i32(const xinfer_tensor& t, int64_t n) { return t.dtype == XINFER_DTYPE_I32 && t.rank >= 1 && numel(t) == n; }

// A cache tensor is accepted as [pages, page_size, n_kv, d], or with page_stride given, any
// tensor whose pages the stride describes.
bool cache_ok(const xinfer_tensor& t, const xinfer_attention_batch& b, int64_t nkv, int64_t d) {
    if (!is_float(t.dtype) && t.dtype != XINFER_DTYPE_F8_E4M3) return false;
    if (t.rank == 4) return t.shape[1] == b.page_size && t.shape[2] == nkv && t.shape[3] == d;
    return b.page_stride > 0 && t.rank >= 1;
}

// Elements (bytes for fp8) between pages of one cache: the batch's page_stride, else a
// contiguous [pages, page_size, nkv, d] tensor (fp8: each page is its values, then its row scales).
int64_t cache_page_stride(const xinfer_attention_batch& b, int dtype, int64_t nkv, int64_t d) {
    if (b.page_stride > 0) return b.page_stride;
    return int64_t(b.page_size) * nkv * (d + (dtype == XINFER_DTYPE_F8_E4M3 ? 4 : 0));
}

}  // namespace

int op_kv_store(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &k = op->src[0], &v = op->src[1], &k_cache = op->src[2], &v_cache = op->src[3];
    const xinfer_attention_batch& b = op->batch;
    if (k.rank != 3 || v.rank != 3 || !is_float(k.dtype) || !is_float(v.dtype) || v.shape[0] != k.shape[0] ||
        v.shape[1] != k.shape[1] || b.page_size <= 0 || !cache_ok(k_cache, b, k.shape[1], k.shape[2]) ||
        !cache_ok(v_cache, b, k.shape[1], v.shape[2]) || !is_i32(b.slot_mapping, k.shape[0]))
        return unsupported(c, op, "k %s, v %s, k_cache %s, v_cache %s, slot_mapping %s, page_size %d: expected k [T, "
                           "n_kv, dk], v [T, n_kv, dv], caches [pages, page_size, n_kv, d] (or page_stride), i32 slots",
                           shape_str(k).c_str(), shape_str(v).c_str(), shape_str(k_cache).c_str(),
                           shape_str(v_cache).c_str(), shape_str(b.slot_mapping).c_str(), b.page_size);
    const int64_t T = k.shape[0], nkv = k.shape[1], dk = k.shape[2], dv = v.shape[2];
    const bool k_fp8 = k_cache.dtype == XINFER_DTYPE_F8_E4M3, v_fp8 = v_cache.dtype == XINFER_DTYPE_F8_E4M3;
    if (k_fp8 != v_fp8)
        return unsupported(c, op, "k_cache %s, v_cache %s: fp8 and non-fp8 caches mixed in one op",
                           shape_str(k_cache).c_str(), shape_str(v_cache).c_str());
    if (!run || T == 0) return XINFER_OK;
    const int64_t k_stride = cache_page_stride(b, k_cache.dtype, nkv, dk);
    const int64_t v_stride = cache_page_stride(b, v_cache.dtype, nkv, dv);
    if (k_fp8) {
        kv_store_fp8_kernel<<<unsigned(T), 128, 0, c->stream>>>(
            k.data, k.dtype, v.data, v.dtype, static_cast<uint8_t*>(k_cache.data), static_cast<uint8_t*>(v_cache.data),
            static_cast<const int32_t*>(b.slot_mapping.data), b.page_size, int(nkv), int(dk), int(dv), k_stride,
            v_stride);
        XCUDA_CHECK_LAUNCH(c, "kv_store_fp8_kernel");
        return XINFER_OK;
    }
    const unsigned row_chunks = unsigned(ceil_div(std::max(nkv * dk, nkv * dv), kStoreThreads));
    return launch_pdl(c, "kv_store_kernel", kv_store_kernel, dim3(unsigned(T), row_chunks), dim3(kStoreThreads), 0,
                      k.data, k.dtype, v.data, v.dtype, k_cache.data, k_cache.dtype, v_cache.data, v_cache.dtype,
                      static_cast<const int32_t*>(b.slot_mapping.data), b.page_size, k_stride, v_stride, nkv * dk,
                      nkv * dv, int(early_reads()));
}

// XINFER_CUDA_FUSED_PROLOGUE=0 refuses ROPE_KV_STORE, so xinfer runs the four ops (A/B runs).
int op_rope_kv_store(Context* c, const xinfer_op* op, bool run) {
    static const bool enabled = env_flag("XINFER_CUDA_FUSED_PROLOGUE", true);
    if (!enabled) return unsupported(c, op, "turned off by XINFER_CUDA_FUSED_PROLOGUE=0");
    if (int rc = op_kv_store(c, op, false)) return rc;  // k, v, caches, batch: KV_STORE's rules
    const xinfer_tensor &k = op->src[0], &v = op->src[1], &k_cache = op->src[2], &v_cache = op->src[3],
                        &q = op->src[4], &positions = op->src[5];
    const auto& p = op->params.rope_kv_store;
    const int64_t T = k.shape[0];
    if (q.rank != 3 || !is_float(q.dtype) || q.shape[0] != T || q.shape[2] != k.shape[2] || !is_i32(positions, T) ||
        p.rotary_dim <= 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > k.shape[2])
        return unsupported(c, op, "q %s, k %s, positions %s, rotary_dim %d: expected q [T, n_q, dk] with k's T and dk, "
                           "i32 positions [T], even rotary_dim in (0, dk]",
                           shape_str(q).c_str(), shape_str(k).c_str(), shape_str(positions).c_str(), p.rotary_dim);
    if (!run || T == 0) return XINFER_OK;
    const bool fp8 = k_cache.dtype == XINFER_DTYPE_F8_E4M3;
    const xinfer_attention_batch& b = op->batch;
    PrologueArgs a{};
    a.q = q.data;
    a.k = k.data;
    a.v = v.data;
    a.k_cache = k_cache.data;
    a.v_cache = v_cache.data;
    a.q_dtype = q.dtype;
    a.k_dtype = k.dtype;
    a.v_dtype = v.dtype;
    a.kc_dtype = k_cache.dtype;
    a.vc_dtype = v_cache.dtype;
    a.positions = static_cast<const int32_t*>(positions.data);
    a.slot_mapping = static_cast<const int32_t*>(b.slot_mapping.data);
    a.nq = int(q.shape[1]);
    a.nkv = int(k.shape[1]);
    a.dk = int(k.shape[2]);
    a.dv = int(v.shape[2]);
    a.rotary_dim = p.rotary_dim;
    a.page_size = b.page_size;
    a.theta = p.theta;
    a.value_scale = p.value_scale;
    a.k_page_stride = cache_page_stride(b, k_cache.dtype, a.nkv, a.dk);
    a.v_page_stride = cache_page_stride(b, v_cache.dtype, a.nkv, a.dv);
    a.store = !fp8;
    a.early = early_reads();
    const int items = prologue_rotation_items(a.nq, a.nkv, a.rotary_dim) + a.nkv * (a.dk - a.rotary_dim + a.dv);
    const dim3 grid(unsigned(T), unsigned(ceil_div(items, kPrologueThreads)));
    // fp8 caches are not written by this kernel (store = 0), so their dtype does not count.
    constexpr int bf16 = XINFER_DTYPE_BF16;
    const bool all_bf16 = a.q_dtype == bf16 && a.k_dtype == bf16 && a.v_dtype == bf16 &&
                          (fp8 || (a.kc_dtype == bf16 && a.vc_dtype == bf16));
    const auto kernel = all_bf16 ? rope_kv_store_kernel<bf16> : rope_kv_store_kernel<-1>;
    if (int rc = launch_pdl(c, "rope_kv_store_kernel", kernel, grid, dim3(kPrologueThreads), 0, a)) return rc;
    return fp8 ? op_kv_store(c, op, true) : XINFER_OK;
}

// attention_decode.cu: split-KV kernel for few query tokens per sequence; XINFER_UNSUPPORTED = not taken.
int attention_decode(Context* c, const xinfer_op* op);

int op_attention(Context* c, const xinfer_op* op, bool run) {
    const xinfer_tensor &q = op->src[0], &k_cache = op->src[1], &v_cache = op->src[2], &sinks = op->src[3],
                        &out = op->dst[0];
    const xinfer_attention_batch& b = op->batch;
    const xinfer_attention_params& ap = op->params.attention;
    const int nq = ap.n_q_heads, nkv = ap.n_kv_heads, dk = ap.head_dim_k, dv = ap.head_dim_v;
    const auto shapes = [&] {
        return str_format("q %s, k_cache %s, v_cache %s, sinks %s, out %s, n_q %d, n_kv %d, dk %d, dv %d, page_size %d",
                          shape_str(q).c_str(), shape_str(k_cache).c_str(), shape_str(v_cache).c_str(),
                          shape_str(sinks).c_str(), shape_str(out).c_str(), nq, nkv, dk, dv, b.page_size);
    };
    if (nq <= 0 || nkv <= 0 || nq % nkv != 0 || dk <= 0 || dv <= 0 || dk > kMaxHeadDim || dv > kMaxHeadDim)
        return unsupported(c, op, "%s: need n_q a multiple of n_kv and head dims in [1, %d]", shapes().c_str(),
                           kMaxHeadDim);
    if (q.rank != 3 || q.shape[1] != nq || q.shape[2] != dk || !is_float(q.dtype) || !is_float(out.dtype) ||
        rows_of(out) * cols_of(out) != q.shape[0] * nq * dv || b.page_size <= 0 || b.n_seqs < 0 ||
        !cache_ok(k_cache, b, nkv, dk) || !cache_ok(v_cache, b, nkv, dv))
        return unsupported(c, op, "%s: expected q [T, n_q, dk], out [T, n_q, dv], caches [pages, page_size, n_kv, d]",
                           shapes().c_str());
    if (!absent(sinks) && (sinks.dtype != XINFER_DTYPE_F32 || numel(sinks) != nq))
        return unsupported(c, op, "%s: sinks must be f32 [n_q]", shapes().c_str());
    if ((ap.k_scale != 1.f && ap.k_scale != 0.f) || (ap.v_scale != 1.f && ap.v_scale != 0.f))
        return unsupported(c, op, "%s: per-tensor k_scale %g / v_scale %g (expected 1; fp8 caches carry row scales)",
                           shapes().c_str(), ap.k_scale, ap.v_scale);
    const int64_t T = q.shape[0];
    if (!is_i32(b.cu_q_lens, b.n_seqs + 1) || !is_i32(b.kv_lens, b.n_seqs) || !is_i32(b.positions, T) ||
        b.page_table.dtype != XINFER_DTYPE_I32 || numel(b.page_table) != int64_t(b.n_seqs) * b.max_pages_per_seq)
        return unsupported(c, op, "%s: batch metadata cu_q_lens %s, kv_lens %s, positions %s, page_table %s (i32 "
                           "[n_seqs+1], [n_seqs], [T], [n_seqs, max_pages])",
                           shapes().c_str(), shape_str(b.cu_q_lens).c_str(), shape_str(b.kv_lens).c_str(),
                           shape_str(b.positions).c_str(), shape_str(b.page_table).c_str());
    const int dk_pad = (dk + 15) / 16 * 16, dv_pad = (dv + 15) / 16 * 16;
    const AttnSmem L = attn_smem(dk_pad, dv_pad);
    if (size_t(L.total) > c->smem_optin)
        return unsupported(c, op, "%s: needs %d bytes of shared memory, device allows %zu", shapes().c_str(), L.total,
                           c->smem_optin);
    if (!run || T == 0 || b.n_seqs == 0) return XINFER_OK;

    AttnArgs a{};
    a.q = q.data;
    a.k_cache = k_cache.data;
    a.v_cache = v_cache.data;
    a.sinks = absent(sinks) ? nullptr : static_cast<const float*>(sinks.data);
    a.out = out.data;
    a.cu_q_lens = static_cast<const int32_t*>(b.cu_q_lens.data);
    a.kv_lens = static_cast<const int32_t*>(b.kv_lens.data);
    a.positions = static_cast<const int32_t*>(b.positions.data);
    a.page_table = static_cast<const int32_t*>(b.page_table.data);
    a.k_page_stride = cache_page_stride(b, k_cache.dtype, nkv, dk);
    a.v_page_stride = cache_page_stride(b, v_cache.dtype, nkv, dv);
    a.T = T;
    a.q_dtype = q.dtype;
    a.k_dtype = k_cache.dtype;
    a.v_dtype = v_cache.dtype;
    a.out_dtype = out.dtype;
    a.n_seqs = b.n_seqs;
    a.max_pages = b.max_pages_per_seq;
    a.page_size = b.page_size;
    a.nq = nq;
    a.nkv = nkv;
    a.group = nq / nkv;
    a.dk = dk;
    a.dv = dv;
    a.dk_pad = dk_pad;
    a.dv_pad = dv_pad;
    a.scale = ap.softmax_scale;
    a.window = ap.window;
    a.causal = ap.causal;
    // Vector loads of 8 elements: 16 bytes of bf16, 8 bytes of fp8.
    const auto vec_ok = [](const xinfer_tensor& cache, int d, int64_t stride) {
        if (cache.dtype == XINFER_DTYPE_BF16) return d % 8 == 0 && stride % 8 == 0 && pointer_alignment(cache.data) >= 16;
        if (cache.dtype == XINFER_DTYPE_F8_E4M3) return d % 8 == 0 && stride % 8 == 0 && pointer_alignment(cache.data) >= 8;
        return false;
    };
    a.k_vec = vec_ok(k_cache, dk, a.k_page_stride);
    a.v_vec = vec_ok(v_cache, dv, a.v_page_stride);
    // f32 activations take the exact CUDA-core path (bf16 tensor cores would round Q, K, V, P),
    // FP8 caches included (dequantized in f32, as the CPU does).
    if (exact_attention_supported(q.dtype, out.dtype, k_cache.dtype, v_cache.dtype)) return launch_exact_attention(c, a);
    // bf16/f32/f16 caches with dk ≤ 256, dv ≤ 128, decode and prefill: the split-KV kernel
    // (attention_decode.cu); this file's flash kernel takes FP8 caches and wider heads.
    if (int rc = attention_decode(c, op); rc != XINFER_UNSUPPORTED) return rc;

    // Row tiles: Σ_s ceil(q_len_s · G / 64) ≤ ceil(T · G / 64) + n_seqs.
    const int64_t row_tiles = ceil_div(T * a.group, kBQ) + b.n_seqs;
    const int64_t blocks = row_tiles * nkv;
    int64_t key_span = int64_t(b.max_pages_per_seq) * b.page_size;
    if (ap.window > 0) key_span = std::min<int64_t>(key_span, (ap.causal ? 1 : 2) * int64_t(ap.window) + kBQ);
    int n_split = 1;
    if (blocks < 2 * c->sm_count && key_span > 8 * kBKeys)
        n_split = int(std::min<int64_t>({ceil_div(2 * c->sm_count, blocks), ceil_div(key_span, 8 * kBKeys), 64}));
    a.n_split = n_split;
    if (n_split > 1) {
        ScratchPlan plan;
        const size_t off_o = plan.add(size_t(n_split) * size_t(T * nq * dv) * 4);
        const size_t off_ml = plan.add(size_t(n_split) * size_t(T * nq) * 8);
        if (int rc = ensure_scratch(c, plan.total)) return rc;
        a.part_o = reinterpret_cast<float*>(c->scratch + off_o);
        a.part_ml = reinterpret_cast<float*>(c->scratch + off_ml);
    }
    if (L.total > 48 * 1024)
        XCUDA_TRY(c, cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L.total));
    attention_kernel<<<dim3(unsigned(row_tiles), unsigned(nkv), unsigned(n_split)), kThreads, size_t(L.total),
                       c->stream>>>(a);
    XCUDA_CHECK_LAUNCH(c, "attention_kernel");
    if (n_split > 1) {
        attention_combine_kernel<<<unsigned(T * nq), 128, 0, c->stream>>>(a.part_o, a.part_ml, a.sinks, n_split,
                                                                           T * nq, nq, dv, out.data, out.dtype);
        XCUDA_CHECK_LAUNCH(c, "attention_combine_kernel");
    }
    return XINFER_OK;
}

}  // namespace xcuda
