// ARGMAX, SAMPLE and CONVERT on the CPU. sample_row is the one definition of xinfer's sampling
// semantics; the host Sampler (src/sample/) and every device SAMPLE kernel follow it.
#include "backend/cpu/cpu_ops.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <numeric>
#include <vector>

namespace xinfer::cpu {

int32_t argmax_row(const float* logits, int64_t vocab) {
    return int32_t(std::max_element(logits, logits + vocab) - logits);
}

void sampling_distribution(const float* logits, int64_t vocab, float temperature, float top_p, int top_k,
                           std::vector<int32_t>& ids, std::vector<double>& probs) {
    // Candidates by logit, descending (ties: lower index first); top-k trims the list.
    const int64_t k = top_k > 0 ? std::min<int64_t>(top_k, vocab) : vocab;
    ids.resize(static_cast<size_t>(vocab));
    std::iota(ids.begin(), ids.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
    ids.resize(size_t(k));
    // Softmax at temperature, in double for a stable tail.
    probs.resize(ids.size());
    const double max_logit = logits[ids[0]];
    double total = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
        probs[i] = std::exp((double(logits[ids[i]]) - max_logit) / temperature);
        total += probs[i];
    }
    // Top-p keeps the smallest prefix whose mass reaches top_p (always at least one token).
    size_t keep = probs.size();
    if (top_p < 1.f) {
        double mass = 0;
        for (size_t i = 0; i < probs.size(); ++i) {
            mass += probs[i] / total;
            if (mass >= top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    ids.resize(keep);
    probs.resize(keep);
    const double kept = std::accumulate(probs.begin(), probs.end(), 0.0);
    for (double& p : probs) p /= kept;
}

int32_t sample_row(const float* logits, int64_t vocab, float temperature, float top_p, int top_k, float uniform) {
    if (temperature <= 0.f) return argmax_row(logits, vocab);
    std::vector<int32_t> ids;
    std::vector<double> probs;
    sampling_distribution(logits, vocab, temperature, top_p, top_k, ids, probs);
    double draw = double(uniform);
    for (size_t i = 0; i < ids.size(); ++i) {
        draw -= probs[i];
        if (draw < 0) return ids[i];
    }
    return ids.back();
}

void argmax(const Tensor& logits, const Tensor& ids) {
    const char* op = "argmax";
    check_dtype(op, "logits", logits, {DType::f32});
    check_rank(op, "logits", logits, 2);
    check_dtype(op, "ids", ids, {DType::i32});
    check_shape(op, "ids", ids, {logits.dim(0)});
    for (int64_t r = 0; r < logits.dim(0); ++r)
        ids.as<int32_t>()[r] = argmax_row(logits.as<float>() + r * logits.dim(1), logits.dim(1));
}

void sample(const Tensor& logits, const Tensor& temperature, const Tensor& top_p, const Tensor& top_k,
            const Tensor& uniform, const Tensor& ids) {
    const char* op = "sample";
    check_dtype(op, "logits", logits, {DType::f32});
    check_rank(op, "logits", logits, 2);
    const int64_t rows = logits.dim(0), vocab = logits.dim(1);
    check_dtype(op, "temperature", temperature, {DType::f32});
    check_shape(op, "temperature", temperature, {rows});
    check_dtype(op, "top_p", top_p, {DType::f32});
    check_shape(op, "top_p", top_p, {rows});
    check_dtype(op, "top_k", top_k, {DType::i32});
    check_shape(op, "top_k", top_k, {rows});
    check_dtype(op, "uniform", uniform, {DType::f32});
    check_shape(op, "uniform", uniform, {rows});
    check_dtype(op, "ids", ids, {DType::i32});
    check_shape(op, "ids", ids, {rows});
#pragma omp parallel for schedule(dynamic) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r)
        ids.as<int32_t>()[r] = sample_row(logits.as<float>() + r * vocab, vocab, temperature.as<float>()[r],
                                          top_p.as<float>()[r], top_k.as<int32_t>()[r], uniform.as<float>()[r]);
}

void convert(const Tensor& src, const Tensor& dst) {
    const char* op = "convert";
    if (src.numel() != dst.numel())
        fail("{}: src {} and dst {} differ in element count", op, src.shape_string(), dst.shape_string());
    check_dtype(op, "dst", dst, {DType::f32, DType::bf16, DType::f16});
    if (src.dtype == dst.dtype) {
        std::memcpy(dst.data, src.data, src.nbytes());
        return;
    }
    std::vector<float> row(static_cast<size_t>(src.cols()));
    for (int64_t r = 0; r < src.rows(); ++r) {
        convert_to_f32(src.dtype, static_cast<const char*>(src.data) + size_t(r) * src.row_bytes(), row.data(), src.cols());
        convert_from_f32(row.data(), dst.dtype, static_cast<char*>(dst.data) + size_t(r) * dst.row_bytes(), dst.cols());
    }
}

}  // namespace xinfer::cpu
