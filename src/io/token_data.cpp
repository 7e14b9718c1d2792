// Megatron .idx/.bin and llm.c shard readers and writers. Every number read from a file is
// untrusted: sizes are compared with the real file size (overflow-checked) before anything is
// allocated or read, arrays are loaded with memcpy (the 34-byte .idx header leaves them unaligned),
// and each failure is one Status naming the file and the problem.
#include "io/token_data.h"

#include "io/atomic_file.h"
#include "io/read_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <system_error>

namespace packmoe::io {
namespace {

// Both formats are little-endian on disk; memcpy of host integers is only right on such hosts.
static_assert(std::endian::native == std::endian::little, "token_data assumes a little-endian host");


template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void store(std::vector<uint8_t>* out, T v) {
  const size_t at = out->size();
  out->resize(at + sizeof(T));
  std::memcpy(out->data() + at, &v, sizeof(T));
}

struct OpenFile {
  int fd = -1;
  uint64_t size = 0;
  ~OpenFile() {
    if (fd >= 0) ::close(fd);
  }
};

// Opens a regular file (never a FIFO or a device: io/read_file.h) and reports its size, so
// callers can check sizes before reading.
Status open_file(const std::string& path, OpenFile* f) {
  Result<RegularFile> r = RegularFile::open(path);
  if (!r) return r.status();
  f->size = r.value().size();
  f->fd = ::dup(r.value().fd());
  if (f->fd < 0) return Status::error(path + ": cannot open: " + errno_text(errno));
  return Status::ok();
}

// Reads exactly `n` bytes at `offset`; a short read means the file changed under us.
Status read_at(const OpenFile& f, const std::string& path, uint64_t offset, uint8_t* dst,
               uint64_t n) {
  uint64_t got = 0;
  while (got < n) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(n - got, uint64_t{1} << 30));
    ssize_t r = ::pread(f.fd, dst + got, want, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::error(path + ": read failed: " + errno_text(errno));
    if (r == 0) {
      return Status::error(path + ": file shrank while being read (got " +
                           std::to_string(offset + got) + " of " + std::to_string(offset + n) +
                           " bytes)");
    }
    got += static_cast<uint64_t>(r);
  }
  return Status::ok();
}

struct MegatronDTypeInfo {
  const char* name;
  uint32_t bytes;    // 0: not a valid code
  bool is_integer;
  uint64_t max_token;  // largest token id the type can hold (capped at 2^32 - 1)
};

MegatronDTypeInfo megatron_dtype_info(uint8_t code) {
  constexpr uint64_t kU32Max = std::numeric_limits<uint32_t>::max();
  switch (code) {
    case 1: return {"uint8", 1, true, 255};
    case 2: return {"int8", 1, true, 127};
    case 3: return {"int16", 2, true, 32767};
    case 4: return {"int32", 4, true, 2147483647};
    case 5: return {"int64", 8, true, kU32Max};
    case 6: return {"float64", 8, false, 0};
    case 7: return {"float32", 4, false, 0};
    case 8: return {"uint16", 2, true, 65535};
    default: return {"unknown", 0, false, 0};
  }
}

// Token `i` of a little-endian array of `code` integers as int64 (int64 values above INT64_MAX
// cannot occur: the type is signed).
int64_t load_token(const uint8_t* base, uint64_t i, uint8_t code) {
  switch (code) {
    case 1: return load<uint8_t>(base + i);
    case 2: return load<int8_t>(base + i);
    case 3: return load<int16_t>(base + 2 * i);
    case 4: return load<int32_t>(base + 4 * i);
    case 5: return load<int64_t>(base + 8 * i);
    case 8: return load<uint16_t>(base + 2 * i);
    default: PACKMOE_CHECK(false, "load_token: dtype code " << int{code} << " is not an integer");
  }
}

// a * b + c with overflow reported as false.
bool mul_add(uint64_t a, uint64_t b, uint64_t c, uint64_t* out) {
  uint64_t m = 0;
  return !__builtin_mul_overflow(a, b, &m) && !__builtin_add_overflow(m, c, out);
}

std::string megatron_prefix(const std::string& path) {
  for (const char* ext : {".idx", ".bin"}) {
    const size_t n = std::strlen(ext);
    if (path.size() > n && path.compare(path.size() - n, n, ext) == 0) {
      return path.substr(0, path.size() - n);
    }
  }
  return path;
}

}  // namespace

