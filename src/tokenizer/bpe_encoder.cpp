#include "tokenizer/bpe_encoder.h"

#include "core/status.h"
#include "tokenizer/tokenizer_json.h"

#include <algorithm>
#include <climits>

#if XINFER_HAS_ICU
#include <unicode/unorm2.h>
#include <unicode/uregex.h>
#include <unicode/ustring.h>
#endif

namespace xinfer {
namespace {

using json = nlohmann::json;

// GPT-2's pre-tokenizer regex, which ByteLevel applies itself when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Oniguruma (what tokenizers runs) reads \s and \S as Unicode White_Space; ICU's \s leaves out
// U+000B and U+0085. Spelling the property out makes ICU agree.
std::string onig_to_icu(const std::string& pattern) {
    std::string out;
    for (size_t i = 0; i < pattern.size(); ++i) {
        if (pattern[i] == '\\' && i + 1 < pattern.size()) {
            const char next = pattern[++i];
            if (next == 's') out += "\\p{White_Space}";
            else if (next == 'S') out += "\\P{White_Space}";
            else out += {'\\', next};
        } else {
            out.push_back(pattern[i]);
        }
    }
    return out;
}

// The pieces of a pre-tokenizer we run, or why not (into `why`).
bool read_pre_tokenizer(const json& p, std::string& pattern, std::string& why) {
    if (!p.is_object()) {
        why = "a tokenizer without a pre-tokenizer";
        return false;
    }
    const std::string type = p.value("type", "");
    if (type == "ByteLevel") {
        if (p.value("add_prefix_space", false)) {
            why = "a ByteLevel pre-tokenizer with add_prefix_space";
            return false;
        }
        if (p.value("use_regex", true)) {
            if (!pattern.empty()) {
                why = "two regex splits in one pre-tokenizer";
                return false;
            }
            pattern = kGpt2Pattern;
        }
        return true;
    }
    if (type == "Split") {
        const std::string behavior = p.value("behavior", "");
        if (behavior != "Isolated" || p.value("invert", false) || !p.contains("pattern") ||
            !p["pattern"].contains("Regex")) {
            why = "a Split pre-tokenizer other than an Isolated regex split: " + p.dump();
            return false;
        }
        if (!pattern.empty()) {
            why = "two regex splits in one pre-tokenizer";
            return false;
        }
        pattern = p["pattern"]["Regex"].get<std::string>();
        return true;
    }
    if (type == "Sequence" && p.contains("pretokenizers")) {
        bool byte_level = false;
        for (const json& step : p["pretokenizers"]) {
            if (!read_pre_tokenizer(step, pattern, why)) return false;
            byte_level |= step.value("type", "") == "ByteLevel";
        }
        if (!byte_level) why = "a pre-tokenizer sequence without ByteLevel";
        return byte_level;
    }
    why = "the pre-tokenizer " + (type.empty() ? p.dump() : type);
    return false;
}

}  // namespace

#if XINFER_HAS_ICU
struct BpeEncoder::Regex {
    URegularExpression* compiled = nullptr;
    ~Regex() {
        if (compiled) uregex_close(compiled);
    }
};

namespace {

std::u16string to_utf16(const std::string& s) {
    UErrorCode status = U_ZERO_ERROR;
    int32_t length = 0;
    u_strFromUTF8(nullptr, 0, &length, s.data(), int32_t(s.size()), &status);
    std::u16string out(size_t(length), u'\0');
    status = U_ZERO_ERROR;
    u_strFromUTF8(out.data(), length, nullptr, s.data(), int32_t(s.size()), &status);
    if (U_FAILURE(status)) fail("tokenizer: the text is not valid UTF-8 ({})", u_errorName(status));
    return out;
}

std::string to_utf8(const char16_t* s, int32_t n) {
    UErrorCode status = U_ZERO_ERROR;
    int32_t length = 0;
    u_strToUTF8(nullptr, 0, &length, s, n, &status);
    std::string out(size_t(length), '\0');
    status = U_ZERO_ERROR;
    u_strToUTF8(out.data(), length, nullptr, s, n, &status);
    return out;
}

std::u16string nfc(const std::u16string& s) {
    UErrorCode status = U_ZERO_ERROR;
    const UNormalizer2* normalizer = unorm2_getNFCInstance(&status);
    std::u16string out(s.size() * 3 + 16, u'\0');
    const int32_t n =
        unorm2_normalize(normalizer, s.data(), int32_t(s.size()), out.data(), int32_t(out.size()), &status);
    if (U_FAILURE(status)) fail("tokenizer: NFC normalization failed ({})", u_errorName(status));
    out.resize(size_t(n));
    return out;
}

}  // namespace
#else
struct BpeEncoder::Regex {};
#endif

BpeEncoder::BpeEncoder() = default;
BpeEncoder::~BpeEncoder() = default;
BpeEncoder::BpeEncoder(BpeEncoder&&) noexcept = default;
BpeEncoder& BpeEncoder::operator=(BpeEncoder&&) noexcept = default;

BpeEncoder BpeEncoder::load(const std::filesystem::path& tokenizer_json) {
    return from_json(read_tokenizer_json(tokenizer_json), tokenizer_json.string());
}

BpeEncoder BpeEncoder::from_json(const json& doc, const std::string& file) {
    BpeEncoder e;
    e.file_ = file;
    const json model = doc.is_object() && doc.contains("model") ? doc["model"] : json();
    if (!model.is_object() || !model.contains("vocab") || !model["vocab"].is_object())
        fail("{}: expected a model with a \"vocab\" map of token → id (a BPE tokenizer)", e.file_);
    for (const auto& [token, id] : model["vocab"].items())
        if (id.is_number_integer()) e.vocab_[token] = id.get<int32_t>();
    const auto unsupported = [&](const std::string& what) {
        if (e.unsupported_.empty()) e.unsupported_ = what;
    };
    if (model.value("type", "BPE") != "BPE") unsupported("a " + model.value("type", "") + " model (only BPE)");
    // Word-piece decorations and BPE dropout change what merges produce; byte-level vocabularies
    // (Qwen's, MiMo's) use neither.
    for (const char* field : {"continuing_subword_prefix", "end_of_word_suffix"})
        if (model.contains(field) && model[field].is_string() && !model[field].get<std::string>().empty())
            unsupported(std::string("a BPE model with ") + field);
    if (model.contains("dropout") && !model["dropout"].is_null()) unsupported("BPE dropout");
    e.ignore_merges_ = model.value("ignore_merges", false);
    if (model.contains("merges") && model["merges"].is_array()) {
        int32_t rank = 0;
        for (const json& m : model["merges"]) {
            // "left right" (older files) or ["left", "right"].
            std::string key;
            if (m.is_string()) key = m.get<std::string>();
            else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string())
                key = m[0].get<std::string>() + " " + m[1].get<std::string>();
            else fail("{}: merge {} is neither \"a b\" nor [\"a\", \"b\"]", e.file_, m.dump());
            e.merge_rank_.emplace(key, rank++);
        }
    }

