// TokenArray over mmap(2) or a vector, and the Megatron / llm.c files mapped through the checked
// header readers of io/token_data.h. A mapping is shared by every copy of an array (a training and
// a validation split of the same file), and unmapped with the last one.
#include "io/token_mmap.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "io/atomic_file.h"  // errno_text
#include "io/read_file.h"

namespace packmoe::io {
namespace {

uint32_t type_bytes(TokenType t) {
  switch (t) {
    case TokenType::kU8: case TokenType::kI8: return 1;
    case TokenType::kI16: case TokenType::kU16: return 2;
    case TokenType::kI32: case TokenType::kU32: return 4;
    case TokenType::kI64: return 8;
  }
  return 0;
}

// Largest value the type holds (int64: beyond every 32-bit limit).
uint64_t type_max(TokenType t) {
  switch (t) {
    case TokenType::kU8: return 255;
    case TokenType::kI8: return 127;
    case TokenType::kI16: return 32767;
    case TokenType::kU16: return 65535;
    case TokenType::kI32: return 2147483647;
    case TokenType::kU32: return 4294967295u;
    case TokenType::kI64: return std::numeric_limits<uint64_t>::max();
  }
  return 0;
}

bool is_signed(TokenType t) {
  return t == TokenType::kI8 || t == TokenType::kI16 || t == TokenType::kI32 ||
         t == TokenType::kI64;
}

template <typename T>
int64_t load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return static_cast<int64_t>(v);
}

struct Mapping {
  void* addr = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (addr) ::munmap(addr, bytes);
  }
};

Result<TokenType> megatron_type(uint8_t code) {
  switch (code) {
    case 1: return TokenType::kU8;
    case 2: return TokenType::kI8;
    case 3: return TokenType::kI16;
    case 4: return TokenType::kI32;
    case 5: return TokenType::kI64;
    case 8: return TokenType::kU16;
    default: return Status::error("dtype code " + std::to_string(code) + " is not an integer");
  }
}

}  // namespace

TokenArray TokenArray::owned(std::vector<uint32_t> tokens) {
  auto v = std::make_shared<std::vector<uint32_t>>(std::move(tokens));
  TokenArray a;
  a.base_ = reinterpret_cast<const uint8_t*>(v->data());
  a.count_ = v->size();
  a.type_ = TokenType::kU32;
  a.owner_ = std::move(v);
  return a;
}

Result<TokenArray> TokenArray::map(const std::string& path, uint64_t offset, uint64_t count,
                                   TokenType type) {
  Result<RegularFile> file = RegularFile::open(path);
  if (!file) return file.status();
  const uint64_t size = file.value().size();
  uint64_t bytes = 0, end = 0;
  if (__builtin_mul_overflow(count, uint64_t{type_bytes(type)}, &bytes) ||
      __builtin_add_overflow(bytes, offset, &end) || end > size)
    return Status::error(path + ": " + std::to_string(count) + " tokens at byte " +
                         std::to_string(offset) + " do not fit the file's " +
                         std::to_string(size) + " bytes");
  TokenArray a;
  a.count_ = count;
  a.type_ = type;
  if (count == 0) return a;
  auto m = std::make_shared<Mapping>();
  m->bytes = static_cast<size_t>(end);
  void* addr = ::mmap(nullptr, m->bytes, PROT_READ, MAP_SHARED, file.value().fd(), 0);
  if (addr == MAP_FAILED) return Status::error(path + ": cannot map: " + errno_text(errno));
  m->addr = addr;
  a.base_ = static_cast<const uint8_t*>(addr) + offset;
  a.owner_ = std::move(m);
  return a;
}

int64_t TokenArray::at(uint64_t i) const {
  const uint8_t* p = base_ + i * type_bytes(type_);
  switch (type_) {
    case TokenType::kU8: return *p;
    case TokenType::kI8: return load<int8_t>(p);
    case TokenType::kI16: return load<int16_t>(p);
    case TokenType::kU16: return load<uint16_t>(p);
    case TokenType::kI32: return load<int32_t>(p);
    case TokenType::kU32: return load<uint32_t>(p);
    case TokenType::kI64: return load<int64_t>(p);
  }
  return 0;
}

void TokenArray::read(uint64_t begin, uint64_t n, uint32_t* out) const {
  PACKMOE_CHECK(begin <= count_ && n <= count_ - begin,
                "tokens [" << begin << ", " << begin + n << ") of " << count_);
  if (type_ == TokenType::kU32) {
    std::memcpy(out, base_ + 4 * begin, n * 4);
    return;
  }
  for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(at(begin + i));
}

Status TokenArray::check_range(uint64_t begin, uint64_t end, uint64_t limit,
                               const std::string& source) const {
  PACKMOE_CHECK(begin <= end && end <= count_, "range [" << begin << ", " << end << ") of " << count_);
  if (!is_signed(type_) && type_max(type_) < limit) return Status::ok();
  for (uint64_t i = begin; i < end; ++i) {
    const int64_t t = at(i);
    if (t < 0 || static_cast<uint64_t>(t) >= limit)
      return Status::error(source + ": token " + std::to_string(t) + " at index " +
                           std::to_string(i) + " is not below the model's vocab_size " +
                           std::to_string(limit));
  }
  return Status::ok();
}

Result<MappedTokens> map_megatron(const std::string& prefix) {
  Result<MegatronIndex> index = read_megatron_index(prefix);
  if (!index) return index.status();
  Result<TokenType> type = megatron_type(index.value().dtype_code);
  if (!type) return Status::error(index.value().prefix + ".idx: " + type.status().message());
  Result<TokenArray> tokens =
      TokenArray::map(index.value().bin_path, 0, index.value().num_tokens, type.value());
  if (!tokens) return tokens.status();
  return MappedTokens{std::move(tokens.value()), std::move(index.value().doc_offsets),
                      index.value().prefix};
}

Result<MappedTokens> map_llmc_shard(const std::string& path) {
  Result<LlmcShardHeader> header = read_llmc_header(path);
  if (!header) return header.status();
  Result<TokenArray> tokens =
      TokenArray::map(path, kLlmcHeaderInts * 4, header.value().count,
                      header.value().token_bytes == 2 ? TokenType::kU16 : TokenType::kU32);
  if (!tokens) return tokens.status();
  return MappedTokens{std::move(tokens.value()), {}, path};
}

MappedTokens in_memory(TokenDataset data) {
  return MappedTokens{TokenArray::owned(std::move(data.tokens)), std::move(data.doc_offsets),
                      std::move(data.source)};
}

}  // namespace packmoe::io
