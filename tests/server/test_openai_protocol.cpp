// The completions protocol without sockets: what a request may ask, and the reasons a client
// gets for what it may not.
#include "server/openai_protocol.h"

#include <gtest/gtest.h>

namespace xinfer::test {
namespace {

ParsedCompletion ok(const std::string& body) {
    ParsedCompletion p = parse_completion_request(body);
    EXPECT_EQ(p.error, "") << body;
    return p;
}

// The 400's reason contains `expected`.
void refused(const std::string& body, const std::string& expected) {
    const ParsedCompletion p = parse_completion_request(body);
    EXPECT_NE(p.error.find(expected), std::string::npos) << body << " → \"" << p.error << "\"";
}

TEST(OpenAiProtocol, TokenPromptsAndSampling) {
    const CompletionRequest r =
        ok(R"({"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
               "seed": 11, "stop_token_ids": [2, 3], "stream": true, "stream_options": {"include_usage": true},
               "user": "ignored", "n": 1, "presence_penalty": 0})")
            .request;
    EXPECT_EQ(r.model, "m");
    ASSERT_EQ(r.prompts.size(), 1u);
    EXPECT_EQ(r.prompts[0], (std::vector<int32_t>{5, 6, 7}));
    EXPECT_EQ(r.max_tokens, 9);
    EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
    EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
    EXPECT_EQ(r.sampling.top_k, 40);
    EXPECT_EQ(r.sampling.seed, 11u);
    EXPECT_TRUE(r.seeded);
    EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{2, 3}));
    EXPECT_EQ(r.n, 1);
    EXPECT_EQ(ok(R"({"prompt": [1], "n": 3})").request.n, 3);
    EXPECT_TRUE(r.stream);
    EXPECT_TRUE(r.include_usage);
}

TEST(OpenAiProtocol, DefaultsAreOpenAis) {
    const CompletionRequest r = ok(R"({"prompt": [1]})").request;
    EXPECT_EQ(r.max_tokens, 16);
    EXPECT_FLOAT_EQ(r.sampling.temperature, 1.f);
    EXPECT_FLOAT_EQ(r.sampling.top_p, 1.f);
    EXPECT_EQ(r.sampling.top_k, 0);
    EXPECT_FALSE(r.stream);
    EXPECT_FALSE(r.seeded);
    EXPECT_EQ(ok(R"({"prompt": [1], "top_k": -1})").request.sampling.top_k, 0);  // vLLM's "no limit"
}

TEST(OpenAiProtocol, BatchOfTokenPrompts) {
    const CompletionRequest r = ok(R"({"prompt": [[1, 2], [3], [4, 5, 6]]})").request;
    ASSERT_EQ(r.prompts.size(), 3u);
    EXPECT_EQ(r.prompts[2], (std::vector<int32_t>{4, 5, 6}));
}

TEST(OpenAiProtocol, MalformedRequestsNameTheProblem) {
    refused("{not json", "not valid JSON");
    refused("[1, 2]", "must be a JSON object");
    refused(R"({"max_tokens": 3})", "'prompt' is required");
    refused(R"({"prompt": []})", "non-empty array");
    refused(R"({"prompt": [1, "two"]})", "prompt[1]");
    refused(R"({"prompt": [1, 2.5]})", "prompt[1]");
    refused(R"({"prompt": [1, 4294967296]})", "not a token id");
    refused(R"({"prompt": [[1], []]})", "prompt[1] is empty");
    refused(R"({"prompt": [[1], 2]})", "prompt[1] must be an array");
    refused(R"({"prompt": [1], "max_tokens": 0})", "'max_tokens' must be in");
    refused(R"({"prompt": [1], "max_tokens": "8"})", "'max_tokens' must be an integer");
    refused(R"({"prompt": [1], "temperature": -1})", "'temperature' must be in");
    refused(R"({"prompt": [1], "top_p": 0})", "'top_p' must be > 0");
    refused(R"({"prompt": [1], "stream": "yes"})", "'stream' must be a boolean");
    refused(R"({"prompt": [1], "stream_options": {"include_usage": true}})", "only allowed with 'stream': true");
    refused(R"({"prompt": [1], "model": 3})", "'model' must be a string");
    refused(R"({"prompt": [1], "stop_token_ids": [1, "x"]})", "stop_token_ids[1]");
    refused(R"({"prompt": [1], "stop": 3})", "'stop' must be a string or an array of strings");
    refused(R"({"prompt": [1], "stop": ["a", 1]})", "'stop' must be a string or an array of strings");
    refused(R"({"prompt": [1], "stop": ["a", ""]})", "must not be empty");
}

