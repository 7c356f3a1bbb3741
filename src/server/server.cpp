#include "server/server.h"

#include "server/chat_protocol.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "tokenizer/chat_template.h"

#include <fmt/format.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <deque>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

namespace xinfer {
namespace {

using json = nlohmann::json;

// What the engine thread hands a waiting handler for one submitted prompt.
struct Update {
    std::vector<int32_t> tokens;
    bool finished = false;
    std::string finish_reason;
    std::string text;  // the text this step made final (with a tokenizer)
};

// One prompt's queue: filled by the engine's stream callback, drained by its HTTP handler.
struct PromptStream {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Update> updates;
    uint64_t id = 0;
    int64_t prompt_tokens = 0;

    void push(const RequestOutput& out) {
        {
            std::lock_guard<std::mutex> lock(mutex);
            updates.push_back({out.new_tokens, out.finished, out.finish_reason, out.text});
        }
        cv.notify_all();
    }
    Update pop() {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [&] { return !updates.empty(); });
        Update u = std::move(updates.front());
        updates.pop_front();
        return u;
    }
};

int64_t unix_seconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void send_json(httplib::Response& res, int status, const json& body) {
    res.status = status;
    res.set_content(body.dump(), "application/json");
}

void send_error(httplib::Response& res, int status, const std::string& message) {
    const char* type = status == 404 ? "NotFoundError" : status >= 500 ? "InternalServerError" : "BadRequestError";
    send_json(res, status, error_body(message, type, status));
}

}  // namespace

struct Server::Impl {
    Engine& engine;
    ServerOptions options;
    httplib::Server http;
    std::thread listener, engine_thread;
    std::atomic<bool> stopping{false};
    bool started = false, stopped = false;
    std::string profile_summary;

    // Wakes the engine thread when a request arrives.
    std::mutex loop_mutex;
    std::condition_variable loop_cv;
    bool wake = false;

    // Requests in flight (aborted at stop or when a step fails) and the request counters of /metrics.
    std::mutex requests_mutex;
    std::set<uint64_t> in_flight;
    RequestCounters counters;
    std::atomic<uint64_t> next_completion{1};
    std::mutex seed_mutex;
    std::mt19937_64 seeds{std::random_device{}()};
    uint64_t seed_source() {
        std::lock_guard<std::mutex> lock(seed_mutex);
        return seeds();
    }

    std::unique_ptr<ChatTemplate> chat_template;  // null: the chat route says which template is missing

    Impl(Engine& e, ServerOptions o) : engine(e), options(std::move(o)) {
        if (!options.chat_template.empty()) {
            chat_template = make_chat_template(options.chat_template);
            if (!chat_template)
                throw std::invalid_argument(fmt::format("unknown chat template '{}'; the built-in ones are {}",
                                                        options.chat_template, builtin_chat_template_names()));
        }
    }

    void engine_loop();
    std::shared_ptr<PromptStream> submit(const std::vector<int32_t>& prompt, const CompletionRequest& request);
    std::string submit_choices(const std::vector<std::vector<int32_t>>& prompts, const CompletionRequest& request,
                               std::vector<std::shared_ptr<PromptStream>>& streams);
    void finished(const PromptStream& stream, const std::string& reason, int64_t generated);
    void abort(const PromptStream& stream);
    void drain_aborted(const std::vector<std::shared_ptr<PromptStream>>& streams, size_t from,
                       const std::vector<int64_t>& generated);
    void complete(const httplib::Request& req, httplib::Response& res);
    void chat(const httplib::Request& req, httplib::Response& res);
    std::vector<int32_t> end_of_turn_ids() const;
    void routes();
};

void Server::Impl::engine_loop() {
    if (!options.profile_path.empty()) engine.start_profile();
    while (!stopping) {
        if (engine.has_work()) {
            try {
                engine.step();
            } catch (const std::exception& e) {
                // The step's requests cannot go on; end them so their clients get an answer.
                fmt::print(stderr, "xinfer serve: engine step failed: {}\n", e.what());
                std::set<uint64_t> ids;
                {
                    std::lock_guard<std::mutex> lock(requests_mutex);
                    ids = in_flight;
                }
                for (uint64_t id : ids) engine.abort(id);
            }
            continue;
        }
        std::unique_lock<std::mutex> lock(loop_mutex);
        loop_cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return wake || stopping.load(); });
        wake = false;
    }
    if (!options.profile_path.empty()) profile_summary = engine.stop_profile(options.profile_path);
}

