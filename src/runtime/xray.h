// xray: capture every named intermediate of a forward pass (DESIGN.md decision 3) and compare
// two such captures tensor by tensor — one backend against another, or against a dump made
// elsewhere (another xinfer run, or a reference framework writing the same names) — to find the
// FIRST tensor, in forward order, where they part ways. Coarse to fine, like torch_xray, msprobe
// and llama.cpp's eval-callback (research/plugins.md §3): the first diverging (layer, tensor)
// names the op to turn into a unit test.
//
// Names. A tap (name, layer) is stored as "<name>" for layer -1 and "layers.<layer>.<name>"
// otherwise ("embedding", "layers.3.attn_output", "logits"). Transformers' per-layer hidden
// states are accepted under their own names through a NameMap (embed → embedding,
// layer.L → layers.L.residual, final_norm → final_norm).
//
// Metrics, per tensor present on both sides (b is the side whose scale normalises):
//   rel  = max|a − b| / max|b|        (the pass/fail criterion; NaN or ±inf mismatch → inf)
//   nmse = Σ(a − b)² / Σb²            (reported)
//   integer tensors (expert_ids): the exact number of differing elements.
//
// Pass/fail. A float tensor fails when rel > threshold. Default thresholds: 1e-4 when both
// sides computed in f32, 3e-2 when either side computed in bf16/f16 (an accelerator backend,
// or a dump holding bf16 tensors); --threshold overrides both.
// Router rule: expert_ids may legitimately differ where two experts' selection scores nearly
// tie (bf16 rounding flips the choice). A layer's expert_ids mismatch — and then also its
// expert_weights error, since the weights belong to the flipped experts — is reported but
// EXCUSED when that layer's ffn_output is present and within threshold: the flip did not change
// what the layer computed beyond tolerance. Without an ffn_output within threshold the mismatch
// fails, and being earlier in forward order it is named first. router_logits are always checked.
#pragma once

#include "core/dtype.h"
#include "models/model.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace xinfer::xray {

// "<name>" for layer -1, else "layers.<layer>.<name>".
std::string tensor_name(std::string_view name, int layer);
// Inverse of tensor_name: ("attn_output", 3) for "layers.3.attn_output", (name, -1) otherwise.
std::pair<std::string, int> split_tensor_name(const std::string& full_name);

// One captured tensor on the host. Float tensors are held as f32 (bf16/f16 widened exactly);
// integer tensors as their values (exact in f32 below 2^24, which covers expert ids).
struct Activation {
    DType dtype = DType::f32;     // as captured (a bf16 device activation stays marked bf16)
    std::vector<int64_t> shape;
    std::vector<float> values;    // numel values
    bool is_integer() const { return dtype == DType::i32 || dtype == DType::i64 || dtype == DType::u8; }
    int64_t numel() const;
};

// Everything captured from one side.
struct ActivationSet {
    std::string source;                        // "cpu", "cuda:0", or dump file path(s)
    DType compute_dtype = DType::f32;          // precision of the run that made it (bf16 for devices)
    std::map<std::string, std::string> metadata;  // e.g. model, prompt_ids, device
    std::map<std::string, Activation> tensors;    // by full name
};

// ---- capture --------------------------------------------------------------------------------

struct CaptureOptions {
    std::optional<std::regex> names;  // keep only full names matching (regex_search); all if unset
    int page_size = 16;
};

// A TapFn that downloads each tapped tensor (valid only during the call) into `out`.
// `backend` is the model's backend. Later taps of the same name replace earlier ones.
TapFn make_recorder(Backend& backend, ActivationSet& out, const CaptureOptions& options = {});

// Runs `prompt` through `model` as one prefill (logits for every position) with a recorder
// tap and returns what it captured; compute_dtype is f32 on host-memory backends (the CPU
// oracle) and bf16 on accelerators, whose products run on bf16 tensor cores whatever the
// activation dtype.
ActivationSet capture(Model& model, Backend& backend, std::span<const int32_t> prompt,
                      const CaptureOptions& options = {});