std::span<const uint32_t> TokenDataset::document(size_t d) const {
  PACKMOE_CHECK(d < num_documents(), "document " << d << " of " << num_documents());
  return std::span<const uint32_t>(tokens).subspan(doc_offsets[d],
                                                   doc_offsets[d + 1] - doc_offsets[d]);
}

Status validate_doc_offsets(const TokenDataset& data, const std::string& what) {
  const auto& off = data.doc_offsets;
  if (off.empty()) return Status::ok();
  if (off.front() != 0) {
    return Status::error(what + ": document offsets must start at 0 (got " +
                         std::to_string(off.front()) + ")");
  }
  if (off.back() != data.tokens.size()) {
    return Status::error(what + ": document offsets must end at the token count " +
                         std::to_string(data.tokens.size()) + " (got " +
                         std::to_string(off.back()) + ")");
  }
  for (size_t i = 1; i < off.size(); ++i) {
    if (off[i] < off[i - 1]) {
      return Status::error(what + ": document offsets decrease at entry " + std::to_string(i) +
                           " (" + std::to_string(off[i - 1]) + " then " + std::to_string(off[i]) +
                           ")");
    }
  }
  return Status::ok();
}

// ---- Megatron -----------------------------------------------------------------------------------

Result<MegatronIndex> read_megatron_index(const std::string& prefix_or_path) {
  const std::string prefix = megatron_prefix(prefix_or_path);
  const std::string idx_path = prefix + ".idx";
  const std::string bin_path = prefix + ".bin";
  auto fail = [&](const std::string& problem) { return Status::error(idx_path + ": " + problem); };

  OpenFile idx;
  PACKMOE_RETURN_IF_ERROR(open_file(idx_path, &idx));
  if (idx.size < kMegatronHeaderBytes) {
    return fail("file is " + std::to_string(idx.size) + " bytes, shorter than the " +
                std::to_string(kMegatronHeaderBytes) + "-byte header (truncated?)");
  }
  uint8_t header[kMegatronHeaderBytes];
  PACKMOE_RETURN_IF_ERROR(read_at(idx, idx_path, 0, header, kMegatronHeaderBytes));
  if (std::memcmp(header, kMegatronMagic, sizeof(kMegatronMagic)) != 0) {
    return fail("bad magic (not a Megatron indexed dataset index: expected \"MMIDIDX\\0\\0\")");
  }
  const uint64_t version = load<uint64_t>(header + 9);
  if (version != kMegatronVersion) {
    return fail("unsupported version " + std::to_string(version) + " (expected " +
                std::to_string(kMegatronVersion) + ")");
  }
  const uint8_t code = header[17];
  const MegatronDTypeInfo dt = megatron_dtype_info(code);
  if (dt.bytes == 0) return fail("unknown dtype code " + std::to_string(code));
  if (!dt.is_integer) {
    return fail(std::string("dtype code ") + std::to_string(code) + " (" + dt.name +
                ") cannot hold token ids");
  }
  const uint64_t num_seq = load<uint64_t>(header + 18);
  const uint64_t num_doc_idx = load<uint64_t>(header + 26);  // D entries = documents + 1

  // 34 + 12 S + 8 D, optionally + S bytes of multimodal sequence modes.
  uint64_t arrays_end = 0, with_modes = 0, doc_bytes = 0;
  if (!mul_add(num_seq, 12, kMegatronHeaderBytes, &arrays_end) ||
      !mul_add(num_doc_idx, 8, 0, &doc_bytes) ||
      __builtin_add_overflow(arrays_end, doc_bytes, &arrays_end) ||
      __builtin_add_overflow(arrays_end, num_seq, &with_modes)) {
    return fail("sequence count " + std::to_string(num_seq) + " / document index count " +
                std::to_string(num_doc_idx) + " overflow the file size arithmetic");
  }
  if (idx.size != arrays_end && idx.size != with_modes) {
    return fail("file is " + std::to_string(idx.size) + " bytes but a header with " +
                std::to_string(num_seq) + " sequences and " + std::to_string(num_doc_idx) +
                " document indices needs " + std::to_string(arrays_end) +
                (idx.size < arrays_end ? " (truncated?)" : " (trailing bytes?)"));
  }
  if (num_doc_idx == 0) return fail("document index array is empty (it must start with 0)");

  std::vector<uint8_t> arrays(static_cast<size_t>(arrays_end - kMegatronHeaderBytes));
  PACKMOE_RETURN_IF_ERROR(
      read_at(idx, idx_path, kMegatronHeaderBytes, arrays.data(), arrays.size()));
  const uint8_t* lengths = arrays.data();
  const uint8_t* pointers = lengths + 4 * num_seq;
  const uint8_t* doc_idx = pointers + 8 * num_seq;

  // Sequences must be back to back: pointer i == sum of earlier lengths x itemsize.
  std::vector<uint64_t> seq_offsets(num_seq + 1, 0);  // in tokens
  for (uint64_t i = 0; i < num_seq; ++i) {
    const int32_t len = load<int32_t>(lengths + 4 * i);
    if (len < 0) return fail("sequence " + std::to_string(i) + " has negative length " +
                             std::to_string(len));
    const int64_t ptr = load<int64_t>(pointers + 8 * i);
    uint64_t expect = 0;
    if (__builtin_mul_overflow(seq_offsets[i], uint64_t{dt.bytes}, &expect) || ptr < 0 ||
        static_cast<uint64_t>(ptr) != expect) {
      return fail("sequence " + std::to_string(i) + " starts at byte " + std::to_string(ptr) +
                  " of the .bin, expected " + std::to_string(expect) +
                  " (sequences must be contiguous)");
    }
    seq_offsets[i + 1] = seq_offsets[i] + static_cast<uint64_t>(len);
  }

  MegatronIndex out;
  out.prefix = prefix;
  out.bin_path = bin_path;
  out.dtype_code = code;
  out.num_tokens = seq_offsets[num_seq];
  out.doc_offsets.resize(num_doc_idx);
  int64_t prev = 0;
  for (uint64_t d = 0; d < num_doc_idx; ++d) {
    const int64_t s = load<int64_t>(doc_idx + 8 * d);
    if (d == 0 && s != 0) return fail("document index starts at " + std::to_string(s) +
                                      ", expected 0");
    if (s < prev || static_cast<uint64_t>(s) > num_seq) {
      return fail("document index entry " + std::to_string(d) + " is " + std::to_string(s) +
                  " (entries must be non-decreasing and at most the sequence count " +
                  std::to_string(num_seq) + ")");
    }
    prev = s;
    out.doc_offsets[d] = seq_offsets[static_cast<uint64_t>(s)];
  }
  if (static_cast<uint64_t>(prev) != num_seq) {
    return fail("document index ends at sequence " + std::to_string(prev) + " but there are " +
                std::to_string(num_seq) + " sequences (sequences outside every document)");
  }

  OpenFile bin;
  PACKMOE_RETURN_IF_ERROR(open_file(bin_path, &bin));
  uint64_t bin_expect = 0;
  if (__builtin_mul_overflow(out.num_tokens, uint64_t{dt.bytes}, &bin_expect)) {
    return fail(std::to_string(out.num_tokens) + " tokens overflow a 64-bit byte count");
  }
  if (bin.size != bin_expect) {
    return Status::error(bin_path + ": file is " + std::to_string(bin.size) +
                         " bytes but the index describes " + std::to_string(out.num_tokens) +
                         " " + dt.name + " tokens = " + std::to_string(bin_expect) + " bytes" +
                         (bin.size < bin_expect ? " (truncated?)" : ""));
  }
  return out;
}

