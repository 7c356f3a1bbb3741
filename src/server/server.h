// xinfer's HTTP server: an Engine behind the OpenAI completions API (openai_protocol.h) and chat
// completions API (chat_protocol.h: a built-in chat template, reasoning and tool-call parsing),
// plus GET /v1/models, /health and /metrics.
//
// Threads: one engine thread calls Engine::step() while there is work and sleeps otherwise; the
// HTTP library's worker threads parse requests, submit them, and wait on a per-request queue
// that the engine's stream callback fills. A client that disconnects mid-stream has its request
// aborted (every KV page freed at once). Bad requests get a 4xx naming the reason; nothing a
// client sends stops the server.
#pragma once

#include "xinfer/engine.h"

#include <memory>
#include <string>

namespace xinfer {

struct ServerOptions {
    std::string host = "127.0.0.1";
    int port = 8000;            // 0: any free port (start() returns the one bound)
    std::string model_name;     // the served model's name (/v1/models; requests naming another get a 404)
    // Non-empty: every engine step from start() to stop() is profiled (Engine::start_profile; the
    // steps run eagerly) and stop() writes the Chrome trace here.
    std::string profile_path;
    // The chat template of /v1/chat/completions: a built-in name ("qwen3", "mimo";
    // tokenizer/chat_template.h), or empty: the chat route answers 501 naming `architecture`,
    // which has none. An unknown name is an error at construction.
    std::string chat_template;
    std::string architecture;  // config.json architectures[0], for that message
};

class Server {
public:
    Server(Engine& engine, ServerOptions options);
    ~Server();  // stop()

    // Binds, starts the engine thread and the listener; returns the bound port. Throws when the
    // address cannot be bound.
    int start();
    // Idempotent: stops accepting, aborts requests in flight, ends the engine thread and writes
    // the profile. Returns the profile's per-op summary ("" without --profile).
    std::string stop();

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace xinfer
