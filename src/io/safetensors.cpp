// safetensors reader and writer. Reading mirrors Metadata::validate / read_metadata of the
// reference Rust library (huggingface/safetensors 24b0b28), with every failure a Status naming the
// file; all arithmetic on header numbers is overflow-checked and no byte outside the file is ever
// touched. nlohmann keeps only the last of duplicate JSON keys, so the header is parsed with a
// callback that records the keys of every object and reports the first duplicate.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <utility>

#include "core/json_limits.h"
#include "io/atomic_file.h"
#include "io/read_file.h"

namespace packmoe::io {
namespace {

using Json = nlohmann::json;

struct DtypeInfo {
  std::string_view name;
  size_t bits;
};

// The reference `Dtype` enum in declaration order, which is increasing alignment; the writer sorts
// by descending position here. Do not reorder.
constexpr std::array<DtypeInfo, 22> kDtypes = {{
    {"BOOL", 8},        {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},
    {"I8", 8},          {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},
    {"F8_E5M2FNUZ", 8}, {"I16", 16},    {"U16", 16},    {"F16", 16},    {"BF16", 16},
    {"I32", 32},        {"U32", 32},    {"F32", 32},    {"C64", 64},    {"F64", 64},
    {"I64", 64},        {"U64", 64},
}};

int dtype_rank(std::string_view dtype) {
  for (size_t i = 0; i < kDtypes.size(); ++i) {
    if (kDtypes[i].name == dtype) return static_cast<int>(i);
  }
  return -1;
}

// Names and dtypes come from untrusted files: escape control bytes so an error stays one printable
// line. Header strings were checked to be UTF-8 by the JSON parser; other text (a JSON error's
// "last read" excerpt, a name a caller passed to the writer) may not be, so escape non-ASCII too.
std::string printable(std::string_view s, bool escape_non_ascii = false) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7F || (escape_non_ascii && c >= 0x80)) {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string offsets_text(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// Bytes of a tensor of `bits`-bit elements; on failure returns false and says why. Dimensions must
// already be non-negative.
bool tensor_nbytes(const std::vector<int64_t>& shape, std::string_view dtype, size_t bits,
                   uint64_t* nbytes, std::string* why) {
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      *why = "shape " + shape_text(shape) + " overflows a 64-bit element count";
      return false;
    }
  }
  uint64_t nbits = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(bits), &nbits)) {
    *why = "shape " + shape_text(shape) + " of " + std::string(dtype) +
           " overflows a 64-bit bit count";
    return false;
  }
  if (nbits % 8 != 0) {
    *why = "shape " + shape_text(shape) + " of " + std::string(dtype) + " (" +
           std::to_string(bits) + "-bit) is not a whole number of bytes";
    return false;
  }
  *nbytes = nbits / 8;
  return true;
}

// nlohmann messages start with "[json.exception.parse_error.101] "; the tag means nothing to users.
std::string json_error_text(const Json::exception& e) {
  std::string_view s = e.what();
  if (size_t p = s.find("] "); !s.empty() && s[0] == '[' && p != std::string_view::npos) {
    s.remove_prefix(p + 2);
  }
  return printable(s, /*escape_non_ascii=*/true);
}

// A JSON string literal exactly as serde_json writes it (same escapes, UTF-8 passed through).
bool json_quote(const std::string& s, std::string* out) {
  try {
    *out = Json(s).dump();
    return true;
  } catch (const Json::exception&) {
    return false;  // invalid UTF-8
  }
}

struct ParsedEntry {
  SafetensorsEntry entry;
  uint64_t begin;
  uint64_t end;
};

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- reading ------------------------------------------------------------------------------------

Result<SafetensorsFile> SafetensorsFile::read(const std::string& path) {
  Result<RegularFile> f = RegularFile::open(path);  // never a FIFO or a device
  if (!f) return f.status();
  std::vector<uint8_t> bytes(static_cast<size_t>(f.value().size()));
  PACKMOE_RETURN_IF_ERROR(f.value().read_at(path, 0, bytes.data(), bytes.size()));
  return parse(std::move(bytes), path);
}

