// Verification is a pure function (src/spec/verify.h): greedy acceptance rules, and rejection
// sampling whose emitted tokens must be distributed exactly as plain sampling from the target.
#include "sample/sampler.h"
#include "spec/verify.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>
#include <vector>

namespace xinfer {
namespace {

constexpr int64_t kVocab = 6;

// Rows of logits, one per chain position, with a clear argmax at `tops[i]`.
std::vector<float> rows_with_argmax(const std::vector<int32_t>& tops) {
    std::vector<float> logits(tops.size() * kVocab);
    for (size_t i = 0; i < tops.size(); ++i)
        for (int64_t v = 0; v < kVocab; ++v) logits[i * kVocab + size_t(v)] = v == tops[i] ? 5.f : float(v) * 0.1f;
    return logits;
}

TEST(VerifyGreedy, AcceptsTheMatchingPrefixThenTheTargetsToken) {
    const std::vector<float> logits = rows_with_argmax({2, 3, 4, 5});  // target wants 2, 3, 4 then 5
    EXPECT_EQ(verify_greedy(logits, kVocab, std::vector<int32_t>{2, 3, 4}).accepted, 3);
    EXPECT_EQ(verify_greedy(logits, kVocab, std::vector<int32_t>{2, 3, 4}).next_token, 5);  // the bonus
    const Verdict first_wrong = verify_greedy(logits, kVocab, std::vector<int32_t>{1, 3, 4});
    EXPECT_EQ(first_wrong.accepted, 0);
    EXPECT_EQ(first_wrong.next_token, 2);  // the correction
    const Verdict middle_wrong = verify_greedy(logits, kVocab, std::vector<int32_t>{2, 0, 4});
    EXPECT_EQ(middle_wrong.accepted, 1);
    EXPECT_EQ(middle_wrong.next_token, 3);
    // A later match after a mismatch does not count.
    EXPECT_EQ(verify_greedy(logits, kVocab, std::vector<int32_t>{2, 0, 4}).accepted, 1);
}

TEST(VerifyGreedy, NoDraftsIsPlainArgmax) {
    const std::vector<float> logits = rows_with_argmax({4});
    const Verdict v = verify_greedy(logits, kVocab, {});
    EXPECT_EQ(v.accepted, 0);
    EXPECT_EQ(v.next_token, 4);
}

TEST(VerifyGreedy, RejectsMisshapenLogits) {
    const std::vector<float> logits = rows_with_argmax({1, 2});
    EXPECT_THROW(verify_greedy(logits, kVocab, std::vector<int32_t>{1, 2}), std::exception);  // needs 3 rows
}

TEST(VerifyDrafts, TemperatureZeroIsGreedy) {
    const std::vector<float> logits = rows_with_argmax({2, 3, 4});
    Sampler sampler(SamplingParams{});
    const Verdict v = verify_drafts(logits, kVocab, std::vector<int32_t>{2, 1}, sampler);
    EXPECT_EQ(v.accepted, 1);
    EXPECT_EQ(v.next_token, 3);
}

// Pearson chi-square of observed counts against expected probabilities (cells with p > 0).
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& probs) {
    int64_t n = 0;
    for (int64_t c : counts) n += c;
    if (n == 0) return 0;  // nothing observed (a draft the target never accepts)
    double chi2 = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
        if (probs[i] <= 0) {
            if (counts[i] > 0) return INFINITY;  // a token that must never appear did
            continue;
        }
        const double expected = probs[i] * double(n);
        chi2 += (double(counts[i]) - expected) * (double(counts[i]) - expected) / expected;
    }
    return chi2;
}

std::vector<double> target_probs(const std::vector<float>& logits, size_t row, const SamplingParams& params) {
    Sampler sampler(params);
    std::vector<int32_t> ids;
    std::vector<double> p;
    sampler.distribution(std::span(logits).subspan(row * kVocab, kVocab), ids, p);
    std::vector<double> probs(kVocab, 0.0);
    for (size_t i = 0; i < ids.size(); ++i) probs[size_t(ids[i])] = p[i];
    return probs;
}

// Rejection sampling must reproduce the target distribution at every chain position: the first
// emitted token ~ p0; given it equals d1 (only acceptance gives d1: the residual excludes it),
// the second ~ p1. 60,000 chains per case; the critical
// chi-square value for 5 degrees of freedom at p = 1e-4 is 25.7. The seeds are fixed, so the
// test is deterministic. A broken rule (resampling rejections from p itself rather than the
// residual) is shown to fail the same statistic by a wide margin.
void check_distribution(const SamplingParams& base, const std::vector<int32_t>& drafts) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> logit(-2.f, 2.f);
    std::vector<float> logits(3 * kVocab);
    for (float& l : logits) l = logit(rng);
    const std::vector<double> p0 = target_probs(logits, 0, base), p1 = target_probs(logits, 1, base);

    std::vector<int64_t> first(kVocab, 0), second(kVocab, 0);
    const int n = 60000;
    for (int s = 0; s < n; ++s) {
        SamplingParams params = base;
        params.seed = uint64_t(s) * 7919 + 1;
        Sampler sampler(params);
        const Verdict v = verify_drafts(logits, kVocab, drafts, sampler);
        const int32_t t0 = v.accepted >= 1 ? drafts[0] : v.next_token;
        ++first[size_t(t0)];
        if (t0 == drafts[0]) ++second[size_t(v.accepted >= 2 ? drafts[1] : v.next_token)];
    }
    EXPECT_LT(chi_square(first, p0), 25.7) << "first emitted token is not distributed as the target";
    if (p0[size_t(drafts[0])] > 0.05) {
        EXPECT_GT(first[size_t(drafts[0])], 1000) << "too few chains reach position 2";
    }
    EXPECT_LT(chi_square(second, p1), 25.7) << "second emitted token is not distributed as the target";

    // The broken rule's distribution of the first token: P(d) = p(d) + (1 - p(d))·p(d).
    std::vector<double> broken = p0;
    const size_t d = size_t(drafts[0]);
    for (size_t i = 0; i < broken.size(); ++i) broken[i] = (1 - p0[d]) * p0[i] + (i == d ? p0[d] : 0.0);
    if (p0[d] > 0.05 && p0[d] < 0.95) {
        EXPECT_GT(chi_square(first, broken), 100.0) << "the statistic cannot tell";
    }
}

TEST(VerifyDrafts, RejectionSamplingMatchesTargetDistribution) {
    SamplingParams params;
    params.temperature = 0.7f;
    check_distribution(params, {1, 4});
    check_distribution(params, {5, 0});
}

TEST(VerifyDrafts, RejectionSamplingHonoursTopKAndTopP) {
    SamplingParams params;
    params.temperature = 0.7f;
    params.top_k = 4;
    params.top_p = 0.9f;
    check_distribution(params, {1, 4});
    check_distribution(params, {2, 3});
}

}  // namespace
}  // namespace xinfer
