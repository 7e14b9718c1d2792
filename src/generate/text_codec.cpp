// Byte tokens or a tokenizer behind one encode / decode (generate/text_codec.h).
#include "generate/text_codec.h"

namespace packmoe::generate {

Result<TextCodec> TextCodec::bytes(int64_t vocab_size) {
  if (vocab_size != 256)
    return Status::error("the model has vocab_size = " + std::to_string(vocab_size) +
                         " and no tokenizer was found beside it: give --tokenizer PATH (byte "
                         "tokens need vocab_size = 256)");
  return TextCodec();
}

Result<TextCodec> TextCodec::from_tokenizer(std::unique_ptr<tokenize::Tokenizer> tokenizer,
                                            int64_t vocab_size) {
  if (static_cast<int64_t>(tokenizer->vocab_size()) > vocab_size)
    return Status::error("the tokenizer has " + std::to_string(tokenizer->vocab_size()) +
                         " tokens, more than the model's vocab_size = " +
                         std::to_string(vocab_size));
  TextCodec c;
  c.tokenizer_ = std::move(tokenizer);
  return c;
}

Result<std::vector<int32_t>> TextCodec::encode(std::string_view text) const {
  if (!tokenizer_) {
    std::vector<int32_t> ids;
    for (char ch : text) ids.push_back(static_cast<unsigned char>(ch));
    return ids;
  }
  Result<std::vector<uint32_t>> ids = tokenizer_->encode(text);
  if (!ids) return Status::error("--prompt: " + ids.status().message());
  return std::vector<int32_t>(ids.value().begin(), ids.value().end());
}

std::string TextCodec::decode(std::span<const int32_t> ids) const {
  if (!tokenizer_) {
    std::string s;
    for (int32_t id : ids)
      if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));
    return s;
  }
  std::vector<uint32_t> u;
  for (int32_t id : ids)
    if (id >= 0) u.push_back(static_cast<uint32_t>(id));
  return tokenizer_->decode(u, /*skip_special=*/true);
}

std::vector<int32_t> TextCodec::stop_ids() const {
  if (tokenizer_ && tokenizer_->eos_id()) return {static_cast<int32_t>(*tokenizer_->eos_id())};
  return {};
}

std::string TextCodec::describe() const {
  return tokenizer_ ? std::string(tokenizer_->kind()) + " tokenizer" : "byte tokens";
}

size_t complete_utf8_prefix(std::string_view text) {
  // Look back over at most 3 continuation bytes for the lead byte of the last sequence.
  const size_t n = text.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(text[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte
    const size_t need = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3
                                  : (c & 0xF8) == 0xF0 ? 4 : 1;
    return back < need ? n - back : n;
  }
  return n;  // only continuation bytes at the end: nothing to wait for
}

}  // namespace packmoe::generate