    const json normalizer = doc.value("normalizer", json());
    if (!normalizer.is_null()) {
        const std::string type = normalizer.value("type", "");
        if (type == "NFC") e.nfc_ = true;
        else if (type == "Sequence" && normalizer.contains("normalizers") && normalizer["normalizers"].size() == 1 &&
                 normalizer["normalizers"][0].value("type", "") == "NFC")
            e.nfc_ = true;
        else unsupported("the normalizer " + normalizer.dump());
    }
    std::string why;
    if (!read_pre_tokenizer(doc.value("pre_tokenizer", json()), e.split_pattern_, why)) unsupported(why);
    if (doc.contains("added_tokens") && doc["added_tokens"].is_array()) {
        for (const json& t : doc["added_tokens"]) {
            if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
                !t["content"].is_string())
                fail("{}: added token {} needs an integer \"id\" and a string \"content\"", e.file_, t.dump());
            if (t.value("lstrip", false) || t.value("rstrip", false) || t.value("single_word", false))
                unsupported("added token " + t["content"].get<std::string>() + " with lstrip/rstrip/single_word");
            if (!t["content"].get<std::string>().empty())
                e.added_.emplace_back(t["content"].get<std::string>(), t["id"].get<int32_t>());
        }
    }
    // Longest first, so that "<|im_end|>" is not read as a shorter token that is its prefix.
    std::stable_sort(e.added_.begin(), e.added_.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
#if XINFER_HAS_ICU
    if (e.unsupported_.empty() && !e.split_pattern_.empty()) {
        const std::u16string pattern = to_utf16(onig_to_icu(e.split_pattern_));
        UParseError where{};
        UErrorCode status = U_ZERO_ERROR;
        e.regex_ = std::make_unique<Regex>();
        e.regex_->compiled = uregex_open(pattern.data(), int32_t(pattern.size()), 0, &where, &status);
        if (U_FAILURE(status))
            fail("{}: the pre-tokenizer regex does not compile ({} at offset {}): {}", e.file_, u_errorName(status),
                 where.offset, e.split_pattern_);
    }
#else
    unsupported("this build of xinfer, which has no ICU (Debian: libicu-dev) for normalization and Unicode regexes");
#endif
    return e;
}