// String prompts are kept for the server to encode (it refuses them without a tokenizer).
TEST(OpenAiProtocol, TextPrompts) {
    ParsedCompletion one = parse_completion_request(R"({"prompt": "Hello"})");
    ASSERT_EQ(one.error, "");
    EXPECT_EQ(one.request.text_prompts, (std::vector<std::string>{"Hello"}));
    EXPECT_TRUE(one.request.prompts.empty());
    ParsedCompletion two = parse_completion_request(R"({"prompt": ["Hello", "there"], "n": 2})");
    ASSERT_EQ(two.error, "");
    EXPECT_EQ(two.request.text_prompts, (std::vector<std::string>{"Hello", "there"}));
}

// Stop strings reach the sampling parameters (the engine refuses them without a tokenizer).
TEST(OpenAiProtocol, StopStrings) {
    ParsedCompletion one = parse_completion_request(R"({"prompt": [1], "stop": "\n\n"})");
    ASSERT_EQ(one.error, "");
    EXPECT_EQ(one.request.sampling.stop, (std::vector<std::string>{"\n\n"}));
    ParsedCompletion two = parse_completion_request(R"({"prompt": [1], "stop": ["END", "}"]})");
    ASSERT_EQ(two.error, "");
    EXPECT_EQ(two.request.sampling.stop, (std::vector<std::string>{"END", "}"}));
    EXPECT_TRUE(parse_completion_request(R"({"prompt": [1], "stop": null})").request.sampling.stop.empty());
}

// What needs text, or is not implemented, is refused rather than silently ignored.
TEST(OpenAiProtocol, MissingFeaturesAreErrors) {
    refused(R"({"prompt": 5})", "'prompt' must be a string or a non-empty array");
    refused(R"({"prompt": ["Hello", 3]})", "prompt[1] must be a string");
    refused(R"({"prompt": [1], "n": 0})", "'n' must be in");
    refused(R"({"prompt": [1], "logprobs": 2})", "'logprobs' is not supported");
    refused(R"({"prompt": [1], "echo": true})", "'echo' is not supported");
    refused(R"({"prompt": [1], "frequency_penalty": 0.5})", "penalties are not supported");
    refused(R"({"prompt": [1], "best_of": 3})", "'best_of' is not supported");
    refused(R"({"prompt": [1], "logit_bias": {"5": 1}})", "'logit_bias' is not supported");
    refused(R"({"prompt": [1], "echo": "yes"})", "malformed request");
    ok(R"({"prompt": [1], "stop": [], "logprobs": null, "echo": false, "best_of": 1})");
}

TEST(OpenAiProtocol, ResponseBodies) {
    const std::vector<ChoiceResult> choices = {{{7, 8}, "length", 3, "hi"}, {{9}, "stop", 2, ""}};
    const nlohmann::json body = completion_body("cmpl-1", 100, "m", choices);
    EXPECT_EQ(body["object"], "text_completion");
    EXPECT_EQ(body["choices"][1]["token_ids"], nlohmann::json({9}));
    EXPECT_EQ(body["choices"][1]["finish_reason"], "stop");
    EXPECT_EQ(body["choices"][0]["text"], "hi");
    EXPECT_EQ(body["choices"][1]["text"], "");
    EXPECT_EQ(body["usage"]["prompt_tokens"], 5);
    EXPECT_EQ(body["usage"]["completion_tokens"], 3);
    EXPECT_EQ(body["usage"]["total_tokens"], 8);
    const nlohmann::json chunk = completion_chunk("cmpl-1", 100, "m", 1, {4}, "");
    EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
    EXPECT_EQ(chunk["choices"][0]["index"], 1);
    EXPECT_EQ(chunk["choices"][0]["text"], "");
    EXPECT_EQ(completion_chunk("cmpl-1", 100, "m", 1, {5}, "stop", "all of it")["choices"][0]["text"], "all of it");
    EXPECT_EQ(usage_chunk("cmpl-1", 100, "m", choices)["choices"].size(), 0u);
    EXPECT_EQ(error_body("why", "BadRequestError", 400)["error"]["message"], "why");
}

}  // namespace
}  // namespace xinfer::test