// Submits one prompt; throws the engine's reason (prompt too long, token outside the vocabulary).
std::shared_ptr<PromptStream> Server::Impl::submit(const std::vector<int32_t>& prompt, const CompletionRequest& request) {
    auto stream = std::make_shared<PromptStream>();
    stream->prompt_tokens = int64_t(prompt.size());
    // The callback runs on the engine thread; it only queues.
    stream->id = engine.submit(prompt, request.sampling, request.max_tokens, request.stop_token_ids,
                               [stream](const RequestOutput& out) { stream->push(out); });
    {
        std::lock_guard<std::mutex> lock(requests_mutex);
        in_flight.insert(stream->id);
    }
    {
        std::lock_guard<std::mutex> lock(loop_mutex);
        wake = true;
    }
    loop_cv.notify_one();
    return stream;
}

void Server::Impl::finished(const PromptStream& stream, const std::string& reason, int64_t generated) {
    std::lock_guard<std::mutex> lock(requests_mutex);
    in_flight.erase(stream.id);
    counters.prompt_tokens += stream.prompt_tokens;
    counters.generation_tokens += generated;
    ++counters.finished[reason];
}

// A client gone mid-request: free its pages now. The engine's abort event follows on the queue.
void Server::Impl::abort(const PromptStream& stream) { engine.abort(stream.id); }

// A stream ended early (client gone, write failed, server stopping): aborts the choices from
// `from` on and drains their queues, so every page is freed and the counters are complete.
void Server::Impl::drain_aborted(const std::vector<std::shared_ptr<PromptStream>>& streams, size_t from,
                                 const std::vector<int64_t>& generated) {
    for (size_t i = from; i < streams.size(); ++i) {
        abort(*streams[i]);
        int64_t total = generated[i];
        for (;;) {
            Update u = streams[i]->pop();
            total += int64_t(u.tokens.size());
            if (u.finished) break;
        }
        finished(*streams[i], "abort", total);
    }
}

// n choices per prompt, choice p·n + j; with a seed s, choice j samples with seed s + j (so the n
// choices differ, and the request stays reproducible). Returns the engine's reason when it
// refuses one (the batch is then refused whole), else "".
std::string Server::Impl::submit_choices(const std::vector<std::vector<int32_t>>& prompts,
                                         const CompletionRequest& request,
                                         std::vector<std::shared_ptr<PromptStream>>& streams) {
    try {
        for (const std::vector<int32_t>& prompt : prompts)
            for (int j = 0; j < request.n; ++j) {
                CompletionRequest choice = request;
                choice.sampling.seed = request.sampling.seed + uint64_t(j);
                streams.push_back(submit(prompt, choice));
            }
    } catch (const std::exception& e) {
        for (const auto& s : streams) abort(*s);
        for (const auto& s : streams) {
            while (!s->pop().finished) {
            }
            finished(*s, "abort", 0);
        }
        streams.clear();
        return e.what();
    }
    return "";
}

