#include "runtime/xray.h"

#include "core/status.h"
#include "loader/safetensors_file.h"
#include "loader/safetensors_writer.h"
#include "runtime/runner.h"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

namespace xinfer::xray {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The decoder's taps in the order it computes them (src/models/decoder.cpp).
constexpr std::string_view kLayerOrder[] = {
    "attn_input",    "q",          "k",              "v",          "attn_output", "attn_proj",
    "ffn_input",     "router_logits", "expert_ids",  "expert_weights", "ffn_output", "residual",
};
constexpr std::string_view kGlobalsBefore[] = {"embedding"};
constexpr std::string_view kGlobalsAfter[] = {"final_norm", "logits"};

int index_in(std::span<const std::string_view> list, std::string_view name) {
    auto it = std::find(list.begin(), list.end(), name);
    return it == list.end() ? -1 : int(it - list.begin());
}

bool reduced_precision(DType dtype) { return dtype == DType::bf16 || dtype == DType::f16; }

// Shape with leading 1s dropped (a reference framework may keep a batch dimension).
std::vector<int64_t> squeezed(const std::vector<int64_t>& shape) {
    size_t first = 0;
    while (first + 1 < shape.size() && shape[first] == 1) ++first;
    return {shape.begin() + long(first), shape.end()};
}

// Same squeezed shape, or the same element count and the same leading (token) dimension: the
// inner dims may be flattened differently ([T, heads, d] vs [T, heads·d]) but the layout is the
// same row-major order.
bool compatible_shapes(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
    const std::vector<int64_t> sa = squeezed(a), sb = squeezed(b);
    if (sa == sb) return true;
    int64_t na = 1, nb = 1;
    for (int64_t d : sa) na *= d;
    for (int64_t d : sb) nb *= d;
    return na == nb && !sa.empty() && !sb.empty() && sa.front() == sb.front();
}

Activation to_activation(DType dtype, const std::vector<int64_t>& shape, const void* data) {
    Activation act;
    act.dtype = dtype;
    act.shape = shape;
    const int64_t n = act.numel();
    act.values.resize(size_t(n));
    switch (dtype) {
        case DType::i32: {
            const auto* p = static_cast<const int32_t*>(data);
            for (int64_t i = 0; i < n; ++i) act.values[size_t(i)] = float(p[i]);
            break;
        }
        case DType::i64: {
            const auto* p = static_cast<const int64_t*>(data);
            for (int64_t i = 0; i < n; ++i) act.values[size_t(i)] = float(p[i]);
            break;
        }
        case DType::u8: {
            const auto* p = static_cast<const uint8_t*>(data);
            for (int64_t i = 0; i < n; ++i) act.values[size_t(i)] = float(p[i]);
            break;
        }
        default: convert_to_f32(dtype, data, act.values.data(), n); break;
    }
    return act;
}

// The header's "__metadata__" object of a safetensors file ({} when absent). SafetensorsFile
// validates the rest of the header; this reads only the metadata.
std::map<std::string, std::string> read_metadata(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    uint64_t header_size = 0;
    if (!in.read(reinterpret_cast<char*>(&header_size), 8)) fail("{}: cannot read the safetensors header", path.string());
    std::string header(size_t(header_size), '\0');
    if (!in.read(header.data(), std::streamsize(header_size))) fail("{}: truncated safetensors header", path.string());
    const nlohmann::json json = nlohmann::json::parse(header);
    std::map<std::string, std::string> out;
    if (auto it = json.find("__metadata__"); it != json.end() && it->is_object())
        for (const auto& [key, value] : it->items())
            out[key] = value.is_string() ? value.get<std::string>() : value.dump();
    return out;
}

std::string format_value(double v) {
    if (v == 0) return "0";
    if (std::isinf(v)) return "inf";
    if (std::isnan(v)) return "nan";
    return fmt::format("{:.1e}", v);
}

std::string cell_text(const TensorDiff& d, bool nmse) {
    std::string text;
    if (d.shape_mismatch) text = "shape";
    else if (d.integer) text = fmt::format("{}/{}", d.mismatches, d.numel);
    else if (d.nan_count > 0) text = "nan";
    else text = format_value(nmse ? d.nmse : d.rel);
    if (d.over) text += d.excused ? "~" : "!";
    return text;
}

std::string where(const TensorDiff& d) {
    return d.layer >= 0 ? fmt::format("layer {} {}", d.layer, d.name) : d.name;
}

std::string why(const TensorDiff& d) {
    const double threshold = d.threshold;
    if (d.shape_mismatch)
        return fmt::format("shapes differ: a [{}] vs b [{}]", fmt::join(d.shape_a, ", "), fmt::join(d.shape_b, ", "));
    if (d.integer) return fmt::format("{} of {} elements differ", d.mismatches, d.numel);
    if (d.nan_count > 0) return fmt::format("{} NaN elements (NaN never passes)", d.nan_count);
    return fmt::format("rel {:.3e} > {:.0e} (nmse {:.3e}, max|a-b| {:.3e})", d.rel, threshold, d.nmse, d.max_abs);
}

}  // namespace

