// Config dialects and config errors, on the real MiMo-V2-Flash config (no weights needed).
#include "fixture.h"
#include "models/model.h"

#include <fmt/core.h>

namespace xinfer::test {
namespace {

ModelConfig config_of(const std::string& name) {
    return read_model_config(*Checkpoint::open(fixture_dir("configs/" + name), /*load_weights=*/false));
}

TEST(ModelConfig, MiMoV2FlashRealShapes) {
    const ModelConfig c = config_of("mimo_v2_flash_hub");
    ASSERT_EQ(c.layers.size(), 48u);
    int full = 0;
    for (size_t i = 0; i < c.layers.size(); ++i) {
        const LayerSpec& l = c.layers[i];
        const bool is_full = i == 0 || (i + 1) % 6 == 0;
        full += is_full;
        EXPECT_EQ(l.attention, is_full ? AttentionKind::full : AttentionKind::sliding) << i;
        EXPECT_EQ(l.n_kv_heads, is_full ? 4 : 8) << i;
        EXPECT_EQ(l.has_sinks, !is_full) << i;
        EXPECT_EQ(l.window, is_full ? 0 : 128) << i;
        EXPECT_EQ(l.rope_theta, is_full ? 5e6f : 1e4f) << i;
        EXPECT_EQ(l.head_dim_k, 192);
        EXPECT_EQ(l.head_dim_v, 128);
        EXPECT_EQ(l.rotary_dim, 64);
        EXPECT_EQ(l.ffn, i == 0 ? FfnKind::dense : FfnKind::moe);
    }
    EXPECT_EQ(full, 9);
    EXPECT_FLOAT_EQ(c.value_scale, 0.707f);
    EXPECT_EQ(c.router.scoring, RouterParams::Scoring::sigmoid);
    EXPECT_EQ(c.router.top_k, 8);
    EXPECT_FLOAT_EQ(c.router.routed_scaling_factor, 1.f);  // null in the hub config
    const ParameterCounts counts = count_parameters(c);
    // research/mimo_v2_flash.md §1: 308.78 B without MTP; ~14.8 B active incl. lm_head.
    EXPECT_NEAR(counts.total / 1e9, 308.78, 0.05);
    EXPECT_NEAR(counts.active / 1e9, 14.8, 0.4);
    const auto groups = kv_groups_for(c);
    ASSERT_EQ(groups.size(), 2u);
    EXPECT_EQ(groups[0].layers.size(), 9u);
    EXPECT_EQ(groups[1].layers.size(), 39u);
}

TEST(ModelConfig, HubAndNativeDialectsAgree) {
    const ModelConfig hub = config_of("mimo_v2_flash_hub"), native = config_of("mimo_v2_flash_native");
    ASSERT_EQ(hub.layers.size(), native.layers.size());
    for (size_t i = 0; i < hub.layers.size(); ++i) {
        const LayerSpec &a = hub.layers[i], &b = native.layers[i];
        EXPECT_TRUE(a.attention == b.attention && a.n_q_heads == b.n_q_heads && a.n_kv_heads == b.n_kv_heads &&
                    a.head_dim_k == b.head_dim_k && a.head_dim_v == b.head_dim_v && a.window == b.window &&
                    a.has_sinks == b.has_sinks && a.rope_theta == b.rope_theta && a.rotary_dim == b.rotary_dim &&
                    a.ffn == b.ffn)
            << "layer " << i;
    }
    EXPECT_EQ(hub.rms_norm_eps, native.rms_norm_eps);
}

// Writes a modified copy of a config into a temp dir and returns the error opening it gives.
std::string error_for(const std::string& base, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json json = nlohmann::json::parse(std::ifstream(fixture_dir("configs/" + base) / "config.json"));
    edit(json);
    const auto dir = std::filesystem::temp_directory_path() / ("xinfer_config_" + base);
    std::filesystem::create_directories(dir);
    std::ofstream(dir / "config.json") << json.dump();
    try {
        read_model_config(*Checkpoint::open(dir, false));
    } catch (const std::exception& e) {
        return e.what();
    }
    return "";
}

TEST(ModelConfig, ErrorsNameFileFieldExpectedAndActual) {
    std::string e = error_for("mimo_v2_flash_hub", [](auto& j) { j["architectures"] = {"LlamaForCausalLM"}; });
    EXPECT_NE(e.find("unknown architecture \"LlamaForCausalLM\""), std::string::npos) << e;
    EXPECT_NE(e.find("MiMoV2FlashForCausalLM"), std::string::npos) << e;  // lists the supported ones

    e = error_for("mimo_v2_flash_hub", [](auto& j) { j["hidden_size"] = "4096"; });
    EXPECT_NE(e.find("config.json"), std::string::npos) << e;
    EXPECT_NE(e.find("hidden_size"), std::string::npos) << e;

    e = error_for("mimo_v2_flash_hub", [](auto& j) { j["hybrid_layer_pattern"] = {0, 1}; });
    EXPECT_NE(e.find("hybrid_layer_pattern"), std::string::npos) << e;
    EXPECT_NE(e.find("48"), std::string::npos) << e;

    e = error_for("mimo_v2_flash_native", [](auto& j) { j.erase("num_hidden_layers"); });
    EXPECT_NE(e.find("num_hidden_layers"), std::string::npos) << e;

    e = error_for("qwen3_0_6b", [](auto& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; });
    EXPECT_NE(e.find("yarn"), std::string::npos) << e;
}

}  // namespace
}  // namespace xinfer::test
