#include "loader/safetensors_file.h"

#include "core/status.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace xinfer {

namespace {

constexpr size_t kLengthPrefix = 8;  // the header length, a little-endian u64

const char* kKnownDtypes = "F32, F16, BF16, F8_E4M3, F8_E8M0, I32, I64, U8";

// Closes a file descriptor on every path out of open().
struct FileDescriptor {
    int fd = -1;
    ~FileDescriptor() {
        if (fd >= 0) ::close(fd);
    }
};

std::string shape_text(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

// A non-negative JSON integer, or nullopt for anything else (negative, float, string, ...).
std::optional<uint64_t> as_unsigned(const nlohmann::json& value) {
    if (value.is_number_unsigned()) return value.get<uint64_t>();
    if (value.is_number_integer() && value.get<int64_t>() >= 0) return uint64_t(value.get<int64_t>());
    return std::nullopt;
}

}  // namespace

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
    std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
    file->path_ = path;

    FileDescriptor descriptor;
    descriptor.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (descriptor.fd < 0) fail("{}: cannot open: {}", path.string(), std::strerror(errno));
    struct stat status {};
    if (::fstat(descriptor.fd, &status) != 0) fail("{}: cannot stat: {}", path.string(), std::strerror(errno));
    file->size_ = size_t(status.st_size);
    if (file->size_ < kLengthPrefix) {
        fail("{}: truncated: {} bytes, but a safetensors file starts with an 8-byte header length", path.string(),
             file->size_);
    }
    // MAP_PRIVATE + PROT_READ: the weights are never written through this mapping, and a file
    // replaced on disk while we run cannot change bytes we already validated.
    void* mapping = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, descriptor.fd, 0);
    if (mapping == MAP_FAILED)
        fail("{}: mmap of {} bytes failed: {}", path.string(), file->size_, std::strerror(errno));
    file->base_ = static_cast<const uint8_t*>(mapping);

    file->parse_header();
    return file;
}

SafetensorsFile::~SafetensorsFile() {
    if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
}

void SafetensorsFile::parse_header() {
    const std::string file = path_.string();
    uint64_t header_length = 0;
    for (size_t i = 0; i < kLengthPrefix; ++i) header_length |= uint64_t(base_[i]) << (8 * i);
    if (header_length > size_ - kLengthPrefix) {
        fail("{}: header length {} runs past the end of the file ({} bytes; at most {} available for the header)", file,
             header_length, size_, size_ - kLengthPrefix);
    }
    const uint8_t* header_begin = base_ + kLengthPrefix;
    nlohmann::json header;
    try {
        header = nlohmann::json::parse(header_begin, header_begin + header_length);
    } catch (const nlohmann::json::parse_error& error) {
        // nlohmann's message carries the byte position inside the header.
        fail("{}: invalid JSON in the {}-byte safetensors header: {}", file, header_length, error.what());
    }
    if (!header.is_object()) fail("{}: safetensors header is not a JSON object but {}", file, header.type_name());

    const uint8_t* data_begin = header_begin + header_length;
    const uint64_t data_size = size_ - kLengthPrefix - header_length;
    struct Range {
        uint64_t begin, end;
        size_t tensor;  // index into tensors_
    };
    std::vector<Range> ranges;

    for (const auto& [name, entry] : header.items()) {
        if (name == "__metadata__") continue;
        const auto field = [&](const char* key) -> const nlohmann::json& {
            if (!entry.is_object() || !entry.contains(key)) {
                fail("{}: tensor {}: header entry lacks \"{}\": {}", file, name, key, entry.dump());
            }
            return entry.at(key);
        };

        TensorInfo info;
        info.name = name;
        info.file = path_;

        const nlohmann::json& dtype = field("dtype");
        const std::optional<DType> parsed_dtype =
            dtype.is_string() ? dtype_from_safetensors(dtype.get<std::string>()) : std::nullopt;
        if (!parsed_dtype)
            fail("{}: tensor {}: unknown dtype {} (expected one of {})", file, name, dtype.dump(), kKnownDtypes);
        info.dtype = *parsed_dtype;

        const nlohmann::json& shape = field("shape");
        if (!shape.is_array())
            fail("{}: tensor {}: shape must be a list of integers, found {}", file, name, shape.dump());
        for (const nlohmann::json& dim : shape) {
            if (!dim.is_number_integer()) {
                fail("{}: tensor {}: shape must be a list of integers, found {}", file, name, shape.dump());
            }
            if (dim.get<int64_t>() < 0) fail("{}: tensor {}: negative dimension in shape {}", file, name, shape.dump());
            info.shape.push_back(dim.get<int64_t>());
        }

        const nlohmann::json& offsets = field("data_offsets");
        std::optional<uint64_t> begin, end;
        if (offsets.is_array() && offsets.size() == 2) {
            begin = as_unsigned(offsets[0]);
            end = as_unsigned(offsets[1]);
        }
        if (!begin || !end || *end < *begin) {
            fail("{}: tensor {}: data_offsets must be [begin, end] with 0 <= begin <= end, found {}", file, name,
                 offsets.dump());
        }

        uint64_t expected_bytes = dtype_size(info.dtype);
        for (int64_t dim : info.shape) {
            if (__builtin_mul_overflow(expected_bytes, uint64_t(dim), &expected_bytes)) {
                fail("{}: tensor {}: shape {} overflows a 64-bit byte count", file, name, shape_text(info.shape));
            }
        }
        if (*end - *begin != expected_bytes) {
            fail("{}: tensor {}: data_offsets [{}, {}] hold {} bytes, but {} {} needs {} bytes", file, name, *begin,
                 *end, *end - *begin, dtype.get<std::string>(), shape_text(info.shape), expected_bytes);
        }
        if (*end > data_size) {
            fail(
                "{}: tensor {}: data_offsets [{}, {}] run past the end of the file (the data section has {} bytes; "
                "file truncated?)",
                file, name, *begin, *end, data_size);
        }
        info.data = data_begin + *begin;
        info.nbytes = size_t(expected_bytes);
        tensors_.push_back(std::move(info));
        ranges.push_back({*begin, *end, tensors_.size() - 1});
    }

    // The data section must be tiled exactly: no two tensors share bytes (a writer bug that would
    // silently alias weights), and no unowned bytes lie between or after them (the format forbids
    // holes; an unexplained tail usually means a file was concatenated or overwritten).
    std::sort(ranges.begin(), ranges.end(),
              [](const Range& a, const Range& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    uint64_t covered = 0;
    const Range* previous = nullptr;
    for (const Range& range : ranges) {
        const std::string& name = tensors_[range.tensor].name;
        if (range.begin < covered) {
            const std::string& previous_name = tensors_[previous->tensor].name;
            fail("{}: tensors {} [{}, {}) and {} [{}, {}) overlap", file, previous_name, previous->begin, previous->end,
                 name, range.begin, range.end);
        }
        if (range.begin > covered) {
            fail("{}: {} unused bytes [{}, {}) before tensor {} (safetensors data must have no holes)", file,
                 range.begin - covered, covered, range.begin, name);
        }
        covered = range.end;
        previous = &range;
    }
    if (covered != data_size) {
        fail("{}: data section has {} bytes but its tensors cover only {} ({} trailing bytes)", file, data_size,
             covered, data_size - covered);
    }
    std::sort(tensors_.begin(), tensors_.end(),
              [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
}

}  // namespace xinfer