int64_t Activation::numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
}

std::string tensor_name(std::string_view name, int layer) {
    return layer < 0 ? std::string(name) : fmt::format("layers.{}.{}", layer, name);
}

std::pair<std::string, int> split_tensor_name(const std::string& full_name) {
    static const std::regex pattern(R"(layers\.(\d+)\.(.+))");
    std::smatch m;
    if (std::regex_match(full_name, m, pattern)) return {m[2].str(), std::stoi(m[1].str())};
    return {full_name, -1};
}

std::tuple<int, int, int, std::string> forward_order_key(const std::string& full_name) {
    const auto [name, layer] = split_tensor_name(full_name);
    constexpr int kUnknown = 1000;
    if (layer >= 0) {
        const int rank = index_in(kLayerOrder, name);
        return {1, layer, rank < 0 ? kUnknown : rank, name};
    }
    if (const int rank = index_in(kGlobalsBefore, name); rank >= 0) return {0, 0, rank, name};
    const int rank = index_in(kGlobalsAfter, name);
    return {2, 0, rank < 0 ? kUnknown : rank, name};
}

// ---- capture --------------------------------------------------------------------------------

TapFn make_recorder(Backend& backend, ActivationSet& out, const CaptureOptions& options) {
    return [&backend, &out, filter = options.names](std::string_view name, int layer, const Tensor& value) {
        const std::string full = tensor_name(name, layer);
        if (filter && !std::regex_search(full, *filter)) return;
        std::vector<uint8_t> host(value.nbytes());
        backend.download(value, host.data());  // completes before returning, after the op that wrote it
        out.tensors[full] = to_activation(value.dtype, std::vector<int64_t>(value.shape.begin(), value.shape.begin() + value.rank),
                                          host.data());
    };
}

ActivationSet capture(Model& model, Backend& backend, std::span<const int32_t> prompt, const CaptureOptions& options) {
    XINFER_CHECK(!prompt.empty(), "xray needs a non-empty prompt");
    ActivationSet set;
    set.source = backend.name();
    // Device backends count as bf16 even when the activations are f32: their matmuls and
    // attention run on bf16 tensor cores (plugins/cuda/README.md). The CPU oracle is f32.
    set.compute_dtype = backend.props().host_memory ? DType::f32 : DType::bf16;
    set.metadata["device"] = backend.name();
    set.metadata["prompt_ids"] = fmt::format("{}", fmt::join(prompt, ","));
    RunnerOptions runner_options;
    runner_options.page_size = options.page_size;
    runner_options.max_cached_tokens = int64_t(prompt.size()) + options.page_size;
    Runner runner(model, backend, runner_options);
    const SequenceChunk chunk{0, 0, prompt, /*all_logits=*/true};
    runner.step(std::span(&chunk, 1), make_recorder(backend, set, options));
    runner.release(0);
    return set;
}

// ---- dump files -----------------------------------------------------------------------------

