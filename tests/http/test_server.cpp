// The HTTP server end to end on the qwen3_f32 fixture (CPU, or XINFER_TEST_DEVICE): completions
// equal the engine's own output, alone, batched, streamed and concurrent; bad requests get 4xx with
// a reason and the server keeps serving; a client that hangs up has its request aborted; /metrics
// counts; the profile is written at stop, with device times on an accelerator.
#include "byte_level_tokenizer.h"
#include "models/model_test_util.h"
#include "server/server.h"
#include "tokenizer/detokenizer.h"
#include "unit/safetensors_test_writer.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

namespace xinfer::test {
namespace {

using json = nlohmann::json;

// An engine on the test device. The suite's engine lives as long as the suite and some tests start
// a second one beside it; on an accelerator each would plan its KV pool over 90% of the device's
// memory, and the second would not fit (H200: "out of memory allocating 135084380160 bytes"). The
// tiny fixture needs a few MiB of KV.
EngineOptions engine_options(const std::string& model_dir) {
    EngineOptions options;
    options.model_dir = model_dir;
    options.device = test_device();
    options.kv_cache_memory = int64_t(256) << 20;
    return options;
}

// Greedy tokens for `prompt` straight from the engine (before the server drives it).
std::vector<int32_t> reference(Engine& engine, const std::vector<int32_t>& prompt, int max_tokens,
                               std::vector<int32_t> stop_ids = {}) {
    std::vector<int32_t> tokens;
    engine.submit(prompt, {}, max_tokens, std::move(stop_ids), [&](const RequestOutput& out) {
        tokens.insert(tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
    });
    while (engine.has_work()) engine.step();
    return tokens;
}

class ServerTest : public ::testing::Test {
protected:
    static void SetUpTestSuite() {
        EngineOptions options = engine_options(fixture_dir("qwen3_f32").string());
        options.max_num_seqs = 8;
        engine_ = Engine::create(options).release();
        const Fixture f = load_fixture("qwen3_f32");
        prompt_a_ = std::vector<int32_t>(f.prompt.begin(), f.prompt.begin() + 6);
        prompt_b_ = std::vector<int32_t>(f.prompt.begin() + 3, f.prompt.end());
        ref_a_ = reference(*engine_, prompt_a_, 12);
        ref_b_ = reference(*engine_, prompt_b_, 12);
    }
    static void TearDownTestSuite() {
        delete engine_;
        engine_ = nullptr;
    }
    void SetUp() override {
        ServerOptions options;
        options.port = 0;
        options.model_name = "qwen3-test";
        options.profile_path = profile_path_;
        server_ = std::make_unique<Server>(*engine_, options);
        port_ = server_->start();
        client_ = std::make_unique<httplib::Client>("127.0.0.1", port_);
        client_->set_read_timeout(60, 0);
    }
    void TearDown() override { server_->stop(); }

    httplib::Result post(const json& body) { return client_->Post("/v1/completions", body.dump(), "application/json"); }
    // Another server, over an engine of a test's own (stopped when it goes out of scope).
    struct OwnServer {
        std::unique_ptr<Server> server;
        std::unique_ptr<httplib::Client> client;
        OwnServer(std::unique_ptr<Server> s, std::unique_ptr<httplib::Client> c)
            : server(std::move(s)), client(std::move(c)) {}
        OwnServer(OwnServer&&) = default;
        ~OwnServer() {
            if (server) server->stop();
        }
    };
    static OwnServer serve(Engine& engine, const std::string& model_name) {
        ServerOptions options;
        options.port = 0;
        options.model_name = model_name;
        OwnServer own(std::make_unique<Server>(engine, options), nullptr);
        own.client = std::make_unique<httplib::Client>("127.0.0.1", own.server->start());
        own.client->set_read_timeout(60, 0);
        return own;
    }
    static json request(const std::vector<int32_t>& prompt, int max_tokens) {
        return {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
    }
    // A sample of /metrics by its full name with labels; -1 when absent.
    double metric(const std::string& sample) {
        const auto res = client_->Get("/metrics");
        EXPECT_TRUE(res && res->status == 200);
        const size_t at = res->body.find(sample + " ");
        return at == std::string::npos ? -1 : std::stod(res->body.substr(at + sample.size() + 1));
    }

    static Engine* engine_;
    static std::vector<int32_t> prompt_a_, prompt_b_, ref_a_, ref_b_;
    std::string profile_path_;
    std::unique_ptr<Server> server_;
    std::unique_ptr<httplib::Client> client_;
    int port_ = 0;
};
Engine* ServerTest::engine_ = nullptr;
std::vector<int32_t> ServerTest::prompt_a_, ServerTest::prompt_b_, ServerTest::ref_a_, ServerTest::ref_b_;

TEST_F(ServerTest, HealthAndModels) {
    auto res = client_->Get("/health");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    res = client_->Get("/v1/models");
    ASSERT_TRUE(res);
    const json models = json::parse(res->body);
    EXPECT_EQ(models["data"][0]["id"], "qwen3-test");
    EXPECT_GT(models["data"][0]["max_model_len"].get<int64_t>(), 0);
}

TEST_F(ServerTest, CompletionEqualsTheEngine) {
    const auto res = post(request(prompt_a_, 12));
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    const json body = json::parse(res->body);
    EXPECT_EQ(body["choices"][0]["token_ids"].get<std::vector<int32_t>>(), ref_a_);
    EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(body["usage"]["prompt_tokens"], prompt_a_.size());
    EXPECT_EQ(body["usage"]["completion_tokens"], 12);
    EXPECT_EQ(body["model"], "qwen3-test");
}

TEST_F(ServerTest, BatchedPromptsAndStopTokens) {
    json body = request(prompt_a_, 12);
    body["prompt"] = {prompt_a_, prompt_b_};
    auto res = post(body);
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    json out = json::parse(res->body);
    EXPECT_EQ(out["choices"][0]["token_ids"].get<std::vector<int32_t>>(), ref_a_);
    EXPECT_EQ(out["choices"][1]["token_ids"].get<std::vector<int32_t>>(), ref_b_);
    EXPECT_EQ(out["usage"]["completion_tokens"], 24);

    // Stopping at the reference's 5th token: that token is the last one returned.
    body = request(prompt_b_, 12);
    body["stop_token_ids"] = {ref_b_[4]};
    res = post(body);
    ASSERT_TRUE(res);
    out = json::parse(res->body);
    const auto tokens = out["choices"][0]["token_ids"].get<std::vector<int32_t>>();
    const auto first = std::find(ref_b_.begin(), ref_b_.end(), ref_b_[4]);
    EXPECT_EQ(tokens, std::vector<int32_t>(ref_b_.begin(), first + 1));
    EXPECT_EQ(out["choices"][0]["finish_reason"], "stop");
}

TEST_F(ServerTest, StreamedChunksAddUpToTheCompletion) {
    json body = request(prompt_b_, 12);
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
    const auto res = post(body);
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
    std::vector<int32_t> tokens;
    std::vector<json> events;
    size_t at = 0;
    bool done = false;
    while ((at = res->body.find("data: ", at)) != std::string::npos) {
        const size_t end = res->body.find("\n\n", at);
        ASSERT_NE(end, std::string::npos);
        const std::string data = res->body.substr(at + 6, end - at - 6);
        at = end;
        if (data == "[DONE]") {
            done = true;
            continue;
        }
        EXPECT_FALSE(done) << "an event after [DONE]";
        events.push_back(json::parse(data));
        if (!events.back()["choices"].empty())
            for (int32_t t : events.back()["choices"][0]["token_ids"].get<std::vector<int32_t>>()) tokens.push_back(t);
    }
    EXPECT_TRUE(done);
    EXPECT_EQ(tokens, ref_b_);
    ASSERT_GE(events.size(), 2u);
    const json& last_choice = events[events.size() - 2]["choices"][0];
    EXPECT_EQ(last_choice["finish_reason"], "length");
    EXPECT_EQ(events.back()["usage"]["completion_tokens"], 12);
}

// Sampling: a seed makes a request reproducible; without one, requests draw their own.
TEST_F(ServerTest, SeedsMakeSamplesReproducible) {
    const auto sample = [&](const json& extra) {
        json body = {{"prompt", prompt_b_}, {"max_tokens", 12}, {"temperature", 1.0}};
        body.update(extra);
        const auto res = post(body);
        EXPECT_TRUE(res && res->status == 200);
        return res ? json::parse(res->body)["choices"][0]["token_ids"].get<std::vector<int32_t>>() : std::vector<int32_t>{};
    };
    EXPECT_EQ(sample({{"seed", 7}}), sample({{"seed", 7}}));
    std::set<std::vector<int32_t>> unseeded;
    for (int i = 0; i < 4; ++i) unseeded.insert(sample(json::object()));
    EXPECT_GT(unseeded.size(), 1u);
}

// n choices per prompt: greedy ones are equal; sampled ones with a seed differ and reproduce.
TEST_F(ServerTest, SeveralChoicesPerPrompt) {
    json body = request(prompt_a_, 12);
    body["prompt"] = {prompt_a_, prompt_b_};
    body["n"] = 2;
    auto res = post(body);
    ASSERT_TRUE(res && res->status == 200);
    json out = json::parse(res->body);
    ASSERT_EQ(out["choices"].size(), 4u);
    for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(out["choices"][i]["index"], i);
        EXPECT_EQ(out["choices"][i]["token_ids"].get<std::vector<int32_t>>(), i < 2 ? ref_a_ : ref_b_) << i;
    }
    body = {{"prompt", prompt_b_}, {"max_tokens", 12}, {"temperature", 1.0}, {"seed", 3}, {"n", 3}};
    res = post(body);
    ASSERT_TRUE(res && res->status == 200);
    out = json::parse(res->body);
    ASSERT_EQ(out["choices"].size(), 3u);
    std::set<std::vector<int32_t>> distinct;
    for (const json& c : out["choices"]) distinct.insert(c["token_ids"].get<std::vector<int32_t>>());
    EXPECT_GT(distinct.size(), 1u);
    const auto again = post(body);
    ASSERT_TRUE(again && again->status == 200);
    EXPECT_EQ(json::parse(again->body)["choices"], out["choices"]);
}

// Requests from several clients at once are batched by the engine and still get their own tokens.
TEST_F(ServerTest, ConcurrentClients) {
    std::vector<std::thread> threads;
    std::vector<std::vector<int32_t>> got(6);
    for (int i = 0; i < 6; ++i)
        threads.emplace_back([&, i] {
            httplib::Client client("127.0.0.1", port_);
            client.set_read_timeout(60, 0);
            const auto res = client.Post("/v1/completions", request(i % 2 ? prompt_b_ : prompt_a_, 12).dump(),
                                         "application/json");
            if (res && res->status == 200)
                got[size_t(i)] = json::parse(res->body)["choices"][0]["token_ids"].get<std::vector<int32_t>>();
        });
    for (auto& t : threads) t.join();
    for (int i = 0; i < 6; ++i) EXPECT_EQ(got[size_t(i)], i % 2 ? ref_b_ : ref_a_) << "client " << i;
}

TEST_F(ServerTest, BadRequestsGetReasonsAndTheServerKeepsServing) {
    const auto expect = [&](const httplib::Result& res, int status, const std::string& reason) {
        ASSERT_TRUE(res);
        EXPECT_EQ(res->status, status) << res->body;
        const json body = json::parse(res->body, nullptr, false);
        ASSERT_FALSE(body.is_discarded()) << res->body;
        EXPECT_NE(body["error"]["message"].get<std::string>().find(reason), std::string::npos) << res->body;
    };
    expect(client_->Post("/v1/completions", "{\"prompt\": [1, 2", "application/json"), 400, "not valid JSON");
    expect(post({{"prompt", "Hello"}}), 400, "no tokenizer.json");
    expect(post({{"prompt", {1, 2}}, {"stop", "x"}}), 400, "tokenizer.json");
    expect(post(request({1, 2, 1 << 30}, 4)), 400, "outside the vocabulary");
    expect(post(request(std::vector<int32_t>(5000, 1), 4)), 400, "max_model_len");
    expect(post({{"prompt", {1, 2}}, {"model", "other"}}), 404, "does not exist");
    expect(post({{"prompt", {1, 2}}, {"n", 0}}), 400, "'n' must be in");
    expect(client_->Post("/v1/chat/completions", "{}", "application/json"), 501, "chat template");
    expect(client_->Get("/v2/nothing"), 404, "no route GET /v2/nothing");
    // A batch with one bad prompt is refused whole, and leaves nothing running.
    json batch = request(prompt_a_, 4);
    batch["prompt"] = {prompt_a_, {1, -5}};
    expect(post(batch), 400, "outside the vocabulary");
    EXPECT_EQ(metric(R"(vllm:num_requests_running{model_name="qwen3-test"})"), 0);

    const auto res = post(request(prompt_a_, 12));
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200);
    EXPECT_EQ(json::parse(res->body)["choices"][0]["token_ids"].get<std::vector<int32_t>>(), ref_a_);
}

// A client that hangs up mid-stream: its request is aborted and every KV page comes back.
TEST_F(ServerTest, DisconnectAbortsTheRequest) {
    json body = request(prompt_a_, 3000);
    body["stream"] = true;
    int chunks = 0;
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = body.dump();
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
    httplib::Response res;
    httplib::Error error = httplib::Error::Success;
    client_->send(req, res, error);  // ends with Canceled after the third chunk
    EXPECT_GE(chunks, 3);
    const std::string aborted = R"(vllm:request_success_total{model_name="qwen3-test",finished_reason="abort"})";
    for (int i = 0; i < 200 && metric(aborted) < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(metric(aborted), 1);
    EXPECT_EQ(metric(R"(vllm:num_requests_running{model_name="qwen3-test"})"), 0);
    EXPECT_EQ(metric(R"(vllm:kv_cache_usage_perc{model_name="qwen3-test"})"), 0);
}

// stop() while a client is streaming: the request is aborted, the client's stream ends, and
// stop() returns (nothing hangs on the request's queue).
TEST_F(ServerTest, StopEndsStreamsInFlight) {
    json body = request(prompt_a_, 3000);
    body["stream"] = true;
    std::atomic<int> chunks{0};
    std::thread client([&] {
        httplib::Client c("127.0.0.1", port_);
        c.set_read_timeout(60, 0);
        httplib::Request req;
        req.method = "POST";
        req.path = "/v1/completions";
        req.body = body.dump();
        req.set_header("Content-Type", "application/json");
        req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
            ++chunks;
            return true;
        };
        httplib::Response res;
        httplib::Error error = httplib::Error::Success;
        c.send(req, res, error);
    });
    for (int i = 0; i < 200 && chunks < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_GE(chunks.load(), 2);
    const auto start = std::chrono::steady_clock::now();
    server_->stop();
    client.join();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
    EXPECT_EQ(engine_->stats().running, 0);
}

TEST_F(ServerTest, MetricsCountRequests) {
    ASSERT_EQ(post(request(prompt_a_, 5))->status, 200);
    ASSERT_EQ(post(request(prompt_b_, 7))->status, 200);
    EXPECT_EQ(metric(R"(vllm:request_success_total{model_name="qwen3-test",finished_reason="length"})"), 2);
    EXPECT_EQ(metric(R"(vllm:prompt_tokens_total{model_name="qwen3-test"})"), double(prompt_a_.size() + prompt_b_.size()));
    EXPECT_EQ(metric(R"(vllm:generation_tokens_total{model_name="qwen3-test"})"), 12);
}

// A speculating engine behind the server: the same greedy tokens as without speculation, and
// /metrics carries vLLM's spec_decode_* counters.
TEST_F(ServerTest, SpeculationIsLosslessAndCounted) {
    EngineOptions options = engine_options(fixture_dir("qwen3_f32").string());
    options.speculative_config = R"({"method": "ngram", "num_speculative_tokens": 3})";
    std::unique_ptr<Engine> engine = Engine::create(options);
    std::vector<int32_t> prompt;
    for (int r = 0; r < 4; ++r) prompt.insert(prompt.end(), prompt_a_.begin(), prompt_a_.end());  // repeats: n-gram hits
    // Without speculation: through this fixture's server (its engine thread owns engine_ now).
    const auto plain_res = post(request(prompt, 16));
    ASSERT_TRUE(plain_res && plain_res->status == 200);
    const auto plain = json::parse(plain_res->body)["choices"][0]["token_ids"].get<std::vector<int32_t>>();
    const OwnServer own = serve(*engine, "spec");
    httplib::Client& client = *own.client;
    const auto res = client.Post("/v1/completions", request(prompt, 16).dump(), "application/json");
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(json::parse(res->body)["choices"][0]["token_ids"].get<std::vector<int32_t>>(), plain);
    const auto metrics = client.Get("/metrics");
    ASSERT_TRUE(metrics);
    const std::string drafts = R"(vllm:spec_decode_num_drafts_total{model_name="spec"} )";
    const size_t at = metrics->body.find(drafts);
    ASSERT_NE(at, std::string::npos) << metrics->body;
    EXPECT_GT(std::stod(metrics->body.substr(at + drafts.size())), 0);
    EXPECT_NE(metrics->body.find("vllm:spec_decode_num_accepted_tokens_per_pos_total"), std::string::npos);
}

// A model directory with a tokenizer.json: stop strings end completions (with n-gram speculation
// on, so accepted chains cross the stop), and each choice carries its text, streamed or not.
TEST_F(ServerTest, StopStringsAndTextWithATokenizer) {
    TempDir dir;
    std::filesystem::copy(fixture_dir("qwen3_f32"), dir.path(), std::filesystem::copy_options::recursive);
    const int64_t vocab = load_fixture("qwen3_f32").vocab;
    write_byte_level_tokenizer(dir.path(), vocab);
    EngineOptions options = engine_options(dir.path().string());
    options.speculative_config = R"({"method": "ngram", "num_speculative_tokens": 3})";
    std::unique_ptr<Engine> engine = Engine::create(options);
    ASSERT_TRUE(engine->has_tokenizer());
    const OwnServer own = serve(*engine, "qwen3-test");
    httplib::Client& client = *own.client;

    // Expected: stop at the first token whose text completes the bytes of reference tokens 4 and 5.
    const std::string stop = test_token_bytes(ref_b_[4], vocab) + test_token_bytes(ref_b_[5], vocab);
    std::string text;
    size_t end = 0;
    for (; end < ref_b_.size(); ++end) {
        text += test_token_bytes(ref_b_[end], vocab);
        if (text.find(stop) != std::string::npos) break;
    }
    ASSERT_LE(end, size_t(5));
    const std::vector<int32_t> expected(ref_b_.begin(), ref_b_.begin() + end + 1);
    const std::string expected_text = to_valid_utf8(text.substr(0, text.find(stop)));

    json body = request(prompt_b_, 12);
    body["stop"] = {"never in this text", stop};
    auto res = client.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    json out = json::parse(res->body);
    EXPECT_EQ(out["choices"][0]["token_ids"].get<std::vector<int32_t>>(), expected);
    EXPECT_EQ(out["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(out["choices"][0]["text"], expected_text);

    body["stream"] = true;
    res = client.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(res);
    std::vector<int32_t> streamed;
    std::string streamed_text, last_finish;
    std::istringstream events(res->body);
    for (std::string line; std::getline(events, line);) {
        if (line.rfind("data: {", 0) != 0) continue;
        const json chunk = json::parse(line.substr(6));
        const auto ids = chunk["choices"][0]["token_ids"].get<std::vector<int32_t>>();
        streamed.insert(streamed.end(), ids.begin(), ids.end());
        streamed_text += chunk["choices"][0]["text"].get<std::string>();
        if (!chunk["choices"][0]["finish_reason"].is_null()) last_finish = chunk["choices"][0]["finish_reason"];
    }
    EXPECT_EQ(streamed, expected);
    EXPECT_EQ(streamed_text, expected_text);
    EXPECT_EQ(last_finish, "stop");

#if XINFER_HAS_ICU
    // A text prompt is the token-id prompt its tokenizer encodes it to (this tokenizer has no
    // merges: one id per byte).
    json text_body = request({}, 6);
    text_body["prompt"] = "hello world";
    json ids_body = request({'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'}, 6);
    const auto by_text = client.Post("/v1/completions", text_body.dump(), "application/json");
    const auto by_ids = client.Post("/v1/completions", ids_body.dump(), "application/json");
    ASSERT_TRUE(by_text && by_ids);
    ASSERT_EQ(by_text->status, 200) << by_text->body;
    EXPECT_EQ(json::parse(by_text->body)["choices"][0]["token_ids"], json::parse(by_ids->body)["choices"][0]["token_ids"]);
    EXPECT_EQ(json::parse(by_text->body)["usage"]["prompt_tokens"], 11);
#endif
    // Without stop strings the text is the whole completion's.
    res = client.Post("/v1/completions", request(prompt_b_, 12).dump(), "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(json::parse(res->body)["choices"][0]["text"], to_valid_utf8([&] {
                  std::string all;
                  for (int32_t id : ref_b_) all += vocab - 1 == id ? "" : test_token_bytes(id, vocab);
                  return all;
              }()));
}

// `xinfer serve --profile`: every step until stop() lands in the Chrome trace.
class ProfiledServerTest : public ServerTest {
protected:
    void SetUp() override {
        profile_path_ = (std::filesystem::temp_directory_path() / "xinfer_serve_profile_test.json").string();
        std::filesystem::remove(profile_path_);
        ServerTest::SetUp();
    }
};

TEST_F(ProfiledServerTest, WritesTheTraceAtStop) {
    ASSERT_EQ(post(request(prompt_a_, 4))->status, 200);
    const std::string summary = server_->stop();
    EXPECT_NE(summary.find("matmul"), std::string::npos) << summary;
    std::ifstream in(profile_path_);
    ASSERT_TRUE(in) << profile_path_;
    const json trace = json::parse(in, nullptr, false);
    ASSERT_FALSE(trace.is_discarded());
    ASSERT_TRUE(trace.contains("traceEvents"));
    size_t ops = 0, device_ops = 0;
    for (const json& e : trace["traceEvents"]) {
        ops += e.value("ph", "") == "X";
        device_ops += e.value("cat", "") == "device";
    }
    EXPECT_GT(ops, 50u);
    if (test_device() != "cpu") {
        EXPECT_GT(device_ops, 50u) << "no device timeline (CUDA events)";
    }
    std::filesystem::remove(profile_path_);
}

}  // namespace
}  // namespace xinfer::test
