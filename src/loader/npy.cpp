#include "loader/npy.h"

#include "core/status.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

namespace xinfer {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;

// The Python tuple literal NumPy writes for a shape: "()", "(5,)", "(2, 3)".
std::string shape_tuple(const std::vector<int64_t>& shape) {
    std::string text = "(";
    for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
    if (shape.size() == 1) text += ",";
    return text + ")";
}

// The text of the value after `'key':` in the header dict, up to the next top-level comma
// (or the closing parenthesis for a tuple). The header is a Python literal NumPy writes itself,
// so this small scanner is enough; anything unexpected is reported with the whole header.
std::string dict_value(const std::filesystem::path& path, const std::string& header, const std::string& key) {
    const std::string needle = "'" + key + "':";
    const size_t at = header.find(needle);
    if (at == std::string::npos) fail("{}: .npy header has no '{}': {}", path.string(), key, header);
    size_t begin = header.find_first_not_of(' ', at + needle.size());
    if (begin == std::string::npos) fail("{}: malformed .npy header: {}", path.string(), header);
    const size_t end = header[begin] == '(' ? header.find(')', begin) + 1 : header.find_first_of(",}", begin);
    if (end == std::string::npos || end == 0) fail("{}: malformed .npy header: {}", path.string(), header);
    return header.substr(begin, end - begin);
}

std::vector<int64_t> parse_shape(const std::filesystem::path& path, const std::string& tuple) {
    std::vector<int64_t> shape;
    std::string number;
    for (char ch : tuple.substr(1)) {
        if (ch >= '0' && ch <= '9') {
            number += ch;
        } else if (ch == ',' || ch == ')') {
            if (!number.empty()) shape.push_back(std::stoll(number));
            number.clear();
        } else if (ch != ' ') {
            fail("{}: .npy shape {} is not a tuple of non-negative integers", path.string(), tuple);
        }
    }
    return shape;
}

}  // namespace

void write_npy_f32(const std::filesystem::path& path, const float* data, std::vector<int64_t> shape) {
    int64_t numel = 1;
    for (int64_t dim : shape) {
        if (dim < 0) fail("{}: cannot write shape {} (negative dimension)", path.string(), shape_tuple(shape));
        numel *= dim;
    }
    std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_tuple(shape) + ", }";
    // Version 1.0 preamble: 6 magic bytes, 2 version bytes, a 2-byte little-endian header length.
    constexpr size_t kPreamble = kMagicSize + 2 + 2;
    const size_t unpadded = kPreamble + header.size() + 1;  // +1 for the terminating newline
    header.append((64 - unpadded % 64) % 64, ' ');
    header += '\n';
    if (header.size() > 0xffff) fail("{}: shape {} makes the .npy header too long", path.string(), shape_tuple(shape));

    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) fail("{}: cannot open for writing", path.string());
    out.write(kMagic, kMagicSize);
    const char version_and_length[4] = {1, 0, char(header.size() & 0xff), char(header.size() >> 8)};
    out.write(version_and_length, 4);
    out.write(header.data(), std::streamsize(header.size()));
    out.write(reinterpret_cast<const char*>(data), std::streamsize(size_t(numel) * sizeof(float)));
    out.close();
    if (!out) fail("{}: write failed", path.string());
}

NpyArray read_npy_f32(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("{}: cannot open .npy file", path.string());
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());

    if (bytes.size() < kMagicSize + 4 || std::memcmp(bytes.data(), kMagic, kMagicSize) != 0) {
        fail("{}: not a .npy file (missing the \\x93NUMPY magic)", path.string());
    }
    const auto byte = [&](size_t i) { return size_t(uint8_t(bytes[i])); };
    const size_t major = byte(6);
    size_t header_begin = 0, header_length = 0;
    if (major == 1) {
        header_begin = 10;
        header_length = byte(8) | byte(9) << 8;
    } else if ((major == 2 || major == 3) && bytes.size() >= 12) {
        header_begin = 12;
        header_length = byte(8) | byte(9) << 8 | byte(10) << 16 | byte(11) << 24;
    } else {
        fail("{}: unsupported .npy version {}.{}", path.string(), major, byte(7));
    }
    if (header_begin + header_length > bytes.size()) {
        fail("{}: .npy header of {} bytes runs past the end of the file ({} bytes)", path.string(), header_length,
             bytes.size());
    }
    const std::string header = bytes.substr(header_begin, header_length);

    const std::string descr = dict_value(path, header, "descr");
    if (descr != "'<f4'") fail("{}: expected dtype '<f4' (little-endian float32), found {}", path.string(), descr);
    const std::string fortran = dict_value(path, header, "fortran_order");
    if (fortran != "False") fail("{}: expected C order (fortran_order False), found {}", path.string(), fortran);

    NpyArray array;
    array.shape = parse_shape(path, dict_value(path, header, "shape"));
    size_t numel = 1;
    for (int64_t dim : array.shape) numel *= size_t(dim);
    const size_t data_begin = header_begin + header_length;
    const size_t data_bytes = bytes.size() - data_begin;
    if (data_bytes != numel * sizeof(float)) {
        fail("{}: shape {} needs {} bytes of float32 data, found {}", path.string(), shape_tuple(array.shape),
             numel * sizeof(float), data_bytes);
    }
    array.data.resize(numel);
    std::memcpy(array.data.data(), bytes.data() + data_begin, data_bytes);
    return array;
}

}  // namespace xinfer