Result<TokenDataset> read_megatron(const std::string& prefix_or_path) {
  Result<MegatronIndex> index = read_megatron_index(prefix_or_path);
  if (!index) return index.status();
  MegatronIndex& ix = index.value();
  const std::string& bin_path = ix.bin_path;
  const uint8_t code = ix.dtype_code;
  const uint64_t num_tokens = ix.num_tokens;
  OpenFile bin;
  PACKMOE_RETURN_IF_ERROR(open_file(bin_path, &bin));
  std::vector<uint8_t> raw(static_cast<size_t>(num_tokens * megatron_dtype_info(code).bytes));
  PACKMOE_RETURN_IF_ERROR(read_at(bin, bin_path, 0, raw.data(), raw.size()));
  TokenDataset out;
  out.source = ix.prefix;
  out.doc_offsets = std::move(ix.doc_offsets);
  out.tokens.resize(static_cast<size_t>(num_tokens));
  if (code == 1) {
    std::copy(raw.begin(), raw.end(), out.tokens.begin());
  } else if (code == 8) {
    for (uint64_t i = 0; i < num_tokens; ++i) out.tokens[i] = load<uint16_t>(raw.data() + 2 * i);
  } else {
    for (uint64_t i = 0; i < num_tokens; ++i) {
      const int64_t t = load_token(raw.data(), i, code);
      if (t < 0 || static_cast<uint64_t>(t) > std::numeric_limits<uint32_t>::max()) {
        return Status::error(bin_path + ": token " + std::to_string(i) + " is " +
                             std::to_string(t) + ", not a token id in [0, 2^32)");
      }
      out.tokens[i] = static_cast<uint32_t>(t);
    }
  }
  return out;
}

