// Prompt-lookup drafts and --speculative-config parsing.
#include "spec/drafter.h"

#include <gtest/gtest.h>

namespace xinfer {
namespace {

std::vector<int32_t> propose_one(Drafter& drafter, const std::vector<int32_t>& tokens, int max_drafts) {
    const DraftRequest request{0, tokens, max_drafts};
    return drafter.propose(std::span(&request, 1)).at(0);
}

TEST(NgramDrafter, CopiesWhatFollowedTheLongestEarlierMatch) {
    auto drafter = make_ngram_drafter(parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":3})"));
    EXPECT_STREQ(drafter->method(), "ngram");
    // Suffix [7, 8] occurred at 1..2, followed by 9, 10, 11.
    EXPECT_EQ(propose_one(*drafter, {5, 7, 8, 9, 10, 11, 12, 7, 8}, 3), (std::vector<int32_t>{9, 10, 11}));
    // max_drafts bounds the proposal.
    EXPECT_EQ(propose_one(*drafter, {5, 7, 8, 9, 10, 11, 12, 7, 8}, 2), (std::vector<int32_t>{9, 10}));
    // The longer match wins over a more recent shorter one: [1, 2, 3] → 4, not [3] → 9.
    EXPECT_EQ(propose_one(*drafter, {1, 2, 3, 4, 3, 9, 1, 2, 3}, 1), (std::vector<int32_t>{4}));
    // No earlier occurrence of the last token: nothing to propose.
    EXPECT_TRUE(propose_one(*drafter, {1, 2, 3, 4}, 3).empty());
}

TEST(NgramDrafter, PrefersAFullContinuationInsideRepeats) {
    auto drafter = make_ngram_drafter(parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":4})"));
    // Inside a run the most recent match is followed by one token; an earlier one by four.
    EXPECT_EQ(propose_one(*drafter, {3, 6, 6, 6, 6, 6, 6, 6, 6, 6}, 4), (std::vector<int32_t>{6, 6, 6, 6}));
}

TEST(NgramDrafter, RespectsLookupBounds) {
    // prompt_lookup_min 2: a single repeated token is not enough.
    auto drafter = make_ngram_drafter(
        parse_speculative_config(R"({"method":"ngram","prompt_lookup_min":2,"prompt_lookup_max":3})"));
    EXPECT_EQ(drafter->num_speculative_tokens(), 4);  // the default
    EXPECT_TRUE(propose_one(*drafter, {1, 5, 2, 5}, 3).empty());
    EXPECT_EQ(propose_one(*drafter, {1, 5, 2, 1, 5}, 3), (std::vector<int32_t>{2, 1, 5}));
}

TEST(SpeculativeConfig, ParsesAndRejectsClearly) {
    EXPECT_FALSE(parse_speculative_config("").enabled());
    EXPECT_EQ(parse_speculative_config(R"({"method":"mtp"})").num_speculative_tokens, 3);
    EXPECT_EQ(parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":7})").num_speculative_tokens, 7);
    auto expect_error = [](const std::string& json, const std::string& needle) {
        try {
            parse_speculative_config(json);
            ADD_FAILURE() << "no error for " << json;
        } catch (const std::exception& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    expect_error(R"({"method":"eagle9"})", "unknown method");
    expect_error(R"({"method":"ngram","num_speculative_tokens":40})", "1..31");
    expect_error(R"({"method":"ngram","num_speculative_tokens":"4"})", "must be an integer");
    expect_error(R"({"method":"ngram","colour":"red"})", "unknown field \"colour\"");
    expect_error(R"({"method":"dflash"})", "needs \"model\"");
    expect_error(R"({"method":"ngram","model":"/x"})", "only for dflash");
    expect_error(R"({"method":"ngram","prompt_lookup_min":3,"prompt_lookup_max":2})", "prompt_lookup_min");
    expect_error("{oops", "not valid JSON");
}

}  // namespace
}  // namespace xinfer
