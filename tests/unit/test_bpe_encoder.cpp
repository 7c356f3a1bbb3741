// BpeEncoder on a hand-made Qwen2-layout tokenizer.json: added tokens cut out first, NFC, the
// Qwen2 split regex (contractions, single digits, whitespace runs, newlines), byte-level
// spelling and BPE merges by rank; what it cannot encode is said, not guessed.
// (test_tokenizer_golden.cpp compares with Hugging Face tokenizers on a generated fixture.)
#include "byte_level_tokenizer.h"
#include "safetensors_test_writer.h"
#include "tokenizer/bpe_encoder.h"
#include "tokenizer/detokenizer.h"

#include <gtest/gtest.h>

namespace xinfer::test {
namespace {

using json = nlohmann::json;

constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Ids 0-255: the single bytes (id = byte); then merged tokens, in merge rank order.
json qwen2_layout(json normalizer = {{"type", "NFC"}}) {
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) vocab[byte_level_char(b)] = b;
    const std::vector<std::pair<std::string, std::string>> merges = {
        {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"\u0120", "w"},
        {"o", "r"}, {"\u0120w", "or"}, {"l", "d"}, {"\u0120wor", "ld"}};
    json merge_list = json::array();
    int id = 256;
    for (const auto& [a, b] : merges) {
        vocab[a + b] = id++;
        merge_list.push_back({a, b});
    }
    return {{"normalizer", normalizer},
            {"pre_tokenizer",
             {{"type", "Sequence"},
              {"pretokenizers",
               {{{"type", "Split"}, {"pattern", {{"Regex", kQwen2Pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
                {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
            {"decoder", {{"type", "ByteLevel"}}},
            {"added_tokens",
             {{{"id", 265}, {"content", "<|im_end|>"}, {"special", true}},
              {{"id", 266}, {"content", "<think>"}, {"special", false}}}},
            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
}

std::filesystem::path write(const TempDir& dir, const json& doc) {
    const std::filesystem::path path = dir / "tokenizer.json";
    std::ofstream(path) << doc.dump();
    return path;
}

#if XINFER_HAS_ICU

TEST(BpeEncoder, MergesByRankAfterTheQwen2Split) {
    TempDir dir;
    const std::filesystem::path path = write(dir, qwen2_layout());
    const BpeEncoder e = BpeEncoder::load(path);
    ASSERT_TRUE(e.can_encode());
    using ids = std::vector<int32_t>;
    EXPECT_EQ(e.encode("hello world"), (ids{259, 264}));  // "hello", "Ġworld"
    // Added tokens are cut out first; what is between is encoded on its own ("world" has no Ġ).
    EXPECT_EQ(e.encode("hello<|im_end|>world<think>"), (ids{259, 265, 'w', 261, 263, 266}));
    // Contractions split off, case-insensitively; digits one by one.
    EXPECT_EQ(e.encode("it's IT'S"), (ids{'i', 't', '\'', 's', ' ', 'I', 'T', '\'', 'S'}));
    EXPECT_EQ(e.encode("x 12345"), (ids{'x', ' ', '1', '2', '3', '4', '5'}));
    // Whitespace: a run before a word leaves its last space to the word; newlines go together.
    EXPECT_EQ(e.encode("a  b"), (ids{'a', ' ', ' ', 'b'}));
    EXPECT_EQ(e.encode("x\n\ny"), (ids{'x', '\n', '\n', 'y'}));
    // NFC: e + combining acute is é (C3 A9), as the precomposed form.
    EXPECT_EQ(e.encode("e\xcc\x81"), (ids{0xc3, 0xa9}));
    EXPECT_EQ(e.encode("\xc3\xa9"), (ids{0xc3, 0xa9}));
    EXPECT_EQ(e.encode("\xf0\x9f\x98\x80!"), (ids{0xf0, 0x9f, 0x98, 0x80, '!'}));
    EXPECT_EQ(e.encode(""), ids{});
    EXPECT_THROW(e.encode("bad \xff byte"), std::exception);  // not UTF-8: an error, not garbage
    // Decoding gives the (normalized) text back.
    const Detokenizer d = Detokenizer::load(path);
    for (const std::string text : {"hello world", "it's IT'S x 12345", "a  b\n\n\ty", "caf\xc3\xa9 \xf0\x9f\x98\x80"})
        EXPECT_EQ(d.decode(e.encode(text)), text);
}

TEST(BpeEncoder, WithoutNormalizerCombiningMarksStay) {
    TempDir dir;
    const BpeEncoder e = BpeEncoder::load(write(dir, qwen2_layout(nullptr)));
    EXPECT_EQ(e.encode("e\xcc\x81"), (std::vector<int32_t>{'e', 0xcc, 0x81}));
}

#endif  // XINFER_HAS_ICU

TEST(BpeEncoder, SaysWhatItCannotEncode) {
    TempDir dir;
    const auto reason = [&](const json& doc) {
        const std::filesystem::path path = write(dir, doc);
        const BpeEncoder e = BpeEncoder::load(path);
        std::string why;
        EXPECT_FALSE(e.can_encode(&why));
        try {
            e.encode("x");
            ADD_FAILURE() << "encode did not fail";
        } catch (const std::exception& ex) {
            EXPECT_NE(std::string(ex.what()).find(path.string()), std::string::npos) << ex.what();
        }
        return why;
    };
#if XINFER_HAS_ICU
    EXPECT_NE(reason(qwen2_layout({{"type", "Lowercase"}})).find("Lowercase"), std::string::npos);
    json metaspace = qwen2_layout();
    metaspace["pre_tokenizer"] = {{"type", "Metaspace"}};
    EXPECT_NE(reason(metaspace).find("Metaspace"), std::string::npos);
    json stripped = qwen2_layout();
    stripped["added_tokens"][0]["lstrip"] = true;
    EXPECT_NE(reason(stripped).find("lstrip"), std::string::npos);
    // Split, then ByteLevel's own regex on top: two regex splits.
    json two_splits = qwen2_layout();
    two_splits["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = true;
    EXPECT_NE(reason(two_splits).find("two regex splits"), std::string::npos);
    json dropout = qwen2_layout();
    dropout["model"]["dropout"] = 0.1;
    EXPECT_NE(reason(dropout).find("dropout"), std::string::npos);
    json suffix = qwen2_layout();
    suffix["model"]["end_of_word_suffix"] = "</w>";
    EXPECT_NE(reason(suffix).find("end_of_word_suffix"), std::string::npos);
#else
    EXPECT_NE(reason(qwen2_layout()).find("libicu-dev"), std::string::npos);
#endif
    // Not a BPE tokenizer at all: a load error naming the file.
    const std::filesystem::path path = write(dir, {{"model", {{"type", "WordPiece"}}}});
    EXPECT_THROW(BpeEncoder::load(path), std::exception);
}

}  // namespace
}  // namespace xinfer::test