Status write_megatron(const std::string& prefix, const TokenDataset& data, MegatronDType dtype) {
  const std::string idx_path = prefix + ".idx";
  const std::string bin_path = prefix + ".bin";
  const uint8_t code = static_cast<uint8_t>(dtype);
  const MegatronDTypeInfo dt = megatron_dtype_info(code);
  if (!dt.is_integer) {
    return Status::error(idx_path + ": dtype code " + std::to_string(code) + " (" + dt.name +
                         ") cannot hold token ids");
  }
  PACKMOE_RETURN_IF_ERROR(validate_doc_offsets(data, idx_path));
  std::vector<uint64_t> offsets = data.doc_offsets;
  if (offsets.empty()) {
    offsets = {0};
    if (!data.tokens.empty()) offsets.push_back(data.tokens.size());
  }

  std::vector<uint8_t> bin;
  bin.reserve(data.tokens.size() * dt.bytes);
  for (size_t i = 0; i < data.tokens.size(); ++i) {
    const uint32_t t = data.tokens[i];
    if (t > dt.max_token) {
      return Status::error(bin_path + ": token " + std::to_string(i) + " is " + std::to_string(t) +
                           ", out of range for " + dt.name + " (nothing written)");
    }
    switch (code) {
      case 1: store<uint8_t>(&bin, static_cast<uint8_t>(t)); break;
      case 2: store<int8_t>(&bin, static_cast<int8_t>(t)); break;
      case 3: store<int16_t>(&bin, static_cast<int16_t>(t)); break;
      case 4: store<int32_t>(&bin, static_cast<int32_t>(t)); break;
      case 5: store<int64_t>(&bin, static_cast<int64_t>(t)); break;
      case 8: store<uint16_t>(&bin, static_cast<uint16_t>(t)); break;
    }
  }

  const uint64_t num_seq = offsets.size() - 1;  // one sequence per document
  std::vector<uint8_t> idx(kMegatronMagic, kMegatronMagic + sizeof(kMegatronMagic));
  store<uint64_t>(&idx, kMegatronVersion);
  store<uint8_t>(&idx, code);
  store<uint64_t>(&idx, num_seq);
  store<uint64_t>(&idx, offsets.size());
  for (uint64_t s = 0; s < num_seq; ++s) {
    const uint64_t len = offsets[s + 1] - offsets[s];
    if (len > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
      return Status::error(idx_path + ": document " + std::to_string(s) + " has " +
                           std::to_string(len) + " tokens, more than an int32 sequence length" +
                           " (nothing written)");
    }
    store<int32_t>(&idx, static_cast<int32_t>(len));
  }
  for (uint64_t s = 0; s < num_seq; ++s) store<int64_t>(&idx, static_cast<int64_t>(offsets[s] * dt.bytes));
  for (uint64_t d = 0; d <= num_seq; ++d) store<int64_t>(&idx, static_cast<int64_t>(d));

  // .bin first: a reader that finds the new .idx then also finds the new .bin.
  const std::span<const uint8_t> bin_parts[] = {bin};
  PACKMOE_RETURN_IF_ERROR(write_file_atomic(bin_path, bin_parts));
  const std::span<const uint8_t> idx_parts[] = {idx};
  return write_file_atomic(idx_path, idx_parts);
}

// ---- llm.c --------------------------------------------------------------------------------------

