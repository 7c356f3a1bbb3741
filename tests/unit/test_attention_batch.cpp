// check_tokens_are_newest_keys: the promise backend_abi.h makes to backends about an attention
// batch (each sequence's tokens are its newest keys, so KV_STORE never rewrites an older one that
// a backend may already be reading) holds for chunked prefill, decode and verification batches,
// and a batch that would break it is refused naming the sequence and token.
#include "backend/backend.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace xinfer {
namespace {

TEST(AttentionBatch, TokensMustBeTheNewestKeys) {
    // A 3-token prefill chunk at 4..6 (kv_len 7), a decode token at 9 (kv_len 10), a 4-token
    // verification chain at 20..23 (kv_len 24).
    EXPECT_NO_THROW(check_tokens_are_newest_keys({0, 3, 4, 8}, {7, 10, 24}, {4, 5, 6, 9, 20, 21, 22, 23}));
    // A token behind the end of its sequence (e.g. context rows stored in the same forward as the
    // attention that reads the keys before them).
    try {
        check_tokens_are_newest_keys({0, 1, 3}, {10, 6}, {9, 3, 5});
        FAIL() << "accepted a token that is not among its sequence's newest keys";
    } catch (const std::exception& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("sequence 1 token 0 is at position 3, not 4"), std::string::npos) << what;
    }
    // Tokens out of order, and inconsistent sizes.
    EXPECT_THROW(check_tokens_are_newest_keys({0, 2}, {8}, {7, 6}), std::exception);
    EXPECT_THROW(check_tokens_are_newest_keys({0, 2}, {8}, {6}), std::exception);
}

}  // namespace
}  // namespace xinfer
