// The xinfer binary end to end: generate, logits (.npy), info, and clear errors on bad input.
#include "byte_level_tokenizer.h"
#include "fixture.h"
#include "loader/npy.h"
#include "models/model.h"
#include "tokenizer/detokenizer.h"
#include "unit/safetensors_test_writer.h"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <array>
#include <cstdio>
#include <fstream>

namespace xinfer::test {
namespace {

struct CommandResult {
    int status;
    std::string output;  // stdout and stderr
};

CommandResult run_xinfer(const std::string& args) {
    const std::string command = fmt::format("{} {} 2>&1", XINFER_BINARY, args);
    FILE* pipe = popen(command.c_str(), "r");
    if (!pipe) throw std::runtime_error("popen failed: " + command);
    std::string output;
    std::array<char, 4096> buffer;
    while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
    const int status = pclose(pipe);
    return {WEXITSTATUS(status), output};
}

std::string join_ids(const std::vector<int32_t>& ids) {
    return fmt::format("{}", fmt::join(ids, ","));
}

TEST(Cli, GeneratePrintsGreedyIdsAsJson) {
    const Fixture f = load_fixture("mimo_hub_f32");
    const size_t n = decidable_greedy_steps(f);
    ASSERT_GE(n, 4u);
    CommandResult run = run_xinfer(fmt::format("generate --model {} --prompt-ids {} --max-tokens {}", f.dir.string(),
                                     join_ids(f.prompt), n));
    ASSERT_EQ(run.status, 0) << run.output;
    const nlohmann::json line = nlohmann::json::parse(run.output.substr(0, run.output.find('\n')));
    EXPECT_EQ(line.at("ids").get<std::vector<int32_t>>(), std::vector<int32_t>(f.greedy.begin(), f.greedy.begin() + long(n)));
    EXPECT_EQ(line.at("finish_reason"), "length");
    EXPECT_FALSE(line.contains("text"));  // the fixture has no tokenizer.json
}

// --stop with a tokenizer.json next to the model: the text is cut before the stop string and
// generation ends at the token that completed it. Without a tokenizer, --stop is refused up front.
TEST(Cli, GenerateStopsAtStopStrings) {
    const Fixture f = load_fixture("mimo_hub_f32");
    const size_t n = decidable_greedy_steps(f);
    ASSERT_GE(n, 6u);
    TempDir dir;
    std::filesystem::copy(f.dir, dir.path(), std::filesystem::copy_options::recursive);
    write_byte_level_tokenizer(dir.path(), f.vocab);
    const std::string stop = test_token_bytes(f.greedy[3], f.vocab) + test_token_bytes(f.greedy[4], f.vocab);
    std::string text;
    size_t end = 0;
    for (; end < n; ++end) {
        text += f.greedy[end] == f.vocab - 1 ? "" : test_token_bytes(f.greedy[end], f.vocab);
        if (text.find(stop) != std::string::npos) break;
    }
    ASSERT_LE(end, size_t(4));
    // The stop string travels as one shell argument: single-quoted, with any quote escaped.
    std::string quoted = "'";
    for (char ch : stop) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    quoted += "'";
    CommandResult run = run_xinfer(fmt::format("generate --model {} --prompt-ids {} --max-tokens {} --stop {}",
                                               dir.path().string(), join_ids(f.prompt), n, quoted));
    ASSERT_EQ(run.status, 0) << run.output;
    const nlohmann::json line = nlohmann::json::parse(run.output.substr(0, run.output.find('\n')));
    EXPECT_EQ(line.at("ids").get<std::vector<int32_t>>(),
              std::vector<int32_t>(f.greedy.begin(), f.greedy.begin() + long(end) + 1));
    EXPECT_EQ(line.at("finish_reason"), "stop");
    EXPECT_EQ(line.at("text"), to_valid_utf8(text.substr(0, text.find(stop))));

    CommandResult refused = run_xinfer(fmt::format("generate --model {} --prompt-ids {} --stop x", f.dir.string(),
                                                   join_ids(f.prompt)));
    EXPECT_NE(refused.status, 0);
    EXPECT_NE(refused.output.find("tokenizer.json"), std::string::npos) << refused.output;

    // --prompt TEXT: the ids the tokenizer encodes it to (this one: one id per byte, no merges).
    CommandResult no_tokenizer = run_xinfer(fmt::format("generate --model {} --prompt hi", f.dir.string()));
    EXPECT_NE(no_tokenizer.status, 0);
    EXPECT_NE(no_tokenizer.output.find("tokenizer.json"), std::string::npos) << no_tokenizer.output;
#if XINFER_HAS_ICU
    CommandResult by_text = run_xinfer(fmt::format("generate --model {} --prompt 'hi there' --max-tokens 4", dir.path().string()));
    CommandResult by_ids = run_xinfer(fmt::format("generate --model {} --prompt-ids 104,105,32,116,104,101,114,101 --max-tokens 4",
                                                  dir.path().string()));
    ASSERT_EQ(by_text.status, 0) << by_text.output;
    EXPECT_EQ(by_text.output, by_ids.output);
#endif
}

// Speculative decoding from the command line: a DFlash drafter (z-lab dialect) whose proposals,
// written by --spec-trace, equal those of z-lab's own reference loop at every step, greedy output
// unchanged, and the counters in the final JSON line.
TEST(Cli, GenerateSpeculativeTraceMatchesDFlashReference) {
    const Fixture f = load_fixture("mimo_native_f32");
    const std::filesystem::path drafter = fixture_dir("dflash_zlab");
    std::ifstream in(drafter / "reference.json");
    const nlohmann::json ref = nlohmann::json::parse(in);
    const auto prompt = ref.at("prompt_ids").get<std::vector<int32_t>>();
    const int max_tokens = ref.at("max_new_tokens").get<int>();
    const std::filesystem::path trace = std::filesystem::temp_directory_path() / "xinfer_test_spec_trace.jsonl";
    CommandResult run = run_xinfer(fmt::format(
        "generate --model {} --prompt-ids {} --max-tokens {} --speculative-config '{{\"method\":\"dflash\",\"model\":\"{}\"}}' "
        "--spec-trace {}",
        f.dir.string(), join_ids(prompt), max_tokens, drafter.string(), trace.string()));
    ASSERT_EQ(run.status, 0) << run.output;
    const nlohmann::json line = nlohmann::json::parse(run.output.substr(0, run.output.find('\n')));
    EXPECT_EQ(line.at("ids").get<std::vector<int32_t>>(), ref.at("greedy_ids").get<std::vector<int32_t>>());
    std::ifstream trace_in(trace);
    std::string step_line;
    size_t step = 0;
    while (std::getline(trace_in, step_line)) {
        const nlohmann::json got = nlohmann::json::parse(step_line);
        ASSERT_LT(step, ref.at("steps").size());
        const auto proposed = got.at("proposed").get<std::vector<int32_t>>();
        const auto expected = ref.at("steps")[step].at("proposed").get<std::vector<int32_t>>();
        ASSERT_LE(proposed.size(), expected.size());  // fewer drafts near max_tokens
        EXPECT_TRUE(std::equal(proposed.begin(), proposed.end(), expected.begin())) << "step " << step;
        ++step;
    }
    EXPECT_GT(step, 0u);
    EXPECT_EQ(line.at("spec_decode").at("num_drafts").get<size_t>(), step);
    EXPECT_EQ(line.at("spec_decode").at("method").get<std::string>(), "dflash");
    std::filesystem::remove(trace);

    run = run_xinfer(fmt::format("generate --model {} --prompt-ids 1,2 --speculative-config '{{\"method\":\"eagle9\"}}'",
                                 f.dir.string()));
    EXPECT_NE(run.status, 0);
    EXPECT_NE(run.output.find("unknown method \"eagle9\""), std::string::npos) << run.output;
}

TEST(Cli, LogitsWritesNpyMatchingReference) {
    const Fixture f = load_fixture("qwen3_f32");
    const std::filesystem::path out = std::filesystem::temp_directory_path() / "xinfer_test_logits.npy";
    CommandResult run = run_xinfer(fmt::format("logits --model {} --prompt-ids {} --out {}", f.dir.string(), join_ids(f.prompt),
                                     out.string()));
    ASSERT_EQ(run.status, 0) << run.output;
    NpyArray array = read_npy_f32(out);
    ASSERT_EQ(array.shape, (std::vector<int64_t>{int64_t(f.prompt.size()), f.vocab}));
    EXPECT_LE(relative_error(array.data.data(), f.logits.data(), f.logits.size()), 1e-4);
    std::filesystem::remove(out);
}

TEST(Cli, GenerateProfileWritesChromeTrace) {
    const Fixture f = load_fixture("mimo_hub_f32");
    const std::filesystem::path trace = std::filesystem::temp_directory_path() / "xinfer_test_trace.json";
    CommandResult run = run_xinfer(fmt::format("generate --model {} --prompt-ids {} --max-tokens 3 --profile {}",
                                               f.dir.string(), join_ids(f.prompt), trace.string()));
    ASSERT_EQ(run.status, 0) << run.output;
    const nlohmann::json json = nlohmann::json::parse(std::ifstream(trace));
    size_t attention_events = 0;
    for (const auto& event : json.at("traceEvents"))
        if (event.value("cat", "") == "op" && event.at("name").get<std::string>().starts_with("attention L"))
            ++attention_events;
    // 3 forward steps (prefill + 2 decodes) × one attention per layer.
    EXPECT_EQ(attention_events, 3 * read_model_config(*Checkpoint::open(f.dir, false)).layers.size());
    std::filesystem::remove(trace);
}

// The bench's decode roofline counts the KV a step reads in the cache's own dtype: at context
// 4,001 (4,000 prompt tokens + half of 2 steps), each layer reads min(context, window) keys of
// n_kv · (dk + dv) values, 2 bytes each in bf16 and 4 in f32.
TEST(Cli, BenchCountsKvBytesInTheCacheDtype) {
    const Fixture f = load_fixture("mimo_native_f32");
    const ModelConfig config = read_model_config(*Checkpoint::open(f.dir, false));
    double bf16_mb = 0;
    for (const LayerSpec& l : config.layers) {
        const int64_t keys = l.window > 0 ? std::min<int64_t>(4001, l.window) : 4001;
        bf16_mb += double(keys * l.n_kv_heads * (l.head_dim_k + l.head_dim_v) * 2) / 1e6;
    }
    const auto printed_kv_mb = [&](const char* dtype) {
        const CommandResult run = run_xinfer(
            fmt::format("bench --model {} --prompt-len 4000 --gen-len 2 --kv-cache-dtype {}", f.dir.string(), dtype));
        EXPECT_EQ(run.status, 0) << run.output;
        const size_t at = run.output.find(" MB KV");
        EXPECT_NE(at, std::string::npos) << run.output;
        if (at == std::string::npos) return -1.0;
        return std::stod(run.output.substr(run.output.rfind('+', at) + 1, at));
    };
    EXPECT_NEAR(printed_kv_mb("bfloat16"), bf16_mb, 0.006);
    EXPECT_NEAR(printed_kv_mb("float32"), 2 * bf16_mb, 0.006);
}

// On a MoE model the serving bench measures the distinct experts of its decode steps (an untimed
// census pass per level) and prints them next to what uniform routing would touch: a batch of
// one touches exactly top_k (2 in this fixture) per layer.
TEST(Cli, ServingBenchMeasuresExpertsTouched) {
    const Fixture f = load_fixture("mimo_hub_f32");
    CommandResult run =
        run_xinfer(fmt::format("bench --model {} --concurrency 1,4 --input-len 24 --output-len 6", f.dir.string()));
    ASSERT_EQ(run.status, 0) << run.output;
    EXPECT_NE(run.output.find("experts per MoE layer, measured (uniform routing) |"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("| 2.0 (2.0) |"), std::string::npos) << run.output;
}

TEST(Cli, ServingBenchProfilesDecodeSteps) {
    const Fixture f = load_fixture("qwen3_f32");
    const std::filesystem::path trace = std::filesystem::temp_directory_path() / "xinfer_test_serving_trace.json";
    CommandResult run = run_xinfer(fmt::format("bench --model {} --concurrency 1,3 --input-len 40 --output-len 12 "
                                               "--max-num-batched-tokens 32 --profile {}",
                                               f.dir.string(), trace.string()));
    ASSERT_EQ(run.status, 0) << run.output;
    EXPECT_NE(run.output.find("profile of 8 decode steps at concurrency 3"), std::string::npos) << run.output;
    const nlohmann::json json = nlohmann::json::parse(std::ifstream(trace));
    // One region per step, each a decode of all three requests (chunked prefill finished first),
    // and every layer's attention inside each.
    std::vector<std::string> regions;
    size_t attention_events = 0;
    for (const auto& event : json.at("traceEvents")) {
        const std::string name = event.at("name").get<std::string>();
        if (event.value("cat", "") == "op") attention_events += name.starts_with("attention L");
        else if (event.value("ph", "") == "X") regions.push_back(name);
    }
    ASSERT_EQ(regions.size(), 8u);
    for (const std::string& region : regions) EXPECT_NE(region.find("3 seqs, 3 tokens (3 decoding)"), std::string::npos) << region;
    EXPECT_EQ(attention_events, 8 * read_model_config(*Checkpoint::open(f.dir, false)).layers.size());
    std::filesystem::remove(trace);

    CommandResult spec = run_xinfer(fmt::format("bench --model {} --speculative-config '{{\"method\":\"ngram\"}}' --profile {}",
                                                f.dir.string(), trace.string()));
    EXPECT_NE(spec.status, 0);
    EXPECT_NE(spec.output.find("--profile is not available"), std::string::npos) << spec.output;
}

TEST(Cli, InfoPrintsPerLayerTable) {
    CommandResult run = run_xinfer(fmt::format("info --model {}", fixture_dir("mimo_hub_fp8").string()));
    ASSERT_EQ(run.status, 0) << run.output;
    EXPECT_NE(run.output.find("MiMoV2FlashForCausalLM"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("sliding"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("f8_e4m3"), std::string::npos) << run.output;
}

TEST(Cli, BadInputIsAClearError) {
    CommandResult bad_ids = run_xinfer(fmt::format("generate --model {} --prompt-ids 1,x,3", fixture_dir("qwen3_f32").string()));
    EXPECT_NE(bad_ids.status, 0);
    EXPECT_NE(bad_ids.output.find("invalid token id \"x\""), std::string::npos) << bad_ids.output;

    CommandResult out_of_vocab = run_xinfer(fmt::format("generate --model {} --prompt-ids 1,99999999", fixture_dir("qwen3_f32").string()));
    EXPECT_NE(out_of_vocab.status, 0);
    EXPECT_NE(out_of_vocab.output.find("99999999"), std::string::npos) << out_of_vocab.output;

    CommandResult missing = run_xinfer("info --model /nonexistent/model");
    EXPECT_NE(missing.status, 0);
    EXPECT_NE(missing.output.find("/nonexistent/model"), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace xinfer::test
