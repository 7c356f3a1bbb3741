// A request's text as the engine hands it out: stop strings cut it, and while it runs it holds
// back an unfinished character and the bytes a stop string could still begin in.
#include "byte_level_tokenizer.h"
#include "runtime/request.h"
#include "unit/safetensors_test_writer.h"

#include <gtest/gtest.h>

namespace xinfer::test {
namespace {

constexpr int64_t kVocab = 300;

class RequestTextTest : public ::testing::Test {
protected:
    void SetUp() override { detokenizer_ = Detokenizer::load(write_byte_level_tokenizer(dir_.path(), kVocab)); }
    Request make(std::vector<std::string> stop, int max_tokens = 100) {
        SamplingParams sampling;
        sampling.stop = std::move(stop);
        Request r(1, {5}, sampling, max_tokens);
        r.detokenizer = &detokenizer_;
        return r;
    }
    TempDir dir_;
    Detokenizer detokenizer_;
};

TEST_F(RequestTextTest, HoldsBackWhatAStopStringOrTheNextTokenCouldChange) {
    Request r = make({"XYZ"});  // a stop string of 3 bytes: the last 2 bytes wait
    std::string handed;
    const auto feed = [&](int32_t token) {
        EXPECT_TRUE(r.append_generated(token, 0));
        const std::string delta = r.take_text();
        handed += delta;
        return delta;
    };
    EXPECT_EQ(feed('a'), "");
    EXPECT_EQ(feed('b'), "");
    EXPECT_EQ(feed('c'), "a");
    EXPECT_EQ(feed(0xc3), "b");   // "abc\xc3": 2 bytes held, and nothing of a cut character
    EXPECT_EQ(feed(0xa9), "c");   // "abcé": é is whole now, but within the last 2 bytes
    EXPECT_EQ(feed('d'), "");     // "abcéd": é's last byte is held, so é waits whole
    EXPECT_EQ(feed('e'), "\xc3\xa9");
    // X then Y: still a possible start of XYZ, held; then a Z completes it and ends the request.
    EXPECT_EQ(feed('X'), "d");
    EXPECT_EQ(feed('Y'), "e");
    EXPECT_FALSE(r.append_generated('Z', 0));
    EXPECT_EQ(r.finish, FinishReason::stop);
    handed += r.take_text();
    EXPECT_EQ(handed, "abc\xc3\xa9" "de");
    EXPECT_EQ(r.take_text(), "");
}

TEST_F(RequestTextTest, AFinishedRequestHandsOutTheRestRepaired) {
    Request r = make({}, /*max_tokens=*/3);
    EXPECT_TRUE(r.append_generated('o', 0));
    EXPECT_EQ(r.take_text(), "o");  // no stop strings: nothing held but cut characters
    EXPECT_TRUE(r.append_generated(0xe4, 0));
    EXPECT_EQ(r.take_text(), "");
    EXPECT_FALSE(r.append_generated(0xb8, 0));  // max_tokens, inside a 3-byte character
    EXPECT_EQ(r.finish, FinishReason::length);
    EXPECT_EQ(r.take_text(), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(WholeCharacters, EndBacksOffOverACutCharacter) {
    EXPECT_EQ(whole_characters_end("abc", 3), 3u);
    EXPECT_EQ(whole_characters_end("ab\xc3", 3), 2u);
    EXPECT_EQ(whole_characters_end("ab\xc3\xa9", 4), 4u);
    EXPECT_EQ(whole_characters_end("ab\xc3\xa9", 3), 2u);
    EXPECT_EQ(whole_characters_end("\xe4\xb8", 2), 0u);
    EXPECT_EQ(whole_characters_end("a\xf0\x9f\x98", 4), 1u);
    EXPECT_EQ(whole_characters_end("a\xf0\x9f\x98\x80", 5), 5u);
    EXPECT_EQ(whole_characters_end("\x80\x80\x80\x80", 4), 4u);  // no lead byte: nothing to wait for
    EXPECT_EQ(whole_characters_end("", 0), 0u);
}

}  // namespace
}  // namespace xinfer::test
