// xinfer serve: the Engine behind an OpenAI-compatible HTTP API (src/server/server.h) until
// SIGINT or SIGTERM.
#include "commands.h"
#include "core/status.h"
#include "server/server.h"  // declarations only; builds without cpp-httplib lack server.cpp

#include <fmt/core.h>

#include <csignal>
#include <pthread.h>

namespace xinfer::cli {

void add_serve_command(CLI::App& app) {
    struct Options {
        ModelOptions model;
        EngineOptions engine;
        ServerOptions server;
    };
    auto options = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand(
        "serve", "Serve the model over HTTP: POST /v1/completions (token-id prompts), GET /v1/models, /health, /metrics");
    options->model.add_to(*cmd);
    cmd->add_option("--host", options->server.host, "Address to listen on")->default_val("127.0.0.1");
    cmd->add_option("--port", options->server.port, "Port to listen on (0: any free port)")->default_val(8000);
    cmd->add_option("--served-model-name", options->server.model_name, "Model name in the API (default: --model)");
    cmd->add_option("--max-num-seqs", options->engine.max_num_seqs, "Most sequences in a step")->default_val(64);
    cmd->add_option("--max-num-batched-tokens", options->engine.max_num_batched_tokens, "Token budget of a step")
        ->default_val(2048);
    cmd->add_option("--max-model-len", options->engine.max_model_len, "Longest sequence (0: the config's)")
        ->default_val(0);
    cmd->add_option("--kv-cache-dtype", options->engine.kv_cache_dtype,
                    "auto (the activation dtype), float32, bfloat16, fp8 (e4m3 + per-row scales)")
        ->default_val("auto");
    cmd->add_option("--gpu-memory-utilization", options->engine.gpu_memory_utilization,
                    "Share of device memory the plan may use")
        ->default_val(0.9);
    cmd->add_flag("--enable-prefix-caching", options->engine.enable_prefix_caching,
                  "Reuse the KV of shared prompt prefixes");
    cmd->add_option("--speculative-config", options->engine.speculative_config,
                    R"(Speculative decoding, as vLLM: '{"method":"ngram"|"mtp"|"dflash","model":DIR,"num_speculative_tokens":k}')");
    cmd->add_option("--profile", options->server.profile_path,
                    "Profile every engine step until shutdown and write the Chrome trace (Perfetto) to this .json "
                    "file (profiled steps run eagerly)");
    cmd->callback([options] {
#ifndef XINFER_HAS_HTTP_SERVER
        fail("this xinfer was built without the HTTP server: cpp-httplib was not found at build time (Debian: apt "
             "install libcpp-httplib-dev, or scripts/install_deps.sh), so rebuild after installing it");
#else
        EngineOptions engine_options = options->engine;
        engine_options.model_dir = options->model.model_dir;
        engine_options.device = options->model.device;
        engine_options.load_format = options->model.load_format;
        engine_options.dtype = options->model.dtype;
        engine_options.fp8_weights = options->model.fp8_weights;
        engine_options.enforce_eager = options->model.enforce_eager;
        if (options->model.max_cached_tokens > 0) engine_options.kv_cache_tokens = options->model.max_cached_tokens;
        ServerOptions server_options = options->server;
        if (server_options.model_name.empty()) server_options.model_name = options->model.model_dir;

        // SIGINT/SIGTERM are blocked in every thread (the engine's and the HTTP library's inherit
        // the mask) and taken here by sigwait, so shutdown runs on this thread, not in a handler.
        sigset_t signals;
        sigemptyset(&signals);
        sigaddset(&signals, SIGINT);
        sigaddset(&signals, SIGTERM);
        pthread_sigmask(SIG_BLOCK, &signals, nullptr);

        std::unique_ptr<Engine> engine = Engine::create(engine_options);
        Server server(*engine, server_options);
        const int port = server.start();
        fmt::print(stderr, "xinfer serve: {} on http://{}:{} (POST /v1/completions, GET /v1/models, /health, /metrics)\n",
                   server_options.model_name, server_options.host, port);
        int received = 0;
        sigwait(&signals, &received);
        fmt::print(stderr, "xinfer serve: {}, shutting down\n", received == SIGINT ? "SIGINT" : "SIGTERM");
        const std::string summary = server.stop();
        if (!server_options.profile_path.empty())
            fmt::print(stderr, "{}wrote {}\n", summary, server_options.profile_path);
#endif
    });
}

}  // namespace xinfer::cli
