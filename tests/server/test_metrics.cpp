// /metrics body: vLLM's names, valid Prometheus text, and the engine's own counters.
#include "models/fixture.h"
#include "server/metrics.h"

#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <sstream>

namespace xinfer::test {
namespace {

// Every line is a HELP, a TYPE or a sample `name{labels} value`; returns samples by name+labels.
std::map<std::string, double> parse(const std::string& text) {
    static const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*\{[^}]*\}) (\S+)$)");
    static const std::regex comment(R"(^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$)");
    std::map<std::string, double> samples;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
        std::smatch m;
        if (std::regex_match(line, m, sample)) {
            EXPECT_TRUE(samples.emplace(m[1].str(), std::stod(m[2].str())).second) << "duplicate sample " << line;
        } else {
            EXPECT_TRUE(std::regex_match(line, comment)) << "not a Prometheus line: " << line;
        }
    }
    return samples;
}

TEST(Metrics, VllmNamesAndValues) {
    EngineStats stats;
    stats.running = 3;
    stats.waiting = 2;
    stats.kv_pages_total = 400;
    stats.kv_pages_free = 300;
    stats.preemptions = 1;
    stats.prefix_query_tokens = 96;
    stats.prefix_hit_tokens = 64;
    stats.spec_method = "ngram";
    stats.spec.add({5, 6, 7}, 2);
    stats.spec.add({8, 9, 1}, 0);
    const auto s = parse(prometheus_metrics(stats, "mimo \"v2\""));
    const std::string l = R"({model_name="mimo \"v2\""})";
    EXPECT_EQ(s.at("vllm:num_requests_running" + l), 3);
    EXPECT_EQ(s.at("vllm:num_requests_waiting" + l), 2);
    EXPECT_DOUBLE_EQ(s.at("vllm:kv_cache_usage_perc" + l), 0.25);
    EXPECT_EQ(s.at("vllm:num_preemptions_total" + l), 1);
    EXPECT_EQ(s.at("vllm:prefix_cache_queries_total" + l), 96);
    EXPECT_EQ(s.at("vllm:prefix_cache_hits_total" + l), 64);
    EXPECT_EQ(s.at("vllm:spec_decode_num_drafts_total" + l), 2);
    EXPECT_EQ(s.at("vllm:spec_decode_num_draft_tokens_total" + l), 6);
    EXPECT_EQ(s.at("vllm:spec_decode_num_accepted_tokens_total" + l), 2);
    const std::string pos = R"(vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="mimo \"v2\"",position=")";
    EXPECT_EQ(s.at(pos + "0\"}"), 1);
    EXPECT_EQ(s.at(pos + "1\"}"), 1);
    EXPECT_EQ(s.at(pos + "2\"}"), 0);
    EXPECT_EQ(s.size(), 12u);
}

TEST(Metrics, NoSpeculationNoSpecDecodeFamilies) {
    EngineStats stats;
    const std::string text = prometheus_metrics(stats, "m");
    EXPECT_EQ(text.find("spec_decode"), std::string::npos) << text;
    EXPECT_EQ(parse(text).size(), 6u);
}

// The server's request counters: vLLM's prompt/generation token totals and request_success by
// finished_reason.
TEST(Metrics, RequestCounters) {
    RequestCounters requests;
    requests.prompt_tokens = 30;
    requests.generation_tokens = 44;
    requests.finished = {{"length", 3}, {"stop", 2}, {"abort", 1}};
    const auto s = parse(prometheus_metrics(EngineStats{}, "m", &requests));
    EXPECT_EQ(s.at(R"(vllm:prompt_tokens_total{model_name="m"})"), 30);
    EXPECT_EQ(s.at(R"(vllm:generation_tokens_total{model_name="m"})"), 44);
    EXPECT_EQ(s.at(R"(vllm:request_success_total{model_name="m",finished_reason="length"})"), 3);
    EXPECT_EQ(s.at(R"(vllm:request_success_total{model_name="m",finished_reason="stop"})"), 2);
    EXPECT_EQ(s.at(R"(vllm:request_success_total{model_name="m",finished_reason="abort"})"), 1);
    EXPECT_EQ(s.size(), 6u + 5u);
}

// The exposition of a real engine run reports the counters the engine keeps.
TEST(Metrics, ReportsAnEngineRun) {
    EngineOptions options;
    options.model_dir = fixture_dir("qwen3_f32").string();
    options.speculative_config = R"({"method": "ngram", "num_speculative_tokens": 3})";
    std::unique_ptr<Engine> engine = Engine::create(options);
    const Fixture f = load_fixture("qwen3_f32");
    std::vector<int32_t> prompt;
    for (int r = 0; r < 4; ++r) prompt.insert(prompt.end(), f.prompt.begin(), f.prompt.begin() + 8);  // repeats: n-gram hits
    engine->submit(prompt, {}, 16);
    while (engine->has_work()) engine->step();
    const EngineStats stats = engine->stats();
    ASSERT_GT(stats.spec.num_drafts, 0);
    const auto s = parse(prometheus_metrics(stats, "qwen3"));
    const std::string l = R"({model_name="qwen3"})";
    EXPECT_EQ(s.at("vllm:spec_decode_num_drafts_total" + l), stats.spec.num_drafts);
    EXPECT_EQ(s.at("vllm:spec_decode_num_draft_tokens_total" + l), stats.spec.num_draft_tokens);
    EXPECT_EQ(s.at("vllm:spec_decode_num_accepted_tokens_total" + l), stats.spec.num_accepted_tokens);
    EXPECT_EQ(s.at("vllm:num_requests_running" + l), 0);
    EXPECT_EQ(s.at("vllm:kv_cache_usage_perc" + l), 0);
}

}  // namespace
}  // namespace xinfer::test
