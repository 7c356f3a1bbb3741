// xinfer serve: the Engine behind an OpenAI-compatible HTTP API (src/server/server.h) until
// SIGINT or SIGTERM.
#include "commands.h"
#include "core/status.h"
#include "server/server.h"  // declarations only; builds without cpp-httplib lack server.cpp
#include "tokenizer/chat_template.h"

#include <nlohmann/json.hpp>

#include <fmt/core.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <pthread.h>

namespace xinfer::cli {
namespace {

// config.json's architectures[0]; empty when the file or the field is missing (the engine reports
// those itself when it loads).
std::string architecture_of(const std::string& model_dir) {
    std::ifstream in(std::filesystem::path(model_dir) / "config.json");
    const nlohmann::json config = nlohmann::json::parse(in, nullptr, false);
    if (config.is_discarded() || !config.contains("architectures") || !config["architectures"].is_array() ||
        config["architectures"].empty() || !config["architectures"][0].is_string())
        return "";
    return config["architectures"][0].get<std::string>();
}

// The checkpoint's own chat template (tokenizer_config.json or chat_template.jinja), when it has
// one: a warning when it does not look like the built-in template we render instead (a fine-tune
// with its own format would otherwise get prompts it was not trained on without anyone noticing).
// A heuristic, not a comparison: each built-in template's distinctive text must appear in it.
void warn_if_template_differs(const std::string& model_dir, const std::string& builtin) {
    std::string text;
    std::ifstream in(std::filesystem::path(model_dir) / "tokenizer_config.json");
    const nlohmann::json config = nlohmann::json::parse(in, nullptr, false);
    if (!config.is_discarded() && config.contains("chat_template") && config["chat_template"].is_string())
        text = config["chat_template"].get<std::string>();
    if (text.empty()) {  // newer checkpoints ship it as its own file
        std::ifstream jinja(std::filesystem::path(model_dir) / "chat_template.jinja");
        text.assign(std::istreambuf_iterator<char>(jinja), std::istreambuf_iterator<char>());
    }
    if (text.empty()) return;
    const auto has = [&](const char* part) { return text.find(part) != std::string::npos; };
    const bool looks_alike = has("<|im_start|>") && (builtin == "qwen3" ? has("<function-name>") && has("enable_thinking")
                                                                         : has("<function=example_function_name>"));
    if (!looks_alike)
        fmt::print(stderr,
                   "xinfer serve: warning: the checkpoint's tokenizer_config.json has a chat_template that does not look "
                   "like the built-in '{}' template the chat route renders; prompts may differ from the model's own "
                   "format\n",
                   builtin);
}

}  // namespace

void add_serve_command(CLI::App& app) {
    struct Options {
        ModelOptions model;
        EngineOptions engine;
        ServerOptions server;
    };
    auto options = std::make_shared<Options>();
    CLI::App* cmd = app.add_subcommand(
        "serve",
        "Serve the model over HTTP: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /metrics");
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
    cmd->add_flag("--overlap-decode,!--no-overlap-decode", options->engine.overlap_decode,
                  "Queue each decode step before the previous step's tokens reach the host (vLLM's async scheduling; "
                  "the default)");
    cmd->add_flag("--enable-prefix-caching", options->engine.enable_prefix_caching,
                  "Reuse the KV of shared prompt prefixes");
    cmd->add_option("--speculative-config", options->engine.speculative_config,
                    R"(Speculative decoding, as vLLM: '{"method":"ngram"|"mtp"|"dflash","model":DIR,"num_speculative_tokens":k}')");
    cmd->add_option("--chat-template", options->server.chat_template,
                    "Chat template of /v1/chat/completions: qwen3 or mimo (default: the one built in for the model's "
                    "architecture)");
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
        server_options.architecture = architecture_of(options->model.model_dir);
        if (server_options.chat_template.empty())
            server_options.chat_template = builtin_chat_template_for(server_options.architecture);
        else if (!make_chat_template(server_options.chat_template))
            fail("--chat-template {}: unknown; the built-in templates are {}", server_options.chat_template,
                 builtin_chat_template_names());
        if (!server_options.chat_template.empty())
            warn_if_template_differs(options->model.model_dir, server_options.chat_template);

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
        fmt::print(stderr,
                   "xinfer serve: {} on http://{}:{} (POST /v1/completions, /v1/chat/completions [chat template: {}], "
                   "GET /v1/models, /health, /metrics)\n",
                   server_options.model_name, server_options.host, port,
                   server_options.chat_template.empty() ? "none" : server_options.chat_template);
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