// ---- dump files -----------------------------------------------------------------------------

// Writes `set` as safetensors: float tensors F32, integer tensors I32; `set.metadata` plus
// "compute_dtype" and "format" = "xinfer-activations" as the header's __metadata__.
void write_dump(const std::filesystem::path& path, const ActivationSet& set);

// Renames tensors of foreign dumps to xinfer's names: the first rule whose regex matches the
// whole name wins, its replacement ($1 ...) gives the new name; names no rule matches are kept.
struct NameMap {
    std::vector<std::pair<std::regex, std::string>> rules;
    std::string apply(const std::string& name) const;
    // Transformers' hidden states as tests/fixtures/*/reference_hidden.safetensors stores them:
    // embed → embedding, layer.L → layers.L.residual (the layer's output after its FFN
    // residual add), final_norm → final_norm; also hidden_states.0 → embedding.
    static NameMap transformers_hidden();
    static NameMap identity() { return {}; }
};

// Reads a safetensors dump (F32, BF16, F16, I32, I64 tensors; others are skipped) through
// `names`. compute_dtype comes from the "compute_dtype" metadata when present, else bf16 if any
// float tensor is stored in bf16/f16, else f32. Several files merge (later ones win per name).
ActivationSet read_dump(const std::vector<std::filesystem::path>& paths, const NameMap& names = NameMap::transformers_hidden());

// ---- comparison -----------------------------------------------------------------------------

struct Thresholds {
    double f32 = 1e-4;      // both sides computed in f32
    double reduced = 3e-2;  // either side computed in bf16 or f16
    std::optional<double> override_all;  // --threshold: replaces both
    double for_pair(DType a_compute, DType b_compute) const;
};

struct CompareOptions {
    Thresholds thresholds;
    std::optional<std::regex> names;  // compare only full names matching (regex_search)
};

struct TensorDiff {
    std::string full_name;       // "layers.2.attn_output"
    std::string name;            // "attn_output"
    int layer = -1;
    bool integer = false;        // compared by exact mismatch count
    std::vector<int64_t> shape_a, shape_b;
    bool shape_mismatch = false; // shapes differ (after dropping leading 1s): rel = inf
    double rel = 0;              // max|a-b| / max|b| (inf for NaN, inf mismatch or shape mismatch)
    double nmse = 0;             // Σ(a-b)² / Σb²
    double max_abs = 0;          // max|a-b|
    int64_t nan_count = 0;       // elements NaN on either side
    int64_t mismatches = 0;      // integer tensors: differing elements
    int64_t numel = 0;
    double threshold = 0;        // the threshold that applied to this tensor
    bool over = false;           // over threshold by its own numbers
    bool excused = false;        // over, but excused by the router rule
    bool fails() const { return over && !excused; }
};

struct Report {
    std::string a_source, b_source;  // "cpu (f32)", "cuda:0 (bf16)", "ref.safetensors (f32)"
    double threshold = 0;            // for float tensors computed as the two sides' compute dtypes say
    std::vector<TensorDiff> diffs;        // forward order
    std::vector<std::string> only_a, only_b;  // names present on one side only (not failures)
    // The first failing tensor in forward order, or nullptr when everything passes.
    const TensorDiff* first_failure() const;
    bool ok() const { return first_failure() == nullptr; }
};

// Forward-order rank of a full name: global tensors before the layers (embedding), each
// layer's tensors in the order the decoder computes them, then the global tensors after the
// layers (final_norm, logits). Unknown names sort after known ones of the same layer.
std::tuple<int, int, int, std::string> forward_order_key(const std::string& full_name);

Report compare(const ActivationSet& a, const ActivationSet& b, const CompareOptions& options = {});

// The per-layer tables (rows = layers, columns = tensor names; global tensors in their own
// rows), one of relative errors and one of NMSE, then the verdict naming the first tensor over
// threshold. Cells over threshold are marked '!', excused ones '~'.
std::string format_report(const Report& report);

}  // namespace xinfer::xray