Result<SafetensorsFile> SafetensorsFile::parse(std::vector<uint8_t> bytes,
                                               const std::string& what_for_errors) {
  const std::string& what = what_for_errors;
  auto fail = [&](const std::string& problem) { return Status::error(what + ": " + problem); };

  if (bytes.size() < 8) {
    return fail("file is " + std::to_string(bytes.size()) +
                " bytes, shorter than the 8-byte header length of a safetensors file");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<size_t>(i)];
  if (n > kSafetensorsMaxHeaderBytes) {
    return fail("header length " + std::to_string(n) + " is too large (limit " +
                std::to_string(kSafetensorsMaxHeaderBytes) + "; not a safetensors file?)");
  }
  if (n > bytes.size() - 8) {
    return fail("header length " + std::to_string(n) + " runs past the end of the file (" +
                std::to_string(bytes.size() - 8) + " bytes follow the length)");
  }
  const uint64_t buffer_size = bytes.size() - 8 - n;

  // Keys of every open object, to catch duplicates nlohmann would silently merge.
  std::vector<std::set<std::string>> open_keys;
  std::string top_key;  // the top-level key whose value is being parsed
  bool has_duplicate = false;
  bool duplicate_is_top = false;
  std::string duplicate, duplicate_parent;
  auto on_event = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        open_keys.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        open_keys.pop_back();
        break;
      case Json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        const bool top = open_keys.size() == 1;
        if (!open_keys.back().insert(key).second && !has_duplicate) {
          has_duplicate = true;
          duplicate_is_top = top;
          duplicate = key;
          duplicate_parent = top_key;
        }
        if (top) top_key = key;
        break;
      }
      default:
        break;
    }
    return true;
  };
  const char* text = reinterpret_cast<const char*>(bytes.data() + 8);
  // The reference reader (serde_json) refuses a byte-order mark, which nlohmann would skip, and
  // any NUL, where nlohmann would stop reading; nesting is bounded (core/json_limits.h).
  if (n >= 3 && std::string_view(text, 3) == "\xEF\xBB\xBF")
    return fail("header starts with a UTF-8 byte-order mark (not allowed in safetensors)");
  if (Status s = check_json_text(std::string_view(text, n), "header"); !s) return fail(s.message());
  Json header;
  try {
    header = Json::parse(text, text + n, on_event);
  } catch (const Json::exception& e) {
    return fail("header is not valid JSON: " + json_error_text(e));
  }
  if (!header.is_object()) return fail("header is not a JSON object");
  if (has_duplicate && duplicate_is_top) {
    return fail("duplicate tensor name '" + printable(duplicate) + "' in header");
  }
  if (has_duplicate) {
    return fail("duplicate key '" + printable(duplicate) + "' inside header entry '" +
                printable(duplicate_parent) + "'");
  }

  SafetensorsFile file;
  std::vector<ParsedEntry> parsed;
  parsed.reserve(header.size());
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (value.is_null()) continue;  // the reference reader takes null as "no metadata"
      if (!value.is_object()) return fail("__metadata__ is not a JSON object");
      for (const auto& [key, v] : value.items()) {
        if (!v.is_string()) {
          return fail("__metadata__ key '" + printable(key) +
                      "' is not a string (values must be strings)");
        }
        file.metadata_[key] = v.get<std::string>();
      }
      continue;
    }
    const std::string& tensor = name;  // a lambda may not capture a structured binding (clang 14)
    auto tfail = [&](const std::string& problem) {
      return fail("tensor '" + printable(tensor) + "': " + problem);
    };
    if (!value.is_object()) return tfail("header entry is not a JSON object");
    // Other keys are ignored, as the reference reader does.
    auto dtype_it = value.find("dtype");
    auto shape_it = value.find("shape");
    auto offsets_it = value.find("data_offsets");
    if (dtype_it == value.end()) return tfail("missing \"dtype\"");
    if (shape_it == value.end()) return tfail("missing \"shape\"");
    if (offsets_it == value.end()) return tfail("missing \"data_offsets\"");

    if (!dtype_it->is_string()) return tfail("\"dtype\" is not a string");
    ParsedEntry p;
    p.entry.name = name;
    p.entry.dtype = dtype_it->get<std::string>();
    size_t bits = safetensors_dtype_bits(p.entry.dtype);
    if (bits == 0) return tfail("unknown dtype \"" + printable(p.entry.dtype) + "\"");

    if (!shape_it->is_array()) return tfail("\"shape\" is not an array");
    for (const Json& d : *shape_it) {
      if (d.is_number_integer() && !d.is_number_unsigned()) {
        return tfail("shape dimension " + std::to_string(d.get<int64_t>()) + " is negative");
      }
      if (!d.is_number_unsigned()) return tfail("\"shape\" holds a non-integer " + json_brief(d));
      uint64_t u = d.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return tfail("shape dimension " + std::to_string(u) + " overflows int64");
      }
      p.entry.shape.push_back(static_cast<int64_t>(u));
    }

    if (!offsets_it->is_array() || offsets_it->size() != 2 ||
        !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
      return tfail("\"data_offsets\" must be two non-negative integers, got " +
                   json_brief(*offsets_it));
    }
    p.begin = (*offsets_it)[0].get<uint64_t>();
    p.end = (*offsets_it)[1].get<uint64_t>();
    if (p.begin > p.end) {
      return tfail("data_offsets " + offsets_text(p.begin, p.end) + " are reversed");
    }
    if (p.end > buffer_size) {
      return tfail("data_offsets " + offsets_text(p.begin, p.end) + " run past the end of the " +
                   std::to_string(buffer_size) + "-byte data buffer");
    }
    uint64_t nbytes = 0;
    std::string why;
    if (!tensor_nbytes(p.entry.shape, p.entry.dtype, bits, &nbytes, &why)) return tfail(why);
    if (nbytes != p.end - p.begin) {
      return tfail("data_offsets " + offsets_text(p.begin, p.end) + " hold " +
                   std::to_string(p.end - p.begin) + " bytes but shape " +
                   shape_text(p.entry.shape) + " of " + p.entry.dtype + " needs " +
                   std::to_string(nbytes));
    }
    parsed.push_back(std::move(p));
  }

  // items() walks names in sorted order, so a stable sort leaves equal offsets sorted by name.
  std::stable_sort(parsed.begin(), parsed.end(), [](const ParsedEntry& a, const ParsedEntry& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  // The tensors must tile the buffer exactly: a hole or trailing bytes could hide a second payload.
  uint64_t pos = 0;
  const std::string* previous = nullptr;
  for (const ParsedEntry& p : parsed) {
    if (p.begin > pos) {
      return fail("hole in the data buffer: bytes " + offsets_text(pos, p.begin) +
                  " belong to no tensor (before tensor '" + printable(p.entry.name) + "')");
    }
    if (p.begin < pos) {
      return fail("tensor '" + printable(p.entry.name) + "' data_offsets " +
                  offsets_text(p.begin, p.end) + " overlap tensor '" + printable(*previous) +
                  "' (which ends at " + std::to_string(pos) + ")");
    }
    pos = p.end;
    previous = &p.entry.name;
  }
  if (pos != buffer_size) {
    return fail("trailing bytes: tensors cover " + std::to_string(pos) + " of the " +
                std::to_string(buffer_size) + "-byte data buffer, the last " +
                std::to_string(buffer_size - pos) + " belong to no tensor");
  }

  file.file_ = std::move(bytes);
  file.source_ = what;
  file.header_bytes_ = n;
  const uint8_t* data = file.file_.data() + 8 + n;
  file.entries_.reserve(parsed.size());
  for (ParsedEntry& p : parsed) {
    p.entry.bytes = std::span<const uint8_t>(data + p.begin, p.end - p.begin);
    file.index_.emplace(p.entry.name, file.entries_.size());
    file.entries_.push_back(std::move(p.entry));
  }
  return file;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

// ---- writing ------------------------------------------------------------------------------------

void SafetensorsWriter::add(std::string name, std::string_view dtype, std::vector<int64_t> shape,
                            std::vector<uint8_t> bytes) {
  tensors_.push_back({std::move(name), std::string(dtype), std::move(shape), std::move(bytes)});
}

void SafetensorsWriter::add(std::string name, std::string_view dtype, std::vector<int64_t> shape,
                            std::span<const uint8_t> bytes) {
  add(std::move(name), dtype, std::move(shape), std::vector<uint8_t>(bytes.begin(), bytes.end()));
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

Status SafetensorsWriter::prepare(const std::string& what, std::string* header,
                                  std::vector<size_t>* order) const {
  auto fail = [&](const std::string& problem) { return Status::error(what + ": " + problem); };
  std::set<std::string_view> names;
  std::vector<uint64_t> sizes(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    auto tfail = [&](const std::string& problem) {
      return fail("cannot write tensor '" + printable(t.name) + "': " + problem);
    };
    if (t.name == "__metadata__") return tfail("the name is reserved for the metadata object");
    if (!names.insert(t.name).second) return tfail("duplicate tensor name");
    size_t bits = safetensors_dtype_bits(t.dtype);
    if (bits == 0) return tfail("unknown dtype \"" + printable(t.dtype, true) + "\"");
    for (int64_t d : t.shape) {
      if (d < 0) return tfail("shape " + shape_text(t.shape) + " has a negative dimension");
    }
    std::string why;
    if (!tensor_nbytes(t.shape, t.dtype, bits, &sizes[i], &why)) return tfail(why);
    if (sizes[i] != t.bytes.size()) {
      return tfail("shape " + shape_text(t.shape) + " of " + t.dtype + " needs " +
                   std::to_string(sizes[i]) + " bytes, got " + std::to_string(t.bytes.size()));
    }
  }

  order->resize(tensors_.size());
  for (size_t i = 0; i < order->size(); ++i) (*order)[i] = i;
  // The reference order: widest dtype first, then by name (byte-wise, as Rust's String compares).
  std::sort(order->begin(), order->end(), [&](size_t a, size_t b) {
    int ra = dtype_rank(tensors_[a].dtype), rb = dtype_rank(tensors_[b].dtype);
    if (ra != rb) return ra > rb;
    return tensors_[a].name < tensors_[b].name;
  });

  std::string h = "{";
  std::string q;
  if (!metadata_.empty()) {
    h += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata_) {
      if (!json_quote(key, &q)) {
        return fail("metadata key '" + printable(key, true) + "' is not valid UTF-8");
      }
      h += (first ? "" : ",") + q + ":";
      if (!json_quote(value, &q)) {
        return fail("metadata value of '" + printable(key, true) + "' is not valid UTF-8");
      }
      h += q;
      first = false;
    }
    h += "}";
  }
  uint64_t offset = 0;
  for (size_t i : *order) {
    const Tensor& t = tensors_[i];
    if (!json_quote(t.name, &q)) {
      return fail("tensor name '" + printable(t.name, true) + "' is not valid UTF-8");
    }
    if (h.size() > 1) h += ",";
    h += q + ":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (size_t d = 0; d < t.shape.size(); ++d) h += (d ? "," : "") + std::to_string(t.shape[d]);
    h += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + sizes[i]) +
         "]}";
    offset += sizes[i];
  }
  h += "}";
  // Padding to 8 puts the data buffer, and with the order above every tensor, at an aligned offset.
  h.resize((h.size() + 7) / 8 * 8, ' ');
  if (h.size() > kSafetensorsMaxHeaderBytes) {
    return fail("header of " + std::to_string(h.size()) + " bytes exceeds the reader limit of " +
                std::to_string(kSafetensorsMaxHeaderBytes));
  }
  *header = std::move(h);
  return Status::ok();
}

Result<std::vector<uint8_t>> SafetensorsWriter::serialize() const {
  std::string header;
  std::vector<size_t> order;
  PACKMOE_RETURN_IF_ERROR(prepare("safetensors writer", &header, &order));
  size_t total = 8 + header.size();
  for (const Tensor& t : tensors_) total += t.bytes.size();
  std::vector<uint8_t> out;
  out.reserve(total);
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<uint8_t>(uint64_t{header.size()} >> (8 * i)));
  }
  out.insert(out.end(), header.begin(), header.end());
  for (size_t i : order) out.insert(out.end(), tensors_[i].bytes.begin(), tensors_[i].bytes.end());
  return out;
}