void Server::Impl::complete(const httplib::Request& req, httplib::Response& res) {
    ParsedCompletion parsed = parse_completion_request(req.body);
    if (!parsed.error.empty()) return send_error(res, 400, parsed.error);
    CompletionRequest request = std::move(parsed.request);
    // Without a seed, sampled requests differ from each other (OpenAI's behaviour).
    if (!request.seeded) request.sampling.seed = seed_source();
    if (!request.model.empty() && request.model != options.model_name)
        return send_error(res, 404, fmt::format("the model '{}' does not exist; this server serves '{}'", request.model,
                                                options.model_name));

    // String prompts: encoded with the model's tokenizer (a 400 when it has none or cannot).
    for (size_t i = 0; i < request.text_prompts.size(); ++i) {
        try {
            std::vector<int32_t> ids = engine.encode(request.text_prompts[i]);
            if (ids.empty()) return send_error(res, 400, fmt::format("prompt[{}] encodes to no tokens", i));
            request.prompts.push_back(std::move(ids));
        } catch (const std::exception& e) {
            return send_error(res, 400, e.what());
        }
    }

    std::vector<std::shared_ptr<PromptStream>> streams;
    const std::string refused = submit_choices(request.prompts, request, streams);
    if (!refused.empty()) return send_error(res, 400, refused);
    const std::string id = fmt::format("cmpl-{}", next_completion.fetch_add(1));
    const int64_t created = unix_seconds();
    const std::string& model = options.model_name;

    if (!request.stream) {
        std::vector<ChoiceResult> choices(streams.size());
        for (size_t i = 0; i < streams.size(); ++i) {
            choices[i].prompt_tokens = streams[i]->prompt_tokens;
            for (;;) {
                Update u = streams[i]->pop();
                choices[i].token_ids.insert(choices[i].token_ids.end(), u.tokens.begin(), u.tokens.end());
                choices[i].text += u.text;
                if (u.finished) {
                    choices[i].finish_reason = u.finish_reason;
                    break;
                }
            }
            finished(*streams[i], choices[i].finish_reason, int64_t(choices[i].token_ids.size()));
        }
        return send_json(res, 200, completion_body(id, created, model, choices));
    }

    // Server-sent events: one chunk per engine step that gave a prompt tokens, in prompt order
    // (each prompt is drained to its end before the next: prompts of one request run together
    // in the engine, so later ones are mostly done by then), then the usage chunk if asked, then
    // [DONE]. The provider runs on the handler's worker thread after this function returns.
    struct StreamState {
        std::vector<std::shared_ptr<PromptStream>> streams;
        std::vector<ChoiceResult> choices;
        size_t current = 0;
        bool done = false;
    };
    auto state = std::make_shared<StreamState>();
    state->streams = streams;
    state->choices.resize(streams.size());
    for (size_t i = 0; i < streams.size(); ++i) state->choices[i].prompt_tokens = streams[i]->prompt_tokens;
    const bool include_usage = request.include_usage;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, state, id, created, model, include_usage](size_t, httplib::DataSink& sink) {
            const auto send = [&](const std::string& data) {
                const std::string event = "data: " + data + "\n\n";
                return sink.write(event.data(), event.size());
            };
            if (state->current == state->streams.size()) {
                if (include_usage) send(usage_chunk(id, created, model, state->choices).dump());
                send("[DONE]");
                sink.done();
                state->done = true;
                return true;
            }
            const size_t i = state->current;
            Update u = state->streams[i]->pop();
            ChoiceResult& choice = state->choices[i];
            choice.token_ids.insert(choice.token_ids.end(), u.tokens.begin(), u.tokens.end());
            if (u.finished) {
                choice.finish_reason = u.finish_reason;
                finished(*state->streams[i], u.finish_reason, int64_t(choice.token_ids.size()));
                ++state->current;
            }
            if (u.tokens.empty() && !u.finished) return true;
            return send(completion_chunk(id, created, model, int(i), u.tokens, u.finish_reason, u.text).dump());
        },
        [this, state](bool) {
            std::vector<int64_t> generated;
            for (const ChoiceResult& c : state->choices) generated.push_back(int64_t(c.token_ids.size()));
            drain_aborted(state->streams, state->current, generated);
        });
}

// The ids that end an assistant turn in the ChatML family (<|im_end|>, <|endoftext|>): those the
// tokenizer has as single tokens. Generation stops after one (it is special: not in the text).
std::vector<int32_t> Server::Impl::end_of_turn_ids() const {
    std::vector<int32_t> ids;
    for (const char* token : {"<|im_end|>", "<|endoftext|>"}) {
        try {
            const std::vector<int32_t> encoded = engine.encode(token);
            if (encoded.size() == 1) ids.push_back(encoded[0]);
        } catch (const std::exception&) {  // a vocabulary that cannot spell it does not have it as a token
        }
    }
    return ids;
}

