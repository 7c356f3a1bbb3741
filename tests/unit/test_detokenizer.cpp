// Detokenizer: byte-level BPE vocabularies back to bytes, added and special tokens, characters
// split across tokens, UTF-8 repair, and errors that name the file and the token.
#include "byte_level_tokenizer.h"
#include "safetensors_test_writer.h"
#include "tokenizer/detokenizer.h"

#include <gtest/gtest.h>

namespace xinfer::test {
namespace {

constexpr int64_t kVocab = 600;

void expect_load_error(const std::filesystem::path& path, const std::vector<std::string>& parts) {
    try {
        Detokenizer::load(path);
        FAIL() << "loading " << path << " did not fail";
    } catch (const std::exception& e) {
        for (const std::string& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
}

void write(const std::filesystem::path& path, const nlohmann::json& doc) { std::ofstream(path) << doc.dump(); }

TEST(Detokenizer, BytesAddedTokensAndSpecials) {
    TempDir dir;
    const Detokenizer d = Detokenizer::load(write_byte_level_tokenizer(dir.path(), kVocab));
    EXPECT_EQ(d.size(), kVocab);
    for (int id = 0; id < 256; ++id) EXPECT_EQ(d.token_bytes(id), std::string(1, char(id))) << id;
    EXPECT_EQ(d.token_bytes(300), test_token_bytes(300, kVocab));
    // "é" is C3 A9: two single-byte tokens make one character only together.
    EXPECT_EQ(d.decode({'c', 'a', 'f', 0xc3, 0xa9}), "caf\xc3\xa9");
    EXPECT_EQ(to_valid_utf8(d.decode({'c', 'a', 'f', 0xc3})), "caf\xEF\xBF\xBD");
    // Special tokens are left out unless asked for; ids past the tokenizer decode to nothing.
    EXPECT_EQ(d.decode({'a', int32_t(kVocab - 1), 'b'}), "ab");
    EXPECT_EQ(d.decode({'a', int32_t(kVocab - 1)}, /*skip_special=*/false), "a<|endoftext|>");
    EXPECT_EQ(d.token_bytes(int32_t(kVocab + 5)), "");
    EXPECT_EQ(d.token_bytes(-1), "");
}

TEST(Detokenizer, AddedNonSpecialTokensAreKeptAndDecoderSequencesAccepted) {
    TempDir dir;
    write(dir / "tokenizer.json",
          {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"\xc4\xa0" "b", 1}}}}},  // "Ġb" = " b"
           {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "Replace"}}, {{"type", "ByteLevel"}}}}}},
           {"added_tokens", {{{"id", 2}, {"content", "<think>"}, {"special", false}}}}});
    const Detokenizer d = Detokenizer::load(dir / "tokenizer.json");
    EXPECT_EQ(d.decode({0, 1, 2, 0}), "a b<think>a");
}

// GPT-2's table spelled out (independent of the test writer's copy of it): the 68 bytes that are
// not printable become U+0100 onwards in byte order: 0x00-0x20 → U+0100-U+0120 ("Ġ" is a space,
// "Ċ" a newline), 0x7F-0xA0 → U+0121-U+0142, 0xAD → U+0143.
TEST(Detokenizer, Gpt2ByteTable) {
    TempDir dir;
    write(dir / "tokenizer.json", {{"model",
                                    {{"type", "BPE"},
                                     {"vocab",
                                      {{"\u0120the\u010a", 0},
                                       {"\u0100", 1},
                                       {"\u0121", 2},
                                       {"\u0142", 3},
                                       {"\u0143", 4},
                                       {"~\u00a1\u00ac\u00ae\u00ff", 5}}}}},
                                   {"decoder", {{"type", "ByteLevel"}}}});
    const Detokenizer d = Detokenizer::load(dir / "tokenizer.json");
    EXPECT_EQ(d.token_bytes(0), " the\n");
    EXPECT_EQ(d.token_bytes(1), std::string(1, '\0'));
    EXPECT_EQ(d.token_bytes(2), "\x7f");
    EXPECT_EQ(d.token_bytes(3), "\xa0");
    EXPECT_EQ(d.token_bytes(4), "\xad");
    EXPECT_EQ(d.token_bytes(5), "~\xa1\xac\xae\xff");  // printable bytes spell themselves
}

TEST(Detokenizer, RepairsInvalidUtf8) {
    EXPECT_EQ(to_valid_utf8("plain \xe4\xb8\xad"), "plain \xe4\xb8\xad");
    EXPECT_EQ(to_valid_utf8("\xc0\xaf"), "\xEF\xBF\xBD\xEF\xBF\xBD");      // overlong
    EXPECT_EQ(to_valid_utf8("\xed\xa0\x80x"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBDx");  // surrogate
    EXPECT_EQ(to_valid_utf8("\xe4\xb8"), "\xEF\xBF\xBD\xEF\xBF\xBD");      // cut short
    EXPECT_EQ(to_valid_utf8(""), "");
}

TEST(Detokenizer, ErrorsNameTheFileAndTheToken) {
    TempDir dir;
    const std::filesystem::path path = dir / "tokenizer.json";
    expect_load_error(path, {path.string(), "cannot open"});
    std::ofstream(path) << "{ not json";
    expect_load_error(path, {path.string(), "not valid JSON"});
    // Unigram vocabularies are [piece, score] lists, not token → id maps.
    write(path, {{"model", {{"type", "Unigram"}, {"vocab", nlohmann::json::array({nlohmann::json::array({"a", 0.0})})}}},
                 {"decoder", {{"type", "ByteLevel"}}}});
    expect_load_error(path, {path.string(), "\"vocab\" map"});
    write(path, {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}}}}}, {"decoder", {{"type", "Metaspace"}}}});
    expect_load_error(path, {path.string(), "Metaspace", "ByteLevel"});
    write(path, {{"model", {{"type", "BPE"}, {"vocab", {{"\xe4\xb8\xad", 7}}}}}, {"decoder", {{"type", "ByteLevel"}}}});
    expect_load_error(path, {path.string(), "\xe4\xb8\xad", "id 7", "byte-level"});
    write(path, {{"model", {{"type", "BPE"}, {"vocab", {{"a", "zero"}}}}}, {"decoder", {{"type", "ByteLevel"}}}});
    expect_load_error(path, {path.string(), "\"a\"", "non-integer"});
    write(path, {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}}}}},
                 {"decoder", {{"type", "ByteLevel"}}},
                 {"added_tokens", {{{"content", "<x>"}}}}});
    expect_load_error(path, {path.string(), "<x>", "\"id\""});
}

}  // namespace
}  // namespace xinfer::test
