// /v1/chat/completions end to end on the tiny fixtures (CPU, or XINFER_TEST_DEVICE), and issue
// 5's "speculation composes with tool calling".
//
// The fixtures' random weights write random tokens, so each test builds a tokenizer around what
// the model greedily writes: the chat prompt is rendered and encoded with a byte-level
// tokenizer, the model's greedy continuation is read, and a second tokenizer keeps the prompt's
// bytes where they were and spells the continuation's tokens as pieces of a chosen reply (reasoning
// and a tool call), the token after them as <|endoftext|> (which ends the turn). The chat route
// must then answer with that reasoning and that call, streamed and not, with no speculation, with
// n-gram speculation, with an oracle drafter that makes every step emit several tokens (so markers
// land mid-delta), and on MiMo with its MTP heads and with a DFlash drafter.
#include "byte_level_tokenizer.h"
#include "models/model_test_util.h"
#include "runtime/engine_impl.h"
#include "server/chat_protocol.h"
#include "server/server.h"
#include "tokenizer/chat_template.h"
#include "unit/safetensors_test_writer.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <sstream>

namespace xinfer::test {
namespace {

using json = nlohmann::json;

// A server over an engine, stopped when it goes out of scope.
struct ChatServer {
    std::unique_ptr<Server> server;
    std::unique_ptr<httplib::Client> client;
    ChatServer(Engine& engine, const std::string& chat_template, const std::string& architecture = "") {
        ServerOptions options;
        options.port = 0;
        options.model_name = "chat-test";
        options.chat_template = chat_template;
        options.architecture = architecture;
        server = std::make_unique<Server>(engine, options);
        client = std::make_unique<httplib::Client>("127.0.0.1", server->start());
        client->set_read_timeout(120, 0);
    }
    ~ChatServer() { server->stop(); }
    httplib::Result post(const json& body) { return client->Post("/v1/chat/completions", body.dump(), "application/json"); }
};

// What a chat reply adds up to: the non-streamed message, or the streamed deltas joined.
struct Reply {
    std::string reasoning, content, finish_reason;
    std::vector<std::pair<std::string, std::string>> calls;  // name, arguments
    std::set<std::string> call_ids;
    int64_t completion_tokens = -1;
};

Reply reply_of(const json& body) {
    Reply r;
    const json& choice = body["choices"][0];
    const json& m = choice["message"];
    EXPECT_EQ(m["reasoning"], m["reasoning_content"]);
    if (!m["reasoning_content"].is_null()) r.reasoning = m["reasoning_content"];
    if (!m["content"].is_null()) r.content = m["content"];
    if (m.contains("tool_calls"))
        for (const json& c : m["tool_calls"]) {
            r.calls.emplace_back(c["function"]["name"], c["function"]["arguments"]);
            r.call_ids.insert(c["id"].get<std::string>());
        }
    r.finish_reason = choice["finish_reason"];
    r.completion_tokens = body["usage"]["completion_tokens"];
    return r;
}

// Joins an SSE stream's deltas, checking the chunk protocol on the way: role first, a call's
// name before its arguments, one finish chunk, the usage chunk, [DONE] last.
Reply reply_of_stream(const std::string& sse) {
    Reply r;
    std::istringstream events(sse);
    bool role_seen = false, done = false;
    std::map<int, size_t> call_at;  // tool-call index → position in r.calls
    for (std::string line; std::getline(events, line);) {
        if (line.rfind("data: ", 0) != 0) continue;
        const std::string data = line.substr(6);
        EXPECT_FALSE(done) << "an event after [DONE]";
        if (data == "[DONE]") {
            done = true;
            continue;
        }
        const json chunk = json::parse(data);
        EXPECT_EQ(chunk["object"], "chat.completion.chunk");
        if (chunk["choices"].empty()) {
            r.completion_tokens = chunk["usage"]["completion_tokens"];
            continue;
        }
        const json& choice = chunk["choices"][0];
        const json& delta = choice["delta"];
        if (delta.contains("role")) {
            EXPECT_FALSE(role_seen);
            role_seen = true;
        } else {
            EXPECT_TRUE(role_seen) << "a delta before the role";
        }
        if (delta.contains("reasoning_content")) {
            EXPECT_EQ(delta["reasoning"], delta["reasoning_content"]);
            r.reasoning += delta["reasoning_content"].get<std::string>();
        }
        if (delta.contains("content")) r.content += delta["content"].get<std::string>();
        if (delta.contains("tool_calls"))
            for (const json& c : delta["tool_calls"]) {
                const int index = c["index"];
                if (c.contains("id")) {
                    EXPECT_FALSE(call_at.count(index)) << "call " << index << " named twice";
                    call_at[index] = r.calls.size();
                    r.calls.emplace_back(c["function"]["name"], "");
                    r.call_ids.insert(c["id"].get<std::string>());
                }
                EXPECT_TRUE(call_at.count(index)) << "arguments before the call's name";
                if (call_at.count(index)) r.calls[call_at[index]].second += c["function"]["arguments"].get<std::string>();
            }
        if (!choice["finish_reason"].is_null()) {
            EXPECT_TRUE(r.finish_reason.empty()) << "two finish chunks";
            r.finish_reason = choice["finish_reason"];
        }
    }
    EXPECT_TRUE(done);
    return r;
}

// A copy of a fixture whose tokenizer makes the model's greedy reply to `request` be `reply`
// followed by <|endoftext|>.
//
// The random fixtures fall into repeating one token after a few steps from most prompts, and a
// repeated token cannot spell different parts of a reply. So the rendered prompt is one added
// token, its id chosen among all ids for the longest run of distinct greedy tokens after it. That
// also makes the prompt exact: a route that rendered any other text would encode other ids.
struct ScriptedModel {
    TempDir dir;
    std::vector<int32_t> prompt;        // the rendered prompt's ids (one)
    std::vector<int32_t> continuation;  // the reply's tokens and the end token
};

// Engine options for a scripted model directory, on the test device.
EngineOptions engine_options(const ScriptedModel& m) {
    EngineOptions options;
    options.model_dir = m.dir.path().string();
    options.device = test_device();
    return options;
}

void script_model(ScriptedModel& m, const std::string& fixture, const std::string& chat_template, const json& request,
                  const std::string& reply) {
    std::filesystem::copy(fixture_dir(fixture), m.dir.path(), std::filesystem::copy_options::recursive);
    std::ifstream config_file(m.dir.path() / "config.json");
    const int64_t vocab = json::parse(config_file)["vocab_size"];
    const ParsedChat parsed = parse_chat_request(request.dump());
    ASSERT_EQ(parsed.error, "");
    const std::string prompt_text = make_chat_template(chat_template)->render(parsed.request.conversation);

    // The prompt id with the longest run of distinct greedy tokens after it.
    EngineOptions options = engine_options(m);
    std::vector<int32_t> generated;
    size_t usable = 0;
    {
        options.max_num_seqs = 64;
        std::unique_ptr<Engine> engine = Engine::create(options);
        for (int32_t first = 0; first < vocab && usable < 20; first += 64) {  // 64 candidates a batch
            std::map<int32_t, std::vector<int32_t>> greedy_after;
            for (int32_t x = first; x < std::min<int64_t>(vocab, first + 64); ++x)
                engine->submit({x}, {}, 32, {}, [&greedy_after, x](const RequestOutput& out) {
                    greedy_after[x].insert(greedy_after[x].end(), out.new_tokens.begin(), out.new_tokens.end());
                });
            while (engine->has_work()) engine->step();
            for (const auto& [x, g] : greedy_after) {
                std::set<int32_t> taken{x};
                size_t run = 0;
                while (run < g.size() && !taken.count(g[run])) taken.insert(g[run++]);
                if (run > usable) usable = run, generated = g, m.prompt = {x};
            }
        }
    }
    // Pieces of at least two bytes (single bytes are tokens of their own), distinct, in a varied
    // rhythm so that markers fall at different places within tokens.
    const size_t pieces = std::min(usable - 1, reply.size() / 3);
    ASSERT_GE(pieces, 6u) << "no prompt id is followed by enough distinct greedy tokens: "
                          << ::testing::PrintToString(generated);
    std::vector<std::string> spelled;
    const size_t rhythm[] = {2, 5, 3, 7, 2, 4, 9, 3};
    for (size_t i = 0, at = 0; i < pieces; ++i) {
        const size_t left = pieces - 1 - i;
        size_t n = i + 1 == pieces ? reply.size() - at : std::min(rhythm[i % 8], reply.size() - at - 2 * left);
        n = std::max<size_t>(n, 2);
        while (std::find(spelled.begin(), spelled.end(), reply.substr(at, n)) != spelled.end()) ++n;
        spelled.push_back(reply.substr(at, n));
        at += n;
        ASSERT_LE(at, reply.size());
        if (i + 1 == pieces) {
            ASSERT_EQ(at, reply.size());
        }
    }
    m.continuation.assign(generated.begin(), generated.begin() + long(pieces) + 1);

    // The tokenizer: the prompt's id is the prompt text (an added token), the reply's ids spell
    // its pieces, the next id is <|endoftext|>; the 256 bytes and fillers take the ids left.
    std::map<int32_t, std::string> pieces_by_id;
    std::set<int32_t> used(m.prompt.begin(), m.prompt.end());
    for (size_t i = 0; i < pieces; ++i) pieces_by_id[generated[i]] = spelled[i], used.insert(generated[i]);
    const int32_t end_id = generated[pieces];
    used.insert(end_id);
    int32_t next_free = 0;
    const auto free_id = [&] {
        while (used.count(next_free)) ++next_free;
        used.insert(next_free);
        return next_free;
    };
    for (int b = 0; b < 256; ++b) pieces_by_id[free_id()] = std::string(1, char(b));
    for (int32_t id = 0; id < vocab; ++id)
        if (!used.count(id)) pieces_by_id[id] = std::string("\x7f\x7f") + char(id % 128) + char(id / 128), used.insert(id);
    json v = json::object();
    for (const auto& [id, bytes] : pieces_by_id) {
        std::string key;
        for (char b : bytes) key += byte_level_char(uint8_t(b));
        ASSERT_FALSE(v.contains(key)) << "two ids spell the same piece";
        v[key] = id;
    }
    const json doc = {
        {"version", "1.0"},
        {"added_tokens",
         {{{"id", m.prompt[0]}, {"content", prompt_text}, {"special", false}},
          {{"id", end_id}, {"content", "<|endoftext|>"}, {"special", true}}}},
        {"normalizer", nullptr},
        {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
        {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}}},
        {"model", {{"type", "BPE"}, {"vocab", v}, {"merges", json::array()}}},
    };
    std::ofstream(m.dir.path() / "tokenizer.json") << doc.dump();
    std::unique_ptr<Engine> scripted = Engine::create(options);
    ASSERT_EQ(scripted->encode(prompt_text), m.prompt);
}

// Proposes the scripted continuation (every draft accepted under greedy): every verify step emits
// several tokens, so the text deltas the parsers see cut the reply at token boundaries mid-marker.
class OracleDrafter final : public Drafter {
public:
    explicit OracleDrafter(std::vector<int32_t> sequence) : sequence_(std::move(sequence)) {}
    const char* method() const override { return "oracle"; }
    int num_speculative_tokens() const override { return 5; }
    std::vector<std::vector<int32_t>> propose(std::span<const DraftRequest> requests) override {
        std::vector<std::vector<int32_t>> drafts;
        for (const DraftRequest& r : requests) {
            std::vector<int32_t> d;
            if (r.tokens.size() < sequence_.size() && std::equal(r.tokens.begin(), r.tokens.end(), sequence_.begin()))
                for (size_t i = r.tokens.size(); i < sequence_.size() && int(d.size()) < r.max_drafts; ++i)
                    d.push_back(sequence_[i]);
            drafts.push_back(std::move(d));
        }
        return drafts;
    }

private:
    std::vector<int32_t> sequence_;
};

// An engine over the scripted model with the oracle drafter (what Engine::create does, with a
// drafter it cannot name).
struct OracleEngine {
    LoadedModel loaded;
    std::unique_ptr<Runner> runner;
    std::unique_ptr<OracleDrafter> drafter;
    std::unique_ptr<Detokenizer> detokenizer;
    std::unique_ptr<Engine> engine;
    explicit OracleEngine(const ScriptedModel& m) : loaded(m.dir.path()) {
        RunnerOptions options;
        options.page_size = 4;
        options.n_pages = 512;
        runner = std::make_unique<Runner>(*loaded.model, *loaded.backend, options);
        std::vector<int32_t> sequence = m.prompt;
        sequence.insert(sequence.end(), m.continuation.begin(), m.continuation.end());
        drafter = std::make_unique<OracleDrafter>(sequence);
        const std::filesystem::path tokenizer = m.dir.path() / "tokenizer.json";
        detokenizer = std::make_unique<Detokenizer>(Detokenizer::load(tokenizer));
        auto impl = std::make_unique<Engine::Impl>(*runner, SchedulerOptions{4, 4096, 0}, drafter.get());
        impl->detokenizer = detokenizer.get();
        impl->encoder = std::make_unique<BpeEncoder>(BpeEncoder::load(tokenizer));
        engine = std::make_unique<Engine>(std::move(impl));
    }
};

// The reply through the chat route, streamed and not, must be `expected`.
void expect_reply(Engine& engine, const std::string& chat_template, json request, const Reply& expected,
                  const std::string& which) {
    ChatServer server(engine, chat_template);
    for (bool stream : {false, true}) {
        request["stream"] = stream;
        if (stream) request["stream_options"] = {{"include_usage", true}};
        else request.erase("stream_options");
        const auto res = server.post(request);
        ASSERT_TRUE(res) << which;
        ASSERT_EQ(res->status, 200) << which << ": " << res->body;
        const Reply got = stream ? reply_of_stream(res->body) : reply_of(json::parse(res->body));
        const std::string how = which + (stream ? ", streamed" : "");
        EXPECT_EQ(got.reasoning, expected.reasoning) << how;
        EXPECT_EQ(got.content, expected.content) << how;
        EXPECT_EQ(got.calls, expected.calls) << how;
        EXPECT_EQ(got.finish_reason, expected.finish_reason) << how;
        EXPECT_EQ(got.completion_tokens, expected.completion_tokens) << how;
        EXPECT_EQ(got.call_ids.size(), got.calls.size()) << how << ": call ids must differ";
    }
}

json weather_request() {
    return json::parse(R"({"model": "chat-test", "temperature": 0, "max_tokens": 60,
        "messages": [{"role": "system", "content": "You check the weather."},
                     {"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                   "days": {"type": "integer"}}, "required": ["city"]}}}]})");
}

TEST(ChatSpeculation, Qwen3ToolCallWithAndWithoutSpeculation) {
    const std::string reply =
        "<think>\nhm\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call>";
    ScriptedModel m;
    script_model(m, "qwen3_f32", "qwen3", weather_request(), reply);
    if (HasFatalFailure()) return;
    Reply expected;
    expected.reasoning = "\nhm\n";
    expected.calls = {{"get_weather", R"({"city": "Paris"})"}};
    expected.finish_reason = "tool_calls";
    expected.completion_tokens = int64_t(m.continuation.size());

    EngineOptions options = engine_options(m);
    std::unique_ptr<Engine> plain = Engine::create(options);
    expect_reply(*plain, "qwen3", weather_request(), expected, "no speculation");
    options.speculative_config = R"({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})";
    std::unique_ptr<Engine> ngram = Engine::create(options);
    expect_reply(*ngram, "qwen3", weather_request(), expected, "n-gram");
    OracleEngine oracle(m);
    expect_reply(*oracle.engine, "qwen3", weather_request(), expected, "oracle drafter");
    EXPECT_GT(oracle.engine->stats().spec.num_accepted_tokens, 0) << "the oracle's drafts were not accepted";

    // The same output with thinking off is all content: the call is still a call.
    json off = weather_request();
    off["chat_template_kwargs"] = {{"enable_thinking", false}};
    ScriptedModel m_off;
    script_model(m_off, "qwen3_f32", "qwen3", off,
                 "Checking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
    if (HasFatalFailure()) return;
    OracleEngine oracle_off(m_off);
    Reply content_and_call;
    content_and_call.content = "Checking.";
    content_and_call.calls = expected.calls;
    content_and_call.finish_reason = "tool_calls";
    content_and_call.completion_tokens = int64_t(m_off.continuation.size());
    expect_reply(*oracle_off.engine, "qwen3", off, content_and_call, "thinking off, oracle drafter");
}

TEST(ChatSpeculation, MiMoXmlToolCallWithMtpAndDFlash) {
    const std::string reply =
        "<think>\nhm\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    Reply expected;
    expected.reasoning = "\nhm\n";
    expected.calls = {{"get_weather", R"({"city": "Paris", "days": 3})"}};
    expected.finish_reason = "tool_calls";
    // MTP: mimo_mtp_f32 is mimo_hub_f32's target with 3 MTP heads.
    {
        ScriptedModel m;
        script_model(m, "mimo_mtp_f32", "mimo", weather_request(), reply);
        if (HasFatalFailure()) return;
        expected.completion_tokens = int64_t(m.continuation.size());
        EngineOptions options = engine_options(m);
        std::unique_ptr<Engine> plain = Engine::create(options);
        expect_reply(*plain, "mimo", weather_request(), expected, "mimo, no speculation");
        options.speculative_config = R"({"method": "mtp", "num_speculative_tokens": 3})";
        std::unique_ptr<Engine> mtp = Engine::create(options);
        expect_reply(*mtp, "mimo", weather_request(), expected, "mimo, MTP");
        EXPECT_GT(mtp->stats().spec.num_drafts, 0);
        OracleEngine oracle(m);
        expect_reply(*oracle.engine, "mimo", weather_request(), expected, "mimo, oracle drafter");
    }
    // DFlash: dflash_zlab drafts for mimo_native_f32.
    {
        ScriptedModel m;
        script_model(m, "mimo_native_f32", "mimo", weather_request(), reply);
        if (HasFatalFailure()) return;
        expected.completion_tokens = int64_t(m.continuation.size());
        EngineOptions options = engine_options(m);
        options.speculative_config =
            json({{"method", "dflash"}, {"model", fixture_dir("dflash_zlab").string()}}).dump();
        std::unique_ptr<Engine> dflash = Engine::create(options);
        expect_reply(*dflash, "mimo", weather_request(), expected, "mimo, DFlash");
        EXPECT_GT(dflash->stats().spec.num_drafts, 0);
    }
}

TEST(ChatServer, ErrorsAndPlainReplies) {
    ScriptedModel m;
    script_model(m, "qwen3_f32", "qwen3", weather_request(),
                 "<think>\nhm\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>");
    if (HasFatalFailure()) return;
    EngineOptions options = engine_options(m);
    std::unique_ptr<Engine> engine = Engine::create(options);
    {
        // No built-in template for the architecture: a 501 that names it, then completions still work.
        ChatServer none(*engine, "", "LlamaForCausalLM");
        const auto res = none.post(weather_request());
        ASSERT_TRUE(res);
        EXPECT_EQ(res->status, 501);
        EXPECT_NE(res->body.find("LlamaForCausalLM"), std::string::npos) << res->body;
        EXPECT_NE(res->body.find("--chat-template"), std::string::npos) << res->body;
    }
    EXPECT_THROW(ChatServer(*engine, "jinja"), std::invalid_argument);
    ChatServer server(*engine, "qwen3");
    const auto expect_400 = [&](const json& body, const std::string& reason) {
        const auto res = server.post(body);
        ASSERT_TRUE(res);
        EXPECT_EQ(res->status, 400) << body.dump();
        EXPECT_NE(res->body.find(reason), std::string::npos) << res->body;
    };
    json image = weather_request();
    image["messages"][1]["content"] = {{{"type", "image_url"}, {"image_url", {{"url", "http://x"}}}}};
    expect_400(image, "image input is not supported");
    json required = weather_request();
    required["tool_choice"] = "required";
    expect_400(required, "is not supported (only");
    json logprobs = weather_request();
    logprobs["logprobs"] = true;
    expect_400(logprobs, "'logprobs' is not supported");
    expect_400(json::parse(R"({"messages": []})"), "'messages' is required");
    const auto wrong_model = server.post(json::parse(R"({"model": "other", "messages": [{"role": "user", "content": "x"}]})"));
    ASSERT_TRUE(wrong_model);
    EXPECT_EQ(wrong_model->status, 404);

    // The server keeps serving: a call with no arguments is {} (the model wrote none), n choices.
    json two = weather_request();
    two["n"] = 2;
    const auto res = server.post(two);
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    const json body = json::parse(res->body);
    ASSERT_EQ(body["choices"].size(), 2u);
    for (const json& choice : body["choices"]) {
        EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["arguments"], "{}");
        EXPECT_EQ(choice["finish_reason"], "tool_calls");
    }
    EXPECT_NE(body["choices"][0]["message"]["tool_calls"][0]["id"], body["choices"][1]["message"]["tool_calls"][0]["id"]);
    EXPECT_EQ(body["usage"]["prompt_tokens"], m.prompt.size());

    // max_tokens cuts the reasoning: all of it is reasoning, finish "length", no call.
    json cut = weather_request();
    cut["max_tokens"] = 3;
    const auto short_res = server.post(cut);
    ASSERT_TRUE(short_res && short_res->status == 200);
    const Reply r = reply_of(json::parse(short_res->body));
    EXPECT_EQ(r.finish_reason, "length");
    EXPECT_TRUE(r.calls.empty());
    EXPECT_FALSE(r.reasoning.empty());
    EXPECT_EQ(r.content, "");
    // Without tools the call is content (and the prompt changes, so only the shape is checked).
    json no_tools = weather_request();
    no_tools.erase("tools");
    const auto plain_res = server.post(no_tools);
    ASSERT_TRUE(plain_res && plain_res->status == 200) << plain_res->body;
    EXPECT_FALSE(json::parse(plain_res->body)["choices"][0]["message"].contains("tool_calls"));
}

}  // namespace
}  // namespace xinfer::test