void write_dump(const std::filesystem::path& path, const ActivationSet& set) {
    std::vector<SafetensorsEntry> entries;
    std::vector<std::vector<int32_t>> integer_data;  // keeps converted integer tensors alive
    integer_data.reserve(set.tensors.size());
    for (const auto& [name, act] : set.tensors) {
        SafetensorsEntry entry{name, DType::f32, act.shape, act.values.data()};
        if (act.is_integer()) {
            integer_data.emplace_back(act.values.begin(), act.values.end());
            entry.dtype = DType::i32;
            entry.data = integer_data.back().data();
        }
        entries.push_back(std::move(entry));
    }
    nlohmann::json metadata = nlohmann::json::object();
    for (const auto& [key, value] : set.metadata) metadata[key] = value;
    metadata["compute_dtype"] = std::string(dtype_name(set.compute_dtype));
    metadata["format"] = "xinfer-activations";
    write_safetensors(path, entries, metadata);
}

std::string NameMap::apply(const std::string& name) const {
    for (const auto& [pattern, replacement] : rules)
        if (std::regex_match(name, pattern)) return std::regex_replace(name, pattern, replacement);
    return name;
}

NameMap NameMap::transformers_hidden() {
    NameMap map;
    map.rules.emplace_back(std::regex(R"(embed)"), "embedding");
    map.rules.emplace_back(std::regex(R"(hidden_states\.0)"), "embedding");
    map.rules.emplace_back(std::regex(R"(layer\.(\d+))"), "layers.$1.residual");
    return map;
}

ActivationSet read_dump(const std::vector<std::filesystem::path>& paths, const NameMap& names) {
    XINFER_CHECK(!paths.empty(), "read_dump: no files");
    ActivationSet set;
    bool any_reduced = false, have_compute_dtype = false;
    for (const auto& path : paths) {
        set.source += (set.source.empty() ? "" : "+") + path.string();
        auto file = SafetensorsFile::open(path);
        for (const auto& [key, value] : read_metadata(path)) {
            if (key == "compute_dtype") {
                if (value == "bf16") set.compute_dtype = DType::bf16, have_compute_dtype = true;
                else if (value == "f16") set.compute_dtype = DType::f16, have_compute_dtype = true;
                else if (value == "f32" && !have_compute_dtype) have_compute_dtype = true;
            } else {
                set.metadata[key] = value;
            }
        }
        for (const TensorInfo& info : file->tensors()) {
            switch (info.dtype) {
                case DType::f32: case DType::bf16: case DType::f16: case DType::i32: case DType::i64: break;
                default: continue;  // not an activation (fp8 weights in a checkpoint, ...)
            }
            any_reduced = any_reduced || reduced_precision(info.dtype);
            set.tensors[names.apply(info.name)] = to_activation(info.dtype, info.shape, info.data);
        }
    }
    if (!have_compute_dtype && any_reduced) set.compute_dtype = DType::bf16;
    return set;
}

// ---- comparison -----------------------------------------------------------------------------

double Thresholds::for_pair(DType a_compute, DType b_compute) const {
    if (override_all) return *override_all;
    return reduced_precision(a_compute) || reduced_precision(b_compute) ? reduced : f32;
}

const TensorDiff* Report::first_failure() const {
    for (const TensorDiff& d : diffs)
        if (d.fails()) return &d;
    return nullptr;
}

