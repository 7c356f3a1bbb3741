// The CPU backend's kernels as free functions, one family per .cpp file (matmul.cpp,
// attention.cpp, norm_rope.cpp, moe.cpp). CpuBackend (cpu_backend.cpp) only forwards to these.
// Every function validates its arguments first and throws xinfer::Error naming the op and the
// shapes; all of them run synchronously on the calling thread plus the OpenMP pool.
#pragma once

#include "backend/backend.h"

#include <atomic>
#include <initializer_list>
#include <mutex>
#include <string>
#include <vector>

namespace xinfer::cpu {

// ---- kernels (semantics: backend.h) ---------------------------------------------------------
void embedding(const Tensor& table, const Tensor& ids, const Tensor& out);
void rmsnorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out);
void add_rmsnorm(const Tensor& residual, const Tensor& x, const Tensor& weight, float eps, const Tensor& out);
void matmul(const Tensor& x, const Tensor& w, const Tensor& y);
void rope(const Tensor& x, const Tensor& positions, const RopeParams& params);
void swiglu(const Tensor& gate_up, const Tensor& out);
void scale(const Tensor& x, float factor);
void add(const Tensor& x, const Tensor& y);
void kv_store(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
              const AttentionBatch& batch);
void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& sinks,
               const AttentionBatch& batch, const AttentionParams& params, const Tensor& out);
void moe_route(const Tensor& logits, const Tensor& bias, const RouterParams& params, const Tensor& expert_ids,
               const Tensor& expert_weights);
// gate_up / down may be f8_e4m3 with f32 block scales [E, ceil(rows / block_rows), ceil(cols / block_cols)]
// (contiguous grid, partial edge blocks): W[r, c] = fp8(W8[r, c]) · scale[r / block_rows][c / block_cols] in f32.
void moe_experts(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights, const Tensor& gate_up,
                 const Tensor& down, const Tensor& out, const Tensor& gate_up_scale = {}, const Tensor& down_scale = {},
                 int64_t block_rows = 128, int64_t block_cols = 128);

// y = x · wᵀ on raw row-major memory, for callers that slice weights themselves (moe_experts).
// Parallel over all OpenMP threads; must not be called from inside a parallel region.
void matmul_raw(const float* x /*[T, K]*/, int64_t T, int64_t K, const void* w /*[N, K]*/, DType w_dtype, int64_t N,
                float* y /*[T, N]*/);

void argmax(const Tensor& logits, const Tensor& ids);
int32_t argmax_row(const float* logits, int64_t vocab);
// The reference sampling rule: temperature ≤ 0 → argmax; else sort by logit (ties: lower
// index), keep top_k (0 = all), softmax at temperature, keep the smallest prefix with mass ≥
// top_p, and pick where uniform·(kept mass) falls in the cumulative sum.
int32_t sample_row(const float* logits, int64_t vocab, float temperature, float top_p, int top_k, float uniform);
// The distribution sample_row draws from when temperature > 0: candidate ids in its order and
// their probabilities (summing to 1). Speculative verification needs it whole.
void sampling_distribution(const float* logits, int64_t vocab, float temperature, float top_p, int top_k,
                           std::vector<int32_t>& ids, std::vector<double>& probs);
void convert(const Tensor& src, const Tensor& dst);
// SAMPLE: one row each with its own temperature / top-p / top-k, drawing with `uniform`.
void sample(const Tensor& logits, const Tensor& temperature, const Tensor& top_p, const Tensor& top_k,
            const Tensor& uniform, const Tensor& ids);

// Host memory (64-byte aligned; release with std::free) and the bandwidth probe.
void* host_alloc(size_t bytes);
double measure_copy_bandwidth_gbps();

// ---- validation helpers ------------------------------------------------------------------------
std::string dtype_list(std::initializer_list<DType> dtypes);

inline void check_dtype(const char* op, const char* what, const Tensor& t, std::initializer_list<DType> allowed) {
    for (DType d : allowed)
        if (t.dtype == d) return;
    fail("{}: {} has dtype {}, expected {}", op, what, dtype_name(t.dtype), dtype_list(allowed));
}

inline void check_rank(const char* op, const char* what, const Tensor& t, int rank) {
    if (t.rank != rank) fail("{}: {} has shape {}, expected rank {}", op, what, t.shape_string(), rank);
    if (t.numel() > 0 && t.data == nullptr) fail("{}: {} {} has no data", op, what, t.shape_string());
}

// Exact shape check; a negative expected dim matches anything.
inline void check_shape(const char* op, const char* what, const Tensor& t, std::initializer_list<int64_t> dims) {
    bool ok = t.rank == int(dims.size());
    int i = 0;
    for (int64_t d : dims) {
        if (ok && d >= 0 && t.shape[size_t(i)] != d) ok = false;
        ++i;
    }
    if (!ok) {
        std::string expected = "[";
        i = 0;
        for (int64_t d : dims) expected += (i++ ? ", " : "") + (d >= 0 ? std::to_string(d) : std::string("*"));
        fail("{}: {} has shape {}, expected {}", op, what, t.shape_string(), expected + "]");
    }
    if (t.numel() > 0 && t.data == nullptr) fail("{}: {} {} has no data", op, what, t.shape_string());
}

// Exceptions must not escape an OpenMP region, so workers record the first failure here and
// the caller rethrows it after the region ends.
class ParallelError {
public:
    bool failed() const { return failed_.load(std::memory_order_relaxed); }
    void record(std::string message) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!failed_.exchange(true)) message_ = std::move(message);
    }
    void rethrow() const {
        if (failed()) throw Error(message_);
    }

private:
    std::atomic<bool> failed_{false};
    std::mutex mutex_;
    std::string message_;
};

// Converts n elements of any weight dtype (f32, bf16, f16) to f32, vectorised.
void widen_to_f32(DType dtype, const void* src, float* dst, int64_t n);

}  // namespace xinfer::cpu