Result<LlmcShardHeader> read_llmc_header(const std::string& path) {
  auto fail = [&](const std::string& problem) { return Status::error(path + ": " + problem); };
  constexpr uint64_t kHeaderBytes = kLlmcHeaderInts * 4;
  OpenFile f;
  PACKMOE_RETURN_IF_ERROR(open_file(path, &f));
  if (f.size < kHeaderBytes) {
    return fail("file is " + std::to_string(f.size) + " bytes, shorter than the " +
                std::to_string(kHeaderBytes) + "-byte llm.c header (truncated?)");
  }
  uint8_t header[kHeaderBytes];
  PACKMOE_RETURN_IF_ERROR(read_at(f, path, 0, header, kHeaderBytes));
  const int32_t magic = load<int32_t>(header);
  const int32_t version = load<int32_t>(header + 4);
  const int32_t count = load<int32_t>(header + 8);
  uint32_t token_bytes = 0;
  if (magic == kLlmcGpt2Magic) {
    if (version != kLlmcGpt2Version) {
      return fail("unsupported version " + std::to_string(version) + " for magic " +
                  std::to_string(magic) + " (expected " + std::to_string(kLlmcGpt2Version) + ")");
    }
    token_bytes = 2;
  } else if (magic == kLlmcLlama3Magic) {
    if (version != kLlmcLlama3Version) {
      return fail("unsupported version " + std::to_string(version) + " for magic " +
                  std::to_string(magic) + " (expected " + std::to_string(kLlmcLlama3Version) + ")");
    }
    token_bytes = 4;
  } else {
    return fail("bad magic " + std::to_string(magic) + " (not an llm.c token shard: expected " +
                std::to_string(kLlmcGpt2Magic) + " or " + std::to_string(kLlmcLlama3Magic) + ")");
  }
  if (count < 0) return fail("negative token count " + std::to_string(count));
  const uint64_t expect = kHeaderBytes + uint64_t{token_bytes} * static_cast<uint64_t>(count);
  if (f.size != expect) {
    return fail("file is " + std::to_string(f.size) + " bytes but the header's " +
                std::to_string(count) + " tokens need " + std::to_string(expect) +
                (f.size < expect ? " (truncated?)" : " (trailing bytes?)"));
  }
  return LlmcShardHeader{static_cast<uint64_t>(count), token_bytes};
}

Result<TokenDataset> read_llmc_shard(const std::string& path,
                                     std::optional<uint32_t> document_start_token) {
  Result<LlmcShardHeader> header = read_llmc_header(path);
  if (!header) return header.status();
  const uint64_t count = header.value().count;
  const uint32_t token_bytes = header.value().token_bytes;
  OpenFile f;
  PACKMOE_RETURN_IF_ERROR(open_file(path, &f));
  std::vector<uint8_t> raw(static_cast<size_t>(count * token_bytes));
  PACKMOE_RETURN_IF_ERROR(read_at(f, path, kLlmcHeaderInts * 4, raw.data(), raw.size()));
  TokenDataset out;
  out.source = path;
  out.tokens.resize(static_cast<size_t>(count));
  for (size_t i = 0; i < out.tokens.size(); ++i) {
    out.tokens[i] = token_bytes == 2 ? load<uint16_t>(raw.data() + 2 * i)
                                     : load<uint32_t>(raw.data() + 4 * i);
  }
  if (document_start_token) {
    out.doc_offsets.push_back(0);
    for (size_t i = 1; i < out.tokens.size(); ++i) {
      if (out.tokens[i] == *document_start_token) out.doc_offsets.push_back(i);
    }
    out.doc_offsets.push_back(out.tokens.size());
    if (out.tokens.empty()) out.doc_offsets = {0};  // zero documents
  }
  return out;
}

Status write_llmc_shard(const std::string& path, std::span<const uint32_t> tokens,
                        LlmcFormat format) {
  const bool gpt2 = format == LlmcFormat::kGpt2;
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return Status::error(path + ": " + std::to_string(tokens.size()) +
                         " tokens do not fit the header's int32 count (nothing written)");
  }
  std::vector<uint8_t> bytes;
  bytes.reserve(kLlmcHeaderInts * 4 + tokens.size() * (gpt2 ? 2 : 4));
  store<int32_t>(&bytes, gpt2 ? kLlmcGpt2Magic : kLlmcLlama3Magic);
  store<int32_t>(&bytes, gpt2 ? kLlmcGpt2Version : kLlmcLlama3Version);
  store<int32_t>(&bytes, static_cast<int32_t>(tokens.size()));
  bytes.resize(kLlmcHeaderInts * 4, 0);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (gpt2) {
      if (tokens[i] > 0xFFFF) {
        return Status::error(path + ": token " + std::to_string(i) + " is " +
                             std::to_string(tokens[i]) +
                             ", out of range for uint16 (GPT-2 shard; nothing written)");
      }
      store<uint16_t>(&bytes, static_cast<uint16_t>(tokens[i]));
    } else {
      store<uint32_t>(&bytes, tokens[i]);
    }
  }
  const std::span<const uint8_t> parts[] = {bytes};
  return write_file_atomic(path, parts);
}

}  // namespace packmoe::io
