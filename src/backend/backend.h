// The device interface the models are written against. Every op is coarse and fused, takes
// plain Tensors plus a small parameter struct, and runs asynchronously on the backend's stream
// (the CPU backend runs synchronously). The CPU backend is the oracle: every other backend is
// tested op by op against it.
//
// Conventions for all ops:
//  - Activations are f32 on the CPU backend (bf16 on GPU backends); accumulation is f32.
//  - Weights W are stored [out, in] and applied as y = x · Wᵀ (PyTorch nn.Linear layout).
//  - Integer metadata (token ids, positions, page tables) is i32.
//  - Outputs never alias inputs unless the op says "in place".
#pragma once

#include "core/tensor.h"

#include <memory>
#include <string>

namespace xinfer {

struct RopeParams {
    int rotary_dim = 0;     // rotate the first rotary_dim dims of each head (partial rotary), rest pass through
    float theta = 10000.f;  // inv_freq[j] = theta^(-2j / rotary_dim)
    // Pairing is NeoX rotate-half: (x[j], x[j + rotary_dim/2]) for j < rotary_dim/2.
};

struct AttentionParams {
    int n_q_heads = 0;
    int n_kv_heads = 0;   // GQA: query head h reads kv head h / (n_q_heads / n_kv_heads)
    int head_dim_k = 0;   // Q/K head dim (192 for MiMo)
    int head_dim_v = 0;   // V head dim (128 for MiMo); never padded to head_dim_k
    float softmax_scale = 1.f;  // applied to q·k before masking; sinks are in these scaled units
    int window = 0;       // 0: unlimited. Causal: query at position p sees keys j with p - j < window.
                          // Non-causal: |p - j| < window (symmetric; DFlash drafter blocks).
    bool causal = true;   // false: every query sees every key j < kv_len (subject to window)
    int page_size = 0;    // tokens per KV page
};

// Per-step, per-layer-group metadata shared by kv_store and attention. Built on the host by the
// KV manager and uploaded; sequences are laid out back to back in the token dimension.
struct AttentionBatch {
    int n_seqs = 0;
    int max_pages_per_seq = 0;
    Tensor cu_q_lens;     // [n_seqs + 1] i32: tokens of sequence s are rows [cu_q_lens[s], cu_q_lens[s+1])
    Tensor kv_lens;       // [n_seqs] i32: keys 0..kv_len-1 of sequence s are in its cache after kv_store
    Tensor positions;     // [n_tokens] i32: absolute position of each query token (= its key index)
    Tensor page_table;    // [n_seqs, max_pages_per_seq] i32: physical page of logical page p; -1 = not resident
    Tensor slot_mapping;  // [n_tokens] i32: page * page_size + offset where each new token's K/V goes; -1 = skip
};

struct RouterParams {
    enum class Scoring { softmax, sigmoid };
    Scoring scoring = Scoring::softmax;
    int top_k = 1;
    int n_group = 1;         // DeepSeek group-limited routing: keep topk_group groups by the sum of
    int topk_group = 1;      //   each group's top-2 selection scores, then top_k within them
    bool norm_topk_prob = false;  // renormalise the chosen weights to sum to 1
    float routed_scaling_factor = 1.f;
    // The optional correction bias (e_score_correction_bias) is added to the scores for
    // *selection only*; weights come from the unbiased scores.
};

class Backend {
public:
    virtual ~Backend() = default;
    virtual std::string name() const = 0;

    // ---- memory -------------------------------------------------------------------------
    virtual Buffer alloc(size_t bytes) = 0;
    virtual void upload(const Tensor& dst, const void* host_src) = 0;    // dst.nbytes() bytes
    virtual void download(const Tensor& src, void* host_dst) = 0;        // src.nbytes() bytes
    virtual void synchronize() = 0;
    // Device memory bandwidth measured now with a large copy: (bytes read + bytes written) /
    // seconds, in GB/s (1e9). The roofline every benchmark compares against.
    virtual double measure_copy_bandwidth_gbps() = 0;

