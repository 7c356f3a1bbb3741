// ConfigReader: typed getters over config.json, with errors that name the file, the field, the
// expected type and the value found.
#include "loader/hf_config.h"
#include "safetensors_test_writer.h"

#include <gtest/gtest.h>

namespace xinfer {
namespace {

using test::error_message;

const nlohmann::json kConfig = nlohmann::json::parse(R"({
    "hidden_size": 4096,
    "num_layers_float": 4.0,
    "half_layer": 4.5,
    "huge": 18446744073709551615,
    "rope_theta": 10000,
    "bad_theta": "abc",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": false,
    "model_type": "mimo_v2_flash",
    "sliding_window": null,
    "layer_types": [0, 1, 1],
    "bad_list": [1, 2.5],
    "architectures": ["MiMoV2FlashForCausalLM"],
    "rope_parameters": {"sliding_attention": {"rope_theta": 10000, "bad": [1]}}
})");

ConfigReader reader() { return ConfigReader(kConfig, "/models/mimo/config.json"); }

TEST(ConfigReader, ReadsTypedFields) {
    const ConfigReader config = reader();
    EXPECT_EQ(config.get_int("hidden_size"), 4096);
    EXPECT_EQ(config.get_int("num_layers_float"), 4);           // an integral float is accepted
    EXPECT_DOUBLE_EQ(config.get_float("rope_theta"), 10000.0);  // floats accept integers
    EXPECT_DOUBLE_EQ(config.get_float("rms_norm_eps"), 1e-6);
    EXPECT_FALSE(config.get_bool("tie_word_embeddings", true));
    EXPECT_EQ(config.get_string("model_type"), "mimo_v2_flash");
    EXPECT_EQ(config.get_int_list("layer_types"), (std::vector<int64_t>{0, 1, 1}));
    EXPECT_EQ(config.get_string_list("architectures"), (std::vector<std::string>{"MiMoV2FlashForCausalLM"}));
}

TEST(ConfigReader, FallbacksApplyToAbsentAndNullFields) {
    const ConfigReader config = reader();
    EXPECT_TRUE(config.has("hidden_size"));
    EXPECT_FALSE(config.has("sliding_window"));  // null counts as absent
    EXPECT_FALSE(config.has("nope"));
    EXPECT_EQ(config.get_int("sliding_window", 128), 128);
    EXPECT_EQ(config.get_int("nope", 7), 7);
    EXPECT_DOUBLE_EQ(config.get_float("sliding_window", 0.5), 0.5);
    EXPECT_TRUE(config.get_bool("nope", true));
    EXPECT_EQ(config.get_string("nope", "x"), "x");
    EXPECT_EQ(config.get_int("hidden_size", 1), 4096);  // present fields ignore the fallback
}

TEST(ConfigReader, WrongTypeNamesFileFieldExpectedAndFound) {
    const ConfigReader config = reader();
    EXPECT_EQ(error_message([&] { config.get_float("bad_theta"); }),
              "/models/mimo/config.json: field 'bad_theta': expected a number, found \"abc\"");
    // A fallback does not hide a field of the wrong type.
    EXPECT_EQ(error_message([&] { config.get_float("bad_theta", 1.0); }),
              "/models/mimo/config.json: field 'bad_theta': expected a number, found \"abc\"");
    EXPECT_EQ(error_message([&] { config.get_int("half_layer"); }),
              "/models/mimo/config.json: field 'half_layer': expected an integer, found 4.5");
    EXPECT_EQ(error_message([&] { config.get_int("huge"); }),
              "/models/mimo/config.json: field 'huge': expected an integer, found 18446744073709551615");
    EXPECT_EQ(error_message([&] { config.get_bool("hidden_size", false); }),
              "/models/mimo/config.json: field 'hidden_size': expected true or false, found 4096");
    EXPECT_EQ(error_message([&] { config.get_string("hidden_size"); }),
              "/models/mimo/config.json: field 'hidden_size': expected a string, found 4096");
    EXPECT_EQ(error_message([&] { config.get_int_list("model_type"); }),
              "/models/mimo/config.json: field 'model_type': expected a list of integers, found \"mimo_v2_flash\"");
    EXPECT_EQ(error_message([&] { config.object("hidden_size"); }),
              "/models/mimo/config.json: field 'hidden_size': expected an object, found 4096");
}

TEST(ConfigReader, ListElementErrorsNameTheIndex) {
    const ConfigReader config = reader();
    EXPECT_EQ(error_message([&] { config.get_int_list("bad_list"); }),
              "/models/mimo/config.json: field 'bad_list[1]': expected an integer, found 2.5");
    EXPECT_EQ(error_message([&] { config.get_string_list("layer_types"); }),
              "/models/mimo/config.json: field 'layer_types[0]': expected a string, found 0");
}

TEST(ConfigReader, MissingRequiredField) {
    const ConfigReader config = reader();
    EXPECT_EQ(error_message([&] { config.get_int("num_attention_heads"); }),
              "/models/mimo/config.json: missing required field 'num_attention_heads'");
    EXPECT_EQ(error_message([&] { config.get_string("sliding_window"); }),  // null is missing too
              "/models/mimo/config.json: missing required field 'sliding_window'");
}

TEST(ConfigReader, NestedObjectsPrefixTheirFieldNames) {
    const ConfigReader sliding = reader().object("rope_parameters").object("sliding_attention");
    EXPECT_DOUBLE_EQ(sliding.get_float("rope_theta"), 10000.0);
    EXPECT_EQ(error_message([&] { sliding.get_int("factor"); }),
              "/models/mimo/config.json: missing required field 'rope_parameters.sliding_attention.factor'");
    EXPECT_EQ(error_message([&] { sliding.get_string("bad"); }),
              "/models/mimo/config.json: field 'rope_parameters.sliding_attention.bad': expected a string, found [1]");
    EXPECT_EQ(error_message([&] { sliding.type_error("rope_theta", "a power of two"); }),
              "/models/mimo/config.json: field 'rope_parameters.sliding_attention.rope_theta': expected a power of "
              "two, found 10000");
}

TEST(ConfigReader, LongValuesAreShortenedInMessages) {
    nlohmann::json json = {{"big", std::vector<int>(100, 12345)}};
    const ConfigReader config(json, "c.json");
    const std::string message = error_message([&] { config.get_int("big"); });
    EXPECT_CONTAINS(message, "c.json: field 'big': expected an integer, found [12345,12345,");
    EXPECT_CONTAINS(message, "...");
    EXPECT_LT(message.size(), 200u);
}

}  // namespace
}  // namespace xinfer
