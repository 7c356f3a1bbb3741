#include "tokenizer/tokenizer_json.h"

#include "core/status.h"

#include <array>
#include <fstream>
#include <sstream>

namespace xinfer {

nlohmann::json read_tokenizer_json(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("{}: cannot open the tokenizer", path.string());
    std::stringstream buffer;
    buffer << in.rdbuf();
    try {
        return nlohmann::json::parse(buffer.str());
    } catch (const nlohmann::json::exception& e) {
        fail("{}: not valid JSON: {}", path.string(), e.what());
    }
}

const std::string& byte_level_spelling(uint8_t byte) {
    static const std::array<std::string, 256> table = [] {
        std::array<std::string, 256> t;
        int next = 256;
        for (int b = 0; b < 256; ++b) {
            const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
            const int cp = printable ? b : next++;
            if (cp < 0x80) t[size_t(b)] = std::string(1, char(cp));
            else t[size_t(b)] = {char(0xc0 | (cp >> 6)), char(0x80 | (cp & 0x3f))};
        }
        return t;
    }();
    return table[byte];
}

}  // namespace xinfer
