// Memory plan against the real MiMo-V2-Flash config (research/mimo_v2_flash.md §7) and the
// `xinfer plan` verdict when a configuration does not fit.
#include "runtime/memory_plan.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

namespace xinfer::test {
namespace {

const std::filesystem::path kMimoConfig =
    std::filesystem::path(XINFER_FIXTURES_DIR) / "configs" / "mimo_v2_flash_hub";

ModelConfig mimo_config() { return read_model_config(*Checkpoint::open(kMimoConfig, /*load_weights=*/false)); }

PlanOptions h200(int tp) {
    PlanOptions options;
    options.device_memory = parse_memory_size("141GiB");
    options.tensor_parallel_size = tp;
    return options;
}

TEST(MemoryPlan, MimoV2FlashKvBytes) {
    const MemoryPlan plan = plan_memory(mimo_config(), h200(1));
    EXPECT_EQ(plan.full_bytes_per_token, 23040);      // 9 full layers × 4 heads × (192 + 128) × 2 B
    EXPECT_EQ(plan.sliding_bytes_per_seq, 25559040);  // 39 sliding layers × 128 × 8 × 320 × 2 B
    ASSERT_EQ(plan.groups.size(), 2u);
    EXPECT_EQ(plan.layout.page_bytes % 23040, 0);
    EXPECT_EQ(plan.layout.page_bytes % 199680, 0);
    // Page-rounded: a decoding sequence holds ceil(128 / tokens_per_page) + 1 sliding pages.
    EXPECT_EQ(plan.sliding_pages_per_seq * plan.layout.page_bytes, 9 * plan.layout.page_bytes);
    // bf16 matrices of ~309B parameters cannot fit one 141 GiB device; the verdict names a TP size.
    EXPECT_FALSE(plan.fits);
    EXPECT_NE(plan.verdict.find("--tensor-parallel-size"), std::string::npos) << plan.verdict;
}

// fp8 (e4m3) KV: half the bf16 bytes plus one f32 scale per (token, kv head) for K and for V.
TEST(MemoryPlan, MimoV2FlashFp8KvBytes) {
    PlanOptions options = h200(8);
    options.max_model_len = 262144;
    const MemoryPlan bf16 = plan_memory(mimo_config(), options);
    options.kv_dtype = DType::f8_e4m3;
    const MemoryPlan fp8 = plan_memory(mimo_config(), options);
    options.tensor_parallel_size = 1;
    const MemoryPlan fp8_tp1 = plan_memory(mimo_config(), options);
    EXPECT_EQ(fp8_tp1.full_bytes_per_token, 11808);       // 9 × 4 × (192 + 128 + 8) B
    EXPECT_EQ(fp8_tp1.sliding_bytes_per_seq, 13099008);   // 39 × 128 × 8 × 328 B
    // Per rank at TP 8: 1 of 4 full heads, 1 of 8 sliding heads.
    EXPECT_EQ(fp8.full_bytes_per_token, 11808 / 4);
    EXPECT_EQ(fp8.sliding_bytes_per_seq, 13099008 / 8);
    // Same weights and workspace, so the pool holds 640/328 ≈ 1.95× the tokens.
    EXPECT_TRUE(fp8.fits) << fp8.report();
    EXPECT_EQ(fp8.weight_bytes, bf16.weight_bytes);
    EXPECT_GT(fp8.capacity_tokens, bf16.capacity_tokens * 19 / 10) << fp8.report();
    EXPECT_NE(fp8.report().find("kv dtype f8_e4m3"), std::string::npos) << fp8.report();
}

TEST(MemoryPlan, MimoV2FlashTensorParallel8Fits) {
    PlanOptions options = h200(8);
    options.max_model_len = 262144;
    const MemoryPlan plan = plan_memory(mimo_config(), options);
    EXPECT_TRUE(plan.fits) << plan.report();
    // Per rank: 1 of 4 full KV heads, 1 of 8 sliding heads.
    EXPECT_EQ(plan.full_bytes_per_token, 23040 / 4);
    EXPECT_EQ(plan.sliding_bytes_per_seq, 25559040 / 8);
    EXPECT_GE(plan.full_length_sequences, 1);
}

TEST(MemoryPlan, TooLongContextGivesLargestThatFits) {
    PlanOptions options = h200(8);
    options.gpu_memory_utilization = 0.6;  // leaves a small KV pool after 77 GB of weights per rank
    options.max_num_seqs = 256;
    options.max_model_len = 262144 * 64;
    const MemoryPlan plan = plan_memory(mimo_config(), options);
    ASSERT_FALSE(plan.fits) << plan.report();
    EXPECT_NE(plan.verdict.find("--max-model-len"), std::string::npos) << plan.verdict;
}

// The budget is a fraction of the device's total memory; when less than that is free (another
// engine or process holds some), the engine refuses before loading and says what would fit.
TEST(MemoryPlan, FreeMemoryShortfall) {
    const MemoryPlan plan = plan_memory(mimo_config(), h200(8));
    ASSERT_TRUE(plan.fits) << plan.report();
    // The pool takes the budget's whole pages.
    EXPECT_LE(planned_device_bytes(plan), plan.budget_bytes);
    EXPECT_LT(plan.budget_bytes - planned_device_bytes(plan), uint64_t(plan.layout.page_bytes));
    EXPECT_EQ(free_memory_shortfall(plan, plan.budget_bytes), "");

    const uint64_t free_bytes = parse_memory_size("100GiB");  // of 141 GiB, 126.9 GiB planned
    const std::string shortfall = free_memory_shortfall(plan, free_bytes);
    EXPECT_NE(shortfall.find("but only 100.00 GiB of its 141.00 GiB is free"), std::string::npos) << shortfall;
    EXPECT_NE(shortfall.find("--gpu-memory-utilization 0.70"), std::string::npos) << shortfall;  // floor(100/141)
    PlanOptions suggested = h200(8);
    suggested.gpu_memory_utilization = 0.70;
    EXPECT_EQ(free_memory_shortfall(plan_memory(mimo_config(), suggested), free_bytes), "");

    PlanOptions exact_pool = h200(8);
    exact_pool.kv_cache_memory = int64_t(parse_memory_size("40GiB"));
    const MemoryPlan pool_plan = plan_memory(mimo_config(), exact_pool);
    const std::string pool_shortfall = free_memory_shortfall(pool_plan, free_bytes);
    EXPECT_NE(pool_shortfall.find("--kv-cache-memory of at most"), std::string::npos) << pool_shortfall;
    EXPECT_NE(free_memory_shortfall(pool_plan, pool_plan.weight_bytes / 2).find("not even the weights"),
              std::string::npos);
}

TEST(MemoryPlan, SpeculativeConfig) {
    EXPECT_EQ(parse_speculative_config(R"({"method": "mtp", "num_speculative_tokens": 3})").num_speculative_tokens, 3);
    EXPECT_THROW(parse_speculative_config(R"({"method": "eagle9", "num_speculative_tokens": 3})"), std::exception);
    EXPECT_THROW(parse_speculative_config("{not json"), std::exception);
    PlanOptions options = h200(8);
    const uint64_t base = plan_memory(mimo_config(), options).speculative_bytes;
    options.speculative_config = R"({"method": "mtp", "num_speculative_tokens": 3})";
    EXPECT_GT(plan_memory(mimo_config(), options).speculative_bytes, base);
}

// A DFlash drafter of the MiMo-V2-Flash shape (bench/models/dflash_mimo_b8: 5 layers, hidden 4096,
// 32/8 heads of 128, intermediate 12288, 5 tapped layers, block 8) counts its weights and KV.
TEST(MemoryPlan, DFlashDrafterWeightsAndKv) {
    const std::filesystem::path drafter =
        std::filesystem::path(XINFER_FIXTURES_DIR).parent_path().parent_path() / "bench" / "models" / "dflash_mimo_b8";
    PlanOptions options = h200(1);
    options.max_num_seqs = 4;
    options.max_model_len = 8192;
    options.speculative_config = R"({"method": "dflash", "model": ")" + drafter.string() + R"("})";
    const MemoryPlan plan = plan_memory(mimo_config(), options);
    // Per layer 4096 × ((32 + 2·8)·128 + 32·128 + 3·12288) = 192,937,984 weights; fc 5 × 4096 × 4096.
    const uint64_t weights = (5 * uint64_t(192937984) + 5 * uint64_t(4096) * 4096) * 2;  // bf16
    // KV: its layers are all sliding (use_swa, window 128), so 4 sequences hold their last window
    // and one block (ceil(135 / 16) + 2 pages of 16 tokens, + 1) plus one step's 2,048 rows
    // (128 pages): 176 pages of 16 tokens × 5 layers × 8 heads × (128 + 128) × 2 B = 327,680 B.
    EXPECT_EQ(plan.speculative_bytes, weights + 176 * uint64_t(327680)) << plan.speculative_note;
    EXPECT_NE(plan.speculative_note.find("dflash, 7 tokens"), std::string::npos) << plan.speculative_note;
    options.max_model_len = 65536;  // bounded by the window, not the length
    EXPECT_EQ(plan_memory(mimo_config(), options).speculative_bytes, plan.speculative_bytes);
}

TEST(MemoryPlan, ParseMemorySize) {
    EXPECT_EQ(parse_memory_size("141GiB"), uint64_t(141) << 30);
    EXPECT_EQ(parse_memory_size("512MiB"), uint64_t(512) << 20);
    EXPECT_EQ(parse_memory_size("1000"), 1000u);
    EXPECT_EQ(parse_memory_size("2GB"), 2000000000u);
    EXPECT_THROW(parse_memory_size("12 parsecs"), std::exception);
}

std::string run(const std::string& args, int* status) {
    std::string out;
    std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen((std::string(XINFER_BINARY) + " " + args + " 2>&1").c_str(), "r"),
                                               pclose);
    std::array<char, 4096> buffer{};
    while (fgets(buffer.data(), int(buffer.size()), pipe.get())) out += buffer.data();
    *status = WEXITSTATUS(pclose(pipe.release()));
    return out;
}

TEST(PlanCli, VerdictWhenItDoesNotFit) {
    int status = 0;
    const std::string config = (kMimoConfig / "config.json").string();
    std::string out = run("plan --config " + config + " --device cuda --device-memory 141GiB", &status);
    EXPECT_EQ(status, 2) << out;
    EXPECT_NE(out.find("23,040 B/token"), std::string::npos) << out;
    EXPECT_NE(out.find("25,559,040 B per sequence"), std::string::npos) << out;
    EXPECT_NE(out.find("does NOT fit"), std::string::npos) << out;
    out = run("plan --config " + config + " --device cuda --device-memory 141GiB --tensor-parallel-size 8", &status);
    EXPECT_EQ(status, 0) << out;
    EXPECT_NE(out.find("verdict: fits"), std::string::npos) << out;
    out = run("plan --config " + config + " --device cuda --device-memory 141GiB --kv-cache-dtype fp8", &status);
    EXPECT_EQ(status, 2) << out;  // the weights still do not fit one device
    EXPECT_NE(out.find("11,808 B/token"), std::string::npos) << out;
    EXPECT_NE(out.find("13,099,008 B per sequence"), std::string::npos) << out;
    out = run("plan --config " + config + " --device cuda --device-memory 141GiB --kv-cache-dtype fp8_e4m3 "
              "--tensor-parallel-size 8",
              &status);
    EXPECT_EQ(status, 0) << out;
    EXPECT_NE(out.find("2,952 B/token"), std::string::npos) << out;
    out = run("plan --config " + config + " --device cuda --device-memory 141GiB --kv-cache-dtype int4", &status);
    EXPECT_NE(status, 0);
    EXPECT_NE(out.find("--kv-cache-dtype int4: unknown"), std::string::npos) << out;
}

}  // namespace
}  // namespace xinfer::test