bool BpeEncoder::can_encode(std::string* why_not) const {
    if (why_not) *why_not = unsupported_;
    return unsupported_.empty();
}

std::vector<int32_t> BpeEncoder::encode_piece(const std::string& bytes) const {
    std::string spelled;
    for (char b : bytes) spelled += byte_level_spelling(uint8_t(b));
    if (ignore_merges_) {
        const auto whole = vocab_.find(spelled);
        if (whole != vocab_.end()) return {whole->second};
    }
    std::vector<std::string> symbols;
    for (char b : bytes) symbols.push_back(byte_level_spelling(uint8_t(b)));
    for (;;) {
        int32_t best = INT32_MAX;
        for (size_t i = 0; i + 1 < symbols.size(); ++i) {
            const auto it = merge_rank_.find(symbols[i] + " " + symbols[i + 1]);
            if (it != merge_rank_.end()) best = std::min(best, it->second);
        }
        if (best == INT32_MAX) break;
        std::vector<std::string> merged;
        for (size_t i = 0; i < symbols.size(); ++i) {
            if (i + 1 < symbols.size()) {
                const auto it = merge_rank_.find(symbols[i] + " " + symbols[i + 1]);
                if (it != merge_rank_.end() && it->second == best) {
                    merged.push_back(symbols[i] + symbols[i + 1]);
                    ++i;
                    continue;
                }
            }
            merged.push_back(symbols[i]);
        }
        symbols = std::move(merged);
    }
    std::vector<int32_t> ids;
    for (const std::string& s : symbols) {
        const auto it = vocab_.find(s);
        if (it == vocab_.end()) fail("{}: the BPE symbol \"{}\" is not in the vocabulary", file_, s);
        ids.push_back(it->second);
    }
    return ids;
}

std::vector<int32_t> BpeEncoder::encode(const std::string& text) const {
    if (!unsupported_.empty()) fail("{}: cannot encode text with {}", file_, unsupported_);
    std::vector<int32_t> ids;
#if XINFER_HAS_ICU
    // A private copy of the compiled regex: matching state is per object, and requests encode
    // concurrently.
    UErrorCode status = U_ZERO_ERROR;
    URegularExpression* regex = regex_ ? uregex_clone(regex_->compiled, &status) : nullptr;
    struct Closer {
        URegularExpression* r;
        ~Closer() {
            if (r) uregex_close(r);
        }
    } closer{regex};
    const auto add_stretch = [&](const std::string& stretch) {
        if (stretch.empty()) return;
        std::u16string s = to_utf16(stretch);
        if (nfc_) s = nfc(s);
        if (!regex) {
            const std::vector<int32_t> piece = encode_piece(to_utf8(s.data(), int32_t(s.size())));
            ids.insert(ids.end(), piece.begin(), piece.end());
            return;
        }
        UErrorCode st = U_ZERO_ERROR;
        uregex_setText(regex, s.data(), int32_t(s.size()), &st);
        int32_t at = 0;
        const auto add = [&](int32_t from, int32_t to) {
            if (to <= from) return;
            const std::vector<int32_t> piece = encode_piece(to_utf8(s.data() + from, to - from));
            ids.insert(ids.end(), piece.begin(), piece.end());
        };
        while (uregex_findNext(regex, &st) && U_SUCCESS(st)) {
            const int32_t begin = uregex_start(regex, 0, &st), end = uregex_end(regex, 0, &st);
            add(at, begin);  // Isolated: the gap before a match is a piece too
            add(begin, end);
            at = end;
        }
        if (U_FAILURE(st)) fail("{}: the pre-tokenizer regex failed ({})", file_, u_errorName(st));
        add(at, int32_t(s.size()));
    };
    // Added tokens are cut out first, wherever they occur; the stretches between are encoded.
    size_t start = 0, i = 0;
    while (i < text.size()) {
        const auto hit = std::find_if(added_.begin(), added_.end(),
                                      [&](const auto& a) { return text.compare(i, a.first.size(), a.first) == 0; });
        if (hit == added_.end()) {
            ++i;
            continue;
        }
        add_stretch(text.substr(start, i - start));
        ids.push_back(hit->second);
        i += hit->first.size();
        start = i;
    }
    add_stretch(text.substr(start));
#else
    (void)text;
#endif
    return ids;
}

}  // namespace xinfer