namespace {

TensorDiff diff_tensor(const std::string& full_name, const Activation& a, const Activation& b, double threshold) {
    TensorDiff d;
    d.full_name = full_name;
    std::tie(d.name, d.layer) = split_tensor_name(full_name);
    d.shape_a = a.shape;
    d.shape_b = b.shape;
    d.threshold = threshold;
    // Router choices are integers in xinfer; a dump converted to floats keeps the name.
    d.integer = a.is_integer() || b.is_integer() || d.name == "expert_ids";
    d.numel = int64_t(b.values.size());
    if (!compatible_shapes(a.shape, b.shape) || a.values.size() != b.values.size()) {
        d.shape_mismatch = true;
        d.rel = d.nmse = kInf;
        d.over = true;
        return d;
    }
    double max_diff = 0, max_b = 0, sum_sq_diff = 0, sum_sq_b = 0;
    bool inf_mismatch = false;
    for (size_t i = 0; i < a.values.size(); ++i) {
        const double x = a.values[i], y = b.values[i];
        if (d.integer) {
            d.mismatches += x != y;
            continue;
        }
        if (std::isnan(x) || std::isnan(y)) {
            ++d.nan_count;
            continue;
        }
        if (std::isinf(x) || std::isinf(y)) {
            inf_mismatch = inf_mismatch || x != y;  // infinities must match in sign (llama.cpp's rule)
            continue;
        }
        const double diff = std::fabs(x - y);
        max_diff = std::max(max_diff, diff);
        max_b = std::max(max_b, std::fabs(y));
        sum_sq_diff += diff * diff;
        sum_sq_b += y * y;
    }
    if (d.integer) {
        d.over = d.mismatches > 0;
        return d;
    }
    d.max_abs = max_diff;
    d.rel = max_diff == 0 ? 0 : max_b == 0 ? kInf : max_diff / max_b;
    d.nmse = sum_sq_diff == 0 ? 0 : sum_sq_b == 0 ? kInf : sum_sq_diff / sum_sq_b;
    if (d.nan_count > 0 || inf_mismatch) d.rel = d.nmse = kInf;
    d.over = !(d.rel <= threshold);
    return d;
}

}  // namespace

Report compare(const ActivationSet& a, const ActivationSet& b, const CompareOptions& options) {
    Report report;
    report.a_source = fmt::format("{} ({})", a.source, dtype_name(a.compute_dtype));
    report.b_source = fmt::format("{} ({})", b.source, dtype_name(b.compute_dtype));
    report.threshold = options.thresholds.for_pair(a.compute_dtype, b.compute_dtype);
    auto selected = [&](const std::string& name) { return !options.names || std::regex_search(name, *options.names); };
    for (const auto& [name, act_a] : a.tensors) {
        if (!selected(name)) continue;
        auto it = b.tensors.find(name);
        if (it == b.tensors.end()) {
            report.only_a.push_back(name);
            continue;
        }
        const Activation& act_b = it->second;
        // A tensor stored in bf16/f16 on either side gets the reduced-precision threshold.
        const double threshold = options.thresholds.for_pair(reduced_precision(act_a.dtype) ? act_a.dtype : a.compute_dtype,
                                                             reduced_precision(act_b.dtype) ? act_b.dtype : b.compute_dtype);
        report.diffs.push_back(diff_tensor(name, act_a, act_b, threshold));
    }
    for (const auto& [name, act] : b.tensors)
        if (selected(name) && !a.tensors.contains(name)) report.only_b.push_back(name);
    if (report.diffs.empty())
        fail("xray: no tensor names in common between a ({}: {} tensors) and b ({}: {} tensors)", a.source,
             a.tensors.size(), b.source, b.tensors.size());
    std::sort(report.diffs.begin(), report.diffs.end(), [](const TensorDiff& x, const TensorDiff& y) {
        return forward_order_key(x.full_name) < forward_order_key(y.full_name);
    });
    for (std::vector<std::string>* names : {&report.only_a, &report.only_b})
        std::sort(names->begin(), names->end(),
                  [](const std::string& x, const std::string& y) { return forward_order_key(x) < forward_order_key(y); });

    // The router rule (xray.h): expert choices that flipped without moving the layer's output
    // beyond tolerance are excused, with the expert weights that went with them.
    std::map<std::pair<int, std::string>, TensorDiff*> by_layer;
    for (TensorDiff& d : report.diffs) by_layer[{d.layer, d.name}] = &d;
    for (TensorDiff& d : report.diffs) {
        if (d.name != "expert_ids" || !d.over || d.shape_mismatch) continue;
        auto ffn = by_layer.find({d.layer, "ffn_output"});
        if (ffn == by_layer.end() || ffn->second->over) continue;
        d.excused = true;
        if (auto w = by_layer.find({d.layer, "expert_weights"}); w != by_layer.end() && w->second->over)
            w->second->excused = true;
    }
    return report;
}

