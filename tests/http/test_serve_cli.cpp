// `xinfer serve` as a process: it announces its address, answers, and on SIGTERM shuts down with
// status 0 and writes the --profile trace.
#include "models/fixture.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace xinfer::test {
namespace {

std::string read_line(FILE* pipe) {
    std::string line;
    for (int c; (c = fgetc(pipe)) != EOF && c != '\n';) line += char(c);
    return line;
}

TEST(ServeCli, AnswersAndShutsDownOnSigterm) {
    const std::filesystem::path trace = std::filesystem::temp_directory_path() / "xinfer_serve_cli_profile.json";
    std::filesystem::remove(trace);
    // The shell prints its pid, then becomes the server (exec), so that pid is the server's.
    const std::string command = "echo $$; exec " XINFER_BINARY " serve --model " + fixture_dir("qwen3_f32").string() +
                                " --port 0 --served-model-name tiny --profile " + trace.string() + " 2>&1";
    FILE* pipe = popen(command.c_str(), "r");
    ASSERT_TRUE(pipe);
    const pid_t pid = pid_t(std::stol(read_line(pipe)));
    std::string output, line;
    int port = 0;
    const std::string marker = "on http://127.0.0.1:";
    while (port == 0 && !(line = read_line(pipe)).empty()) {
        output += line + "\n";
        if (const size_t at = line.find(marker); at != std::string::npos) port = std::stoi(line.substr(at + marker.size()));
    }
    ASSERT_GT(port, 0) << output;

    httplib::Client client("127.0.0.1", port);
    client.set_read_timeout(60, 0);
    const auto res = client.Post("/v1/completions", R"({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4})",
                                 "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(nlohmann::json::parse(res->body)["usage"]["completion_tokens"], 4);
    // The chat template follows the architecture (Qwen3ForCausalLM); this fixture has no
    // tokenizer.json, which the chat route says.
    EXPECT_NE(output.find("[chat template: qwen3]"), std::string::npos) << output;
    const auto chat = client.Post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}]})",
                                  "application/json");
    ASSERT_TRUE(chat);
    EXPECT_EQ(chat->status, 400);
    EXPECT_NE(chat->body.find("tokenizer.json"), std::string::npos) << chat->body;

    kill(pid, SIGTERM);
    while (!(line = read_line(pipe)).empty() || !feof(pipe)) output += line + "\n";
    const int status = pclose(pipe);
    EXPECT_EQ(WEXITSTATUS(status), 0) << output;
    EXPECT_NE(output.find("SIGTERM, shutting down"), std::string::npos) << output;
    EXPECT_NE(output.find("wrote " + trace.string()), std::string::npos) << output;
    std::ifstream in(trace);
    const nlohmann::json parsed = nlohmann::json::parse(in, nullptr, false);
    ASSERT_FALSE(parsed.is_discarded());
    EXPECT_FALSE(parsed["traceEvents"].empty());
    std::filesystem::remove(trace);
}

TEST(ServeCli, UnknownChatTemplateIsRefused) {
    const std::string command = XINFER_BINARY " serve --model " + fixture_dir("qwen3_f32").string() +
                                " --port 0 --chat-template jinja 2>&1";
    FILE* pipe = popen(command.c_str(), "r");
    ASSERT_TRUE(pipe);
    std::string output;
    for (int c; (c = fgetc(pipe)) != EOF;) output += char(c);
    EXPECT_NE(WEXITSTATUS(pclose(pipe)), 0) << output;
    EXPECT_NE(output.find("--chat-template jinja: unknown; the built-in templates are qwen3, mimo"), std::string::npos)
        << output;
}

}  // namespace
}  // namespace xinfer::test