void Server::Impl::chat(const httplib::Request& req, httplib::Response& res) {
    if (!chat_template)
        return send_error(res, 501,
                          fmt::format("chat completions need a chat template, and the model's architecture '{}' has "
                                      "no built-in one (built in: {}); if the model uses one of those formats, start "
                                      "the server with --chat-template NAME, or use /v1/completions with the prompt "
                                      "already formatted",
                                      options.architecture.empty() ? "unknown" : options.architecture,
                                      builtin_chat_template_names()));
    if (!engine.has_tokenizer())
        return send_error(res, 400,
                          "chat completions need the model's tokenizer.json (the prompt is text); this model directory "
                          "has none");
    ParsedChat parsed = parse_chat_request(req.body);
    if (!parsed.error.empty()) return send_error(res, 400, parsed.error);
    ChatRequest chat_request = std::move(parsed.request);
    CompletionRequest& request = chat_request.sampling;
    if (!request.seeded) request.sampling.seed = seed_source();
    if (!request.model.empty() && request.model != options.model_name)
        return send_error(res, 404, fmt::format("the model '{}' does not exist; this server serves '{}'", request.model,
                                                options.model_name));

    std::vector<int32_t> prompt;
    try {
        prompt = engine.encode(chat_template->render(chat_request.conversation));
        const std::vector<int32_t> end_ids = end_of_turn_ids();
        request.stop_token_ids.insert(request.stop_token_ids.end(), end_ids.begin(), end_ids.end());
    } catch (const std::exception& e) {  // the template's or the encoder's reason
        return send_error(res, 400, e.what());
    }
    if (request.max_tokens == 0)  // none asked: the rest of the context
        request.max_tokens = int(std::max<int64_t>(1, engine.stats().max_model_len - int64_t(prompt.size())));

    std::vector<std::shared_ptr<PromptStream>> streams;
    const std::string refused = submit_choices({prompt}, request, streams);
    if (!refused.empty()) return send_error(res, 400, refused);
    const uint64_t number = next_completion.fetch_add(1);
    const std::string id = fmt::format("chatcmpl-{}", number);
    const int64_t created = unix_seconds();
    const std::string& model = options.model_name;
    const int64_t prompt_tokens = int64_t(prompt.size());
    ChatOutputOptions output_options;
    output_options.thinking = chat_template->thinking_enabled(chat_request.conversation);
    if (chat_request.tools_enabled)
        output_options.tool_calls = std::string(chat_template->tool_call_format()) == "mimo_xml"
                                        ? ToolCallFormat::mimo_xml
                                        : ToolCallFormat::hermes;
    output_options.tools = chat_request.conversation.tools;
    output_options.parallel_tool_calls = chat_request.parallel_tool_calls;
    // Tool-call ids: unique per server run (the completion number), numbered within a choice.
    const auto call_ids = [number](size_t choice, size_t count) {
        std::vector<std::string> ids;
        for (size_t k = 0; k < count; ++k) ids.push_back(fmt::format("call_{}_{}_{}", number, choice, k));
        return ids;
    };

    if (!request.stream) {
        std::vector<ChatChoiceResult> choices(streams.size());
        for (size_t i = 0; i < streams.size(); ++i) {
            std::string text, reason;
            for (;;) {
                Update u = streams[i]->pop();
                choices[i].completion_tokens += int64_t(u.tokens.size());
                text += u.text;
                if (u.finished) {
                    reason = u.finish_reason;
                    break;
                }
            }
            finished(*streams[i], reason, choices[i].completion_tokens);
            choices[i].message = ChatOutputParser::parse(output_options, text);
            choices[i].tool_call_ids = call_ids(i, choices[i].message.tool_calls.size());
            choices[i].finish_reason = chat_finish_reason(reason, int(choices[i].message.tool_calls.size()));
        }
        return send_json(res, 200, chat_completion_body(id, created, model, prompt_tokens, choices));
    }

    // Server-sent events, choice after choice (as completions): a role delta, then per engine
    // step the deltas its text settles (chat_deltas), then a finish delta; the usage chunk if
    // asked; [DONE].
    struct ChatStreamState {
        std::vector<std::shared_ptr<PromptStream>> streams;
        std::vector<int64_t> generated;
        std::unique_ptr<ChatOutputParser> parser;  // of the current choice
        size_t current = 0;
    };
    auto state = std::make_shared<ChatStreamState>();
    state->streams = streams;
    state->generated.assign(streams.size(), 0);
    const bool include_usage = request.include_usage;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, state, id, created, model, include_usage, prompt_tokens, output_options, call_ids](size_t,
                                                                                                  httplib::DataSink& sink) {
            const auto send = [&](const std::string& data) {
                const std::string event = "data: " + data + "\n\n";
                return sink.write(event.data(), event.size());
            };
            if (state->current == state->streams.size()) {
                int64_t completion_tokens = 0;
                for (int64_t g : state->generated) completion_tokens += g;
                if (include_usage) send(chat_usage_chunk(id, created, model, prompt_tokens, completion_tokens).dump());
                send("[DONE]");
                sink.done();
                return true;
            }
            const size_t i = state->current;
            if (!state->parser) {
                state->parser = std::make_unique<ChatOutputParser>(output_options);
                if (!send(chat_chunk(id, created, model, int(i), {{"role", "assistant"}, {"content", ""}}).dump()))
                    return false;
            }
            Update u = state->streams[i]->pop();
            state->generated[i] += int64_t(u.tokens.size());
            ChatOutputParser& parser = *state->parser;
            const int calls_before = parser.tool_calls_so_far();
            ChatOutputDelta step = parser.feed(u.text);
            if (u.finished) {
                ChatOutputDelta last = parser.finish();
                step.reasoning += last.reasoning;
                step.content += last.content;
                step.tool_calls.insert(step.tool_calls.end(), last.tool_calls.begin(), last.tool_calls.end());
            }
            const std::vector<std::string> ids = call_ids(i, size_t(parser.tool_calls_so_far()));
            for (const json& delta : chat_deltas(step, calls_before, ids))
                if (!send(chat_chunk(id, created, model, int(i), delta).dump())) return false;
            if (u.finished) {
                const std::string reason = chat_finish_reason(u.finish_reason, parser.tool_calls_so_far());
                finished(*state->streams[i], u.finish_reason, state->generated[i]);
                ++state->current;
                state->parser.reset();
                return send(chat_chunk(id, created, model, int(i), json::object(), reason).dump());
            }
            return true;
        },
        [this, state](bool) { drain_aborted(state->streams, state->current, state->generated); });
}

