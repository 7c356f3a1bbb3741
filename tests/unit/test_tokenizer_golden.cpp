// The tokenizer against Hugging Face `tokenizers`: tests/fixtures/tokenizer_bpe holds a byte-level
// BPE tokenizer.json in the Qwen2/Qwen3/MiMo layout (NFC, the Qwen2 split regex, special and added
// tokens) trained and saved by `tokenizers`, and the ids it encodes a set of tricky strings to, with
// their decoded text (scripts/gen_tokenizer_fixture.py, run on the GPU machine). BpeEncoder must
// give the same ids and Detokenizer the same text, case by case.
#include "tokenizer/bpe_encoder.h"
#include "tokenizer/detokenizer.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace xinfer::test {
namespace {

const std::filesystem::path kDir = std::filesystem::path(XINFER_FIXTURES_DIR) / "tokenizer_bpe";

nlohmann::json golden_cases() {
    std::ifstream in(kDir / "cases.json");
    const nlohmann::json doc = nlohmann::json::parse(in);
    return doc.at("cases");
}

TEST(TokenizerGolden, DecodesAsHuggingFace) {
    const Detokenizer d = Detokenizer::load(kDir / "tokenizer.json");
    const nlohmann::json cases = golden_cases();
    ASSERT_GE(cases.size(), 10u);
    for (const auto& c : cases) {
        const auto ids = c.at("ids").get<std::vector<int32_t>>();
        EXPECT_EQ(to_valid_utf8(d.decode(ids)), c.at("decoded").get<std::string>()) << c.at("text");
    }
}

#if XINFER_HAS_ICU
TEST(TokenizerGolden, EncodesAsHuggingFace) {
    const BpeEncoder e = BpeEncoder::load(kDir / "tokenizer.json");
    std::string why_not;
    ASSERT_TRUE(e.can_encode(&why_not)) << why_not;
    for (const auto& c : golden_cases()) {
        const std::string text = c.at("text");
        EXPECT_EQ(e.encode(text), c.at("ids").get<std::vector<int32_t>>()) << "text: " << text;
    }
}
#endif

}  // namespace
}  // namespace xinfer::test
