// Mixture-of-experts: the router (scores, optional correction bias, DeepSeek group-limited top-k)
// and the routed expert FFN.
//
// moe_experts groups the (token, slot) pairs by expert, gathers each expert's tokens into one
// block, runs its gate_up and down projections as two matmuls over that block (so every expert
// weight is streamed once per call, and many-token blocks take the cache-blocked GEMM path), and
// scatter-adds the weighted results. Experts run one after another; each matmul uses all
// threads.
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace xinfer::cpu {
namespace {

// Descending by score, ties to the lower index: makes selection deterministic across backends.
struct ByScoreThenIndex {
    const float* score;
    bool operator()(int32_t a, int32_t b) const { return score[a] > score[b] || (score[a] == score[b] && a < b); }
};

}  // namespace

void moe_route(const Tensor& logits, const Tensor& bias, const RouterParams& params, const Tensor& expert_ids,
               const Tensor& expert_weights) {
    const char* op = "moe_route";
    check_dtype(op, "logits", logits, {DType::f32});
    check_rank(op, "logits", logits, 2);
    const int64_t T = logits.dim(0), E = logits.dim(1), top_k = params.top_k;
    const bool has_bias = bias.data != nullptr && !(bias.rank > 0 && bias.numel() == 0);
    if (has_bias) {
        check_dtype(op, "bias", bias, {DType::f32});
        check_shape(op, "bias", bias, {E});
    }
    check_dtype(op, "expert_ids", expert_ids, {DType::i32});
    check_dtype(op, "expert_weights", expert_weights, {DType::f32});
    check_shape(op, "expert_ids", expert_ids, {T, top_k});
    check_shape(op, "expert_weights", expert_weights, {T, top_k});
    const int64_t n_group = params.n_group, topk_group = params.topk_group;
    if (n_group < 1 || E % n_group != 0) fail("{}: n_group {} must divide the {} experts", op, n_group, E);
    if (topk_group < 1 || topk_group > n_group)
        fail("{}: topk_group {} must be in [1, n_group {}]", op, topk_group, n_group);
    const int64_t group_size = E / n_group;
    if (top_k < 1 || top_k > topk_group * group_size)
        fail("{}: top_k {} must be in [1, {}] (topk_group {} × {} experts per group)", op, top_k,
             topk_group * group_size, topk_group, group_size);

    const float* bias_data = has_bias ? bias.as<float>() : nullptr;
#pragma omp parallel if (T * E > (1 << 14))
    {
        std::vector<float> scores(static_cast<size_t>(E)), selection(static_cast<size_t>(E)),
            group_scores(static_cast<size_t>(n_group));
        std::vector<int32_t> order(size_t(std::max(E, n_group)));
        std::vector<char> keep_group(static_cast<size_t>(n_group));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            const float* row = logits.as<float>() + t * E;
            if (params.scoring == RouterParams::Scoring::softmax) {
                const float max_logit = *std::max_element(row, row + E);
                float sum = 0.f;
                for (int64_t e = 0; e < E; ++e) sum += scores[size_t(e)] = std::exp(row[e] - max_logit);
                for (int64_t e = 0; e < E; ++e) scores[size_t(e)] /= sum;
            } else {
                for (int64_t e = 0; e < E; ++e) scores[size_t(e)] = 1.f / (1.f + std::exp(-row[e]));
            }
            for (int64_t e = 0; e < E; ++e) selection[size_t(e)] = scores[size_t(e)] + (bias_data ? bias_data[e] : 0.f);

            if (topk_group < n_group) {
                // Group score: sum of the group's two best selection scores (its only one, for
                // groups of one expert).
                for (int64_t g = 0; g < n_group; ++g) {
                    const float* sel = selection.data() + g * group_size;
                    float best = -std::numeric_limits<float>::infinity(), second = best;
                    for (int64_t i = 0; i < group_size; ++i) {
                        if (sel[i] > best) {
                            second = best;
                            best = sel[i];
                        } else if (sel[i] > second) {
                            second = sel[i];
                        }
                    }
                    group_scores[size_t(g)] = group_size >= 2 ? best + second : best;
                }
                std::iota(order.begin(), order.begin() + n_group, 0);
                std::partial_sort(order.begin(), order.begin() + topk_group, order.begin() + n_group,
                                  ByScoreThenIndex{group_scores.data()});
                std::fill(keep_group.begin(), keep_group.end(), 0);
                for (int64_t i = 0; i < topk_group; ++i) keep_group[size_t(order[size_t(i)])] = 1;
                for (int64_t e = 0; e < E; ++e)
                    if (!keep_group[size_t(e / group_size)])
                        selection[size_t(e)] = -std::numeric_limits<float>::infinity();
            }

            std::iota(order.begin(), order.begin() + E, 0);
            std::partial_sort(order.begin(), order.begin() + top_k, order.begin() + E,
                              ByScoreThenIndex{selection.data()});
            int32_t* ids = expert_ids.as<int32_t>() + t * top_k;
            float* weights = expert_weights.as<float>() + t * top_k;
            float sum = 0.f;
            for (int64_t i = 0; i < top_k; ++i) {
                ids[i] = order[size_t(i)];
                weights[i] = scores[size_t(ids[i])];
                sum += weights[i];
            }
            const float factor = params.routed_scaling_factor / (params.norm_topk_prob ? sum + 1e-20f : 1.f);
            for (int64_t i = 0; i < top_k; ++i) weights[i] *= factor;
        }
    }
}