std::string format_report(const Report& report) {
    std::string out = fmt::format("xray: a = {}, b = {}; rel = max|a-b|/max|b|, nmse = sum((a-b)^2)/sum(b^2); "
                                  "threshold {:.0e} on rel ('!' over, '~' over but excused by the router rule)\n",
                                  report.a_source, report.b_source, report.threshold);
    // Column names of the layer tables in forward order, and the set of layers.
    std::vector<std::string> columns;
    std::set<int> layers;
    std::map<std::pair<int, std::string>, const TensorDiff*> cells;
    std::vector<const TensorDiff*> before, after;
    for (const TensorDiff& d : report.diffs) {
        if (d.layer < 0) {
            (std::get<0>(forward_order_key(d.full_name)) == 0 ? before : after).push_back(&d);
            continue;
        }
        layers.insert(d.layer);
        cells[{d.layer, d.name}] = &d;
        if (std::find(columns.begin(), columns.end(), d.name) == columns.end()) columns.push_back(d.name);
    }
    std::sort(columns.begin(), columns.end(), [](const std::string& x, const std::string& y) {
        return forward_order_key(tensor_name(x, 0)) < forward_order_key(tensor_name(y, 0));
    });
    auto global_rows = [&](const std::vector<const TensorDiff*>& rows) {
        for (const TensorDiff* d : rows)
            out += fmt::format("{:<14} rel {:<10} nmse {}\n", d->name, cell_text(*d, false), cell_text(*d, true));
    };
    auto table = [&](const char* title, bool nmse) {
        if (layers.empty()) return;
        std::vector<size_t> widths;
        std::string header = fmt::format("{:<6}", "layer");
        for (const std::string& c : columns) {
            size_t width = std::max<size_t>(c.size(), 8);
            for (int layer : layers)
                if (auto it = cells.find({layer, c}); it != cells.end())
                    width = std::max(width, cell_text(*it->second, nmse).size());
            widths.push_back(width);
            header += fmt::format(" {:<{}}", c, width);
        }
        out += fmt::format("{}\n{}\n", title, header);
        for (int layer : layers) {
            std::string row = fmt::format("{:<6}", layer);
            for (size_t i = 0; i < columns.size(); ++i) {
                auto it = cells.find({layer, columns[i]});
                row += fmt::format(" {:<{}}", it == cells.end() ? "-" : cell_text(*it->second, nmse), widths[i]);
            }
            out += row + "\n";
        }
    };
    global_rows(before);
    table("relative error (integer tensors: mismatching elements / total)", false);
    table("NMSE", true);
    global_rows(after);
    // One side often holds far more names than the other (a reference with hidden states only).
    auto only = [&](const char* side, const std::vector<std::string>& names) {
        if (names.empty()) return;
        constexpr size_t kShown = 8;
        const std::vector<std::string> shown(names.begin(), names.begin() + long(std::min(names.size(), kShown)));
        out += fmt::format("only in {} ({}, not compared): {}{}\n", side, names.size(), fmt::join(shown, ", "),
                           names.size() > kShown ? ", ..." : "");
    };
    only("a", report.only_a);
    only("b", report.only_b);
    for (const TensorDiff& d : report.diffs)
        if (d.excused)
            out += fmt::format("excused: {}: {} (ffn_output of layer {} within threshold)\n", where(d), why(d), d.layer);
    size_t failing = 0;
    for (const TensorDiff& d : report.diffs) failing += d.fails();
    if (const TensorDiff* first = report.first_failure()) {
        out += fmt::format("FIRST over threshold (forward order): {}: {}\n", where(*first), why(*first));
        out += fmt::format("{} of {} compared tensors over threshold\n", failing, report.diffs.size());
    } else {
        out += fmt::format("OK: all {} compared tensors within threshold\n", report.diffs.size());
    }
    return out;
}

}  // namespace xinfer::xray
