#include "server/server.h"

#include "server/metrics.h"
#include "server/openai_protocol.h"

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

    Impl(Engine& e, ServerOptions o) : engine(e), options(std::move(o)) {}

    void engine_loop();
    std::shared_ptr<PromptStream> submit(const std::vector<int32_t>& prompt, const CompletionRequest& request);
    void finished(const PromptStream& stream, const std::string& reason, int64_t generated);
    void abort(const PromptStream& stream);
    void complete(const httplib::Request& req, httplib::Response& res);
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

    // n choices per prompt, choice p·n + j; with a seed s, choice j samples with seed s + j (so the
    // n choices differ, and the request stays reproducible).
    std::vector<std::shared_ptr<PromptStream>> streams;
    try {
        for (const std::vector<int32_t>& prompt : request.prompts)
            for (int j = 0; j < request.n; ++j) {
                CompletionRequest choice = request;
                choice.sampling.seed = request.sampling.seed + uint64_t(j);
                streams.push_back(submit(prompt, choice));
            }
    } catch (const std::exception& e) {
        for (const auto& s : streams) abort(*s);  // the batch is refused whole
        for (const auto& s : streams) {
            while (!s->pop().finished) {
            }
            finished(*s, "abort", 0);
        }
        return send_error(res, 400, e.what());
    }
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
            // Ended early (client gone, write failed, server stopping): abort what is still running
            // and drain its queue, so every page is freed and the counters are complete.
            for (size_t i = state->current; i < state->streams.size(); ++i) {
                const PromptStream& s = *state->streams[i];
                abort(s);
                int64_t generated = int64_t(state->choices[i].token_ids.size());
                for (;;) {
                    Update u = state->streams[i]->pop();
                    generated += int64_t(u.tokens.size());
                    if (u.finished) break;
                }
                finished(s, "abort", generated);
            }
        });
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
    http.Post("/v1/chat/completions", [](const httplib::Request&, httplib::Response& res) {
        send_error(res, 501,
                   "chat completions need the model's chat template, which xinfer cannot render yet; use "
                   "/v1/completions with the prompt already formatted (text, with the model's tokenizer.json, or "
                   "token ids)");
    });
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