namespace {

// One expert's f8 weight [rows, cols] times its block scales, in f32 (the oracle's definition of
// block-scaled fp8: W = fp8 · scale[r / block_rows][c / block_cols]).
void dequantize_expert(const uint8_t* w, const float* scale, int64_t rows, int64_t cols, int64_t block_rows,
                       int64_t block_cols, float* dst) {
    const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
        const float* s = scale + (r / block_rows) * scale_cols;
        for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = f8_e4m3_to_f32(w[r * cols + c]) * s[c / block_cols];
    }
}

void check_expert_scale(const char* op, const char* name, const Tensor& w, const Tensor& scale, int64_t block_rows,
                        int64_t block_cols) {
    const bool has_scale = scale.data != nullptr && scale.rank > 0;
    if (w.dtype != DType::f8_e4m3) {
        if (has_scale) fail("{}: {} is {}: block scales are only for f8_e4m3 weights", op, name, dtype_name(w.dtype));
        return;
    }
    if (!has_scale) fail("{}: f8_e4m3 {} needs its block scales", op, name);
    if (block_rows < 1 || block_cols < 1) fail("{}: scale blocks {}x{} must be positive", op, block_rows, block_cols);
    check_dtype(op, "scale", scale, {DType::f32});
    check_shape(op, "scale", scale,
                {w.dim(0), (w.dim(1) + block_rows - 1) / block_rows, (w.dim(2) + block_cols - 1) / block_cols});
}

}  // namespace

