// Chat templates: a conversation (messages, tools) → the prompt text the model was trained on.
//
// No Jinja engine: each model family's template is a hand-written renderer that reproduces what
// transformers' apply_chat_template renders from that family's chat_template, byte for byte, for
// the inputs the OpenAI chat API can express. Its tests spell out expected prompts derived from
// the template text. Which template a model gets follows its architecture
// (builtin_chat_template_for), or the server's --chat-template flag.
//
//  - "qwen3": Qwen3's official template (the hybrid-thinking one, with `message.content is
//    string` and `enable_thinking`), as Qwen ships it in tokenizer_config.json (the same text is
//    TRL's qwen3_chat_template, which TRL compares tokenizers' templates against).
//  - "mimo": MiMo-V2's XML-tools template. NOT VERIFIED against MiMo-V2-Flash's own
//    tokenizer_config.json, which was not retrievable: the text followed is MiMo-V2.5's template as
//    reproduced in third-party code (a vLLM deployment script and a chat-history converter). It
//    agrees with a MiMo-V2-Flash reference prompt found in a third-party test ("<|im_start|>system\n
//    You are MiMo, a helpful AI assistant engineered by Xiaomi.<|im_end|><|im_start|>user\nHello
//    <|im_end|><|im_start|>assistant\n<think></think>": default system prompt, no newline between
//    turns, an empty think block when thinking is off) and with the XML tool-call format of
//    SGLang's MiMo detector; the tool preamble wording and the empty think block of past
//    assistant turns without reasoning are taken from the V2.5 text only.
//
// Messages are plain data; the server validates requests before they get here (roles, content).
// Thread-safety: renderers are stateless; render() may be called from any thread.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace xinfer {

struct ChatToolCall {
    std::string id;    // as the client sent it (templates do not render it)
    std::string name;
    // The arguments the client sent: an object (parsed from the OpenAI API's JSON string, as vLLM
    // does before rendering), or, when that string is not a JSON object, the string itself.
    nlohmann::ordered_json arguments;
};

struct ChatMessage {
    std::string role;  // system, user, assistant, tool
    // The message's text parts: one for string content, none for null content, several for an
    // array of text parts. Templates join them their own way (text_content below, or concatenated).
    std::vector<std::string> parts;
    std::optional<std::string> reasoning_content;  // assistant turns sent back with their reasoning
    std::vector<ChatToolCall> tool_calls;           // assistant turns that called tools
    std::string tool_call_id;                       // tool results (not rendered by these templates)

    // The content as vLLM hands it to templates that take a string: parts joined with "\n".
    std::string text_content() const;
};

struct ChatTemplateInput {
    std::vector<ChatMessage> messages;
    std::vector<nlohmann::ordered_json> tools;  // as the request's `tools`, in order, keys in order
    bool add_generation_prompt = true;
    // chat_template_kwargs.enable_thinking; unset leaves the template's default (both: on).
    std::optional<bool> enable_thinking;
};

class ChatTemplate {
public:
    virtual ~ChatTemplate() = default;
    virtual const char* name() const = 0;
    // The prompt text. Throws std::invalid_argument with the reason when the conversation cannot
    // be rendered by this template (the server answers 400 with it).
    virtual std::string render(const ChatTemplateInput& input) const = 0;
    // Whether output starts inside a reasoning block for this input (thinking on), so the
    // reasoning parser should expect "...</think>" with or without a leading "<think>".
    virtual bool thinking_enabled(const ChatTemplateInput& input) const = 0;
    // How the model writes tool calls: "hermes" (<tool_call>{json}</tool_call>) or "mimo_xml"
    // (<tool_call><function=NAME><parameter=ARG>value</parameter></function></tool_call>).
    virtual const char* tool_call_format() const = 0;
};

// The built-in template of this name ("qwen3", "mimo"); nullptr for any other name.
std::unique_ptr<ChatTemplate> make_chat_template(const std::string& name);
// The built-in template's name for an HF architecture (config.json architectures[0]); empty when
// there is none (the server then refuses chat requests naming the architecture, never guesses).
std::string builtin_chat_template_for(const std::string& architecture);
// The names make_chat_template knows, for messages: "qwen3, mimo".
std::string builtin_chat_template_names();

}  // namespace xinfer