Status SafetensorsWriter::write(const std::string& path) const {
  std::string header;
  std::vector<size_t> order;
  PACKMOE_RETURN_IF_ERROR(prepare(path, &header, &order));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t{header.size()} >> (8 * i));
  std::vector<std::span<const uint8_t>> parts;
  parts.emplace_back(len, 8);
  parts.emplace_back(reinterpret_cast<const uint8_t*>(header.data()), header.size());
  for (size_t k : order) parts.emplace_back(tensors_[k].bytes);
  return write_file_atomic(path, parts);
}

// ---- dtypes -------------------------------------------------------------------------------------

std::string_view dtype_to_safetensors(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kE4M3:
      return "F8_E4M3";
    case DType::kE5M2:
      return "F8_E5M2";
    case DType::kE8M0:
      return "F8_E8M0";
    case DType::kE2M1:
      return "F4";
    case DType::kU8:
      return "U8";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
  }
  PACKMOE_CHECK(false, "unknown DType " << static_cast<int>(t));
}

Result<DType> dtype_from_safetensors(std::string_view dtype) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kE4M3, DType::kE5M2, DType::kE8M0, DType::kE2M1,
                  DType::kU8, DType::kI32, DType::kI64}) {
    if (dtype_to_safetensors(t) == dtype) return t;
  }
  if (safetensors_dtype_bits(dtype) != 0) {
    return Status::error("unsupported safetensors dtype " + std::string(dtype));
  }
  return Status::error("unknown safetensors dtype \"" + printable(dtype, true) + "\"");
}

size_t safetensors_dtype_bits(std::string_view dtype) {
  int r = dtype_rank(dtype);
  return r < 0 ? 0 : kDtypes[static_cast<size_t>(r)].bits;
}

}  // namespace packmoe::io