void moe_experts(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights, const Tensor& gate_up,
                 const Tensor& down, const Tensor& out, const Tensor& gate_up_scale, const Tensor& down_scale,
                 int64_t block_rows, int64_t block_cols) {
    const char* op = "moe_experts";
    check_dtype(op, "x", x, {DType::f32});
    check_dtype(op, "out", out, {DType::f32});
    check_dtype(op, "expert_ids", expert_ids, {DType::i32});
    check_dtype(op, "expert_weights", expert_weights, {DType::f32});
    check_dtype(op, "gate_up", gate_up, {DType::f32, DType::bf16, DType::f16, DType::f8_e4m3});
    check_dtype(op, "down", down, {DType::f32, DType::bf16, DType::f16, DType::f8_e4m3});
    check_rank(op, "x", x, 2);
    check_rank(op, "gate_up", gate_up, 3);
    const int64_t T = x.dim(0), H = x.dim(1), E = gate_up.dim(0), I = gate_up.dim(1) / 2;
    check_rank(op, "expert_ids", expert_ids, 2);
    const int64_t top_k = expert_ids.dim(1);
    check_shape(op, "expert_ids", expert_ids, {T, top_k});
    check_shape(op, "expert_weights", expert_weights, {T, top_k});
    check_shape(op, "gate_up", gate_up, {E, 2 * I, H});
    check_shape(op, "down", down, {E, H, I});
    check_shape(op, "out", out, {T, H});
    check_expert_scale(op, "gate_up", gate_up, gate_up_scale, block_rows, block_cols);
    check_expert_scale(op, "down", down, down_scale, block_rows, block_cols);

    // Bucket the (token, slot) pairs by expert: offsets[e]..offsets[e+1] in `pairs`.
    const int32_t* ids = expert_ids.as<int32_t>();
    std::vector<int64_t> offsets(size_t(E + 1), 0);
    for (int64_t i = 0; i < T * top_k; ++i) {
        if (ids[i] < 0 || ids[i] >= E)
            fail("{}: expert id {} for token {} is outside [0, {})", op, ids[i], i / top_k, E);
        ++offsets[size_t(ids[i]) + 1];
    }
    std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
    std::vector<int64_t> pairs(size_t(T * top_k)), fill(offsets.begin(), offsets.end() - 1);
    for (int64_t i = 0; i < T * top_k; ++i) pairs[size_t(fill[size_t(ids[i])]++)] = i;
    int64_t max_tokens = 0;
    for (int64_t e = 0; e < E; ++e) max_tokens = std::max(max_tokens, offsets[size_t(e + 1)] - offsets[size_t(e)]);

    std::vector<float> gathered(size_t(max_tokens * H)), gate_up_out(size_t(max_tokens * 2 * I)),
        hidden(size_t(max_tokens * I)), expert_out(size_t(max_tokens * H));
    const float* x_data = x.as<float>();
    const float* weight_data = expert_weights.as<float>();
    float* out_data = out.as<float>();
    std::fill(out_data, out_data + T * H, 0.f);
    const size_t gate_up_bytes = dtype_row_bytes(gate_up.dtype, 2 * I * H);
    const size_t down_bytes = dtype_row_bytes(down.dtype, H * I);
    // f8 experts: each touched expert's weights dequantized to f32 just before use.
    const bool gate_up_f8 = gate_up.dtype == DType::f8_e4m3, down_f8 = down.dtype == DType::f8_e4m3;
    std::vector<float> gate_up_f32(gate_up_f8 ? size_t(2 * I * H) : 0), down_f32(down_f8 ? size_t(H * I) : 0);

    for (int64_t e = 0; e < E; ++e) {
        const int64_t begin = offsets[size_t(e)], n = offsets[size_t(e + 1)] - begin;
        if (n == 0) continue;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t t = pairs[size_t(begin + i)] / top_k;
            std::copy(x_data + t * H, x_data + (t + 1) * H, gathered.data() + i * H);
        }
        const void* gate_up_e = static_cast<const char*>(gate_up.data) + size_t(e) * gate_up_bytes;
        if (gate_up_f8) {
            const int64_t scale_size = gate_up_scale.dim(1) * gate_up_scale.dim(2);
            dequantize_expert(static_cast<const uint8_t*>(gate_up_e), gate_up_scale.as<float>() + e * scale_size, 2 * I,
                              H, block_rows, block_cols, gate_up_f32.data());
            gate_up_e = gate_up_f32.data();
        }
        matmul_raw(gathered.data(), n, H, gate_up_e, gate_up_f8 ? DType::f32 : gate_up.dtype, 2 * I,
                   gate_up_out.data());
        for (int64_t i = 0; i < n; ++i) {
            const float* gate = gate_up_out.data() + i * 2 * I;
            const float* up = gate + I;
            float* h = hidden.data() + i * I;
#pragma omp simd
            for (int64_t j = 0; j < I; ++j) h[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
        }
        const void* down_e = static_cast<const char*>(down.data) + size_t(e) * down_bytes;
        if (down_f8) {
            const int64_t scale_size = down_scale.dim(1) * down_scale.dim(2);
            dequantize_expert(static_cast<const uint8_t*>(down_e), down_scale.as<float>() + e * scale_size, H, I,
                              block_rows, block_cols, down_f32.data());
            down_e = down_f32.data();
        }
        matmul_raw(hidden.data(), n, I, down_e, down_f8 ? DType::f32 : down.dtype, H, expert_out.data());
        // Serial scatter: a token may (in principle) list the same expert twice, and this is
        // O(H) per pair against O(H·I) for the matmuls.
        for (int64_t i = 0; i < n; ++i) {
            const int64_t pair = pairs[size_t(begin + i)];
            simd::axpy(weight_data[pair], expert_out.data() + i * H, out_data + (pair / top_k) * H, H);
        }
    }
}

}  // namespace xinfer::cpu