    // ---- ops ----------------------------------------------------------------------------
    // out[t] = table[ids[t]], converted to out.dtype.
    virtual void embedding(const Tensor& table /*[vocab, hidden]*/, const Tensor& ids /*[T] i32*/,
                           const Tensor& out /*[T, hidden]*/) = 0;
    // out = x / sqrt(mean(x²) + eps) * weight, per row; statistics in f32.
    virtual void rmsnorm(const Tensor& x /*[rows, n]*/, const Tensor& weight /*[n]*/, float eps,
                         const Tensor& out /*[rows, n]*/) = 0;
    // residual += x (in place), then out = rmsnorm(residual).
    virtual void add_rmsnorm(const Tensor& residual /*[rows, n] in/out*/, const Tensor& x /*[rows, n]*/,
                             const Tensor& weight /*[n]*/, float eps, const Tensor& out /*[rows, n]*/) = 0;
    // y = x · wᵀ. w may be f32, bf16 or f16.
    virtual void matmul(const Tensor& x /*[T, in]*/, const Tensor& w /*[out, in]*/, const Tensor& y /*[T, out]*/) = 0;
    // In place, on the first rotary_dim dims of every head.
    virtual void rope(const Tensor& x /*[T, heads, head_dim] in/out*/, const Tensor& positions /*[T] i32*/,
                      const RopeParams& params) = 0;
    // out = silu(gate) * up, with gate_up = [gate | up] along the last dim.
    virtual void swiglu(const Tensor& gate_up /*[T, 2*I]*/, const Tensor& out /*[T, I]*/) = 0;
    virtual void scale(const Tensor& x /*in place*/, float factor) = 0;
    virtual void add(const Tensor& x /*[rows, n] in place*/, const Tensor& y /*[rows, n]*/) = 0;

    // Writes each new token's K/V into its slot (batch.slot_mapping).
    virtual void kv_store(const Tensor& k /*[T, n_kv, dk]*/, const Tensor& v /*[T, n_kv, dv]*/,
                          const Tensor& k_cache /*[pages, page_size, n_kv, dk]*/,
                          const Tensor& v_cache /*[pages, page_size, n_kv, dv]*/, const AttentionBatch& batch) = 0;
    // Paged attention for a batch of sequences with 1..many query tokens each. Optional sinks
    // (per query head, f32; an empty Tensor means none) add one extra logit per head to the
    // softmax whose probability is dropped.
    virtual void attention(const Tensor& q /*[T, n_q, dk]*/, const Tensor& k_cache /*[pages, page_size, n_kv, dk]*/,
                           const Tensor& v_cache /*[pages, page_size, n_kv, dv]*/, const Tensor& sinks /*[n_q] f32 or empty*/,
                           const AttentionBatch& batch, const AttentionParams& params,
                           const Tensor& out /*[T, n_q, dv]*/) = 0;

    // Picks top_k experts per token from router logits (f32).
    virtual void moe_route(const Tensor& logits /*[T, E] f32*/, const Tensor& bias /*[E] f32 or empty*/,
                           const RouterParams& params, const Tensor& expert_ids /*[T, k] i32*/,
                           const Tensor& expert_weights /*[T, k] f32*/) = 0;
    // out[t] = Σ_k weights[t,k] · down_e(silu(gate_e(x[t])) * up_e(x[t])), e = expert_ids[t,k].
    virtual void moe_experts(const Tensor& x /*[T, H]*/, const Tensor& expert_ids /*[T, k] i32*/,
                             const Tensor& expert_weights /*[T, k] f32*/, const Tensor& gate_up /*[E, 2*I, H]*/,
                             const Tensor& down /*[E, H, I]*/, const Tensor& out /*[T, H]*/) = 0;
};

// The built-in CPU backend (src/backend/cpu/). Uses all cores (OpenMP).
std::unique_ptr<Backend> make_cpu_backend();

// "cpu" → the CPU backend; anything else is an error until device plugins exist.
std::unique_ptr<Backend> make_backend(const std::string& device);

}  // namespace xinfer