void Server::Impl::routes() {
    http.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("", "text/plain"); });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
        const EngineStats stats = engine.stats();
        json model = {{"id", options.model_name},
                      {"object", "model"},
                      {"created", unix_seconds()},
                      {"owned_by", "xinfer"},
                      {"root", options.model_name},
                      {"max_model_len", stats.max_model_len}};
        send_json(res, 200, {{"object", "list"}, {"data", json::array({model})}});
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
        RequestCounters counters_now;
        {
            std::lock_guard<std::mutex> lock(requests_mutex);
            counters_now = counters;
        }
        res.set_content(prometheus_metrics(engine.stats(), options.model_name, &counters_now),
                        "text/plain; version=0.0.4; charset=utf-8");
    });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { complete(req, res); });
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) { chat(req, res); });
    // Called for every status ≥ 400; only the library's own (no route, unreadable request) lack a body.
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return;
        if (res.status == 404) send_error(res, 404, fmt::format("no route {} {}", req.method, req.path));
        else send_error(res, res.status, fmt::format("{} {}: HTTP {}", req.method, req.path, res.status));
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
            std::rethrow_exception(ep);
        } catch (const std::exception& e) {
            what = e.what();
        } catch (...) {
        }
        send_error(res, 500, what);
    });
}

Server::Server(Engine& engine, ServerOptions options) : impl_(std::make_unique<Impl>(engine, std::move(options))) {}

Server::~Server() { stop(); }

int Server::start() {
    Impl& s = *impl_;
    if (s.started) throw std::runtime_error("Server::start: already started");
    // A client that hangs up while its stream is written must not end the process.
    std::signal(SIGPIPE, SIG_IGN);
    s.routes();
    const int port = s.options.port == 0 ? s.http.bind_to_any_port(s.options.host)
                                         : (s.http.bind_to_port(s.options.host, s.options.port) ? s.options.port : -1);
    if (port < 0)
        throw std::runtime_error(fmt::format("xinfer serve: cannot listen on {}:{}", s.options.host, s.options.port));
    s.started = true;
    s.engine_thread = std::thread([&s] { s.engine_loop(); });
    s.listener = std::thread([&s] { s.http.listen_after_bind(); });
    return port;
}

std::string Server::stop() {
    Impl& s = *impl_;
    if (!s.started || s.stopped) return s.profile_summary;
    s.stopped = true;
    // Requests in flight end with "abort"; their handlers answer and finish before the listener
    // joins its workers.
    std::set<uint64_t> ids;
    {
        std::lock_guard<std::mutex> lock(s.requests_mutex);
        ids = s.in_flight;
    }
    for (uint64_t id : ids) s.engine.abort(id);
    s.http.stop();
    if (s.listener.joinable()) s.listener.join();
    s.stopping = true;
    s.loop_cv.notify_one();
    if (s.engine_thread.joinable()) s.engine_thread.join();
    return s.profile_summary;
}

}  // namespace xinfer
