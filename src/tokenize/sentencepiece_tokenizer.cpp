// SentencePiece through the library's processor (see sentencepiece_tokenizer.h). The processor's
// encode / decode are const and keep no state between calls, so one instance serves all threads.
#include "tokenize/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include "tokenize/tokenizer_backends.h"

namespace packmoe::tokenize {

SentencePieceTokenizer::SentencePieceTokenizer()
    : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

Result<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::load(
    const std::string& model_path, const TokenizerConfig& config, std::vector<std::string> files) {
  std::unique_ptr<SentencePieceTokenizer> t(new SentencePieceTokenizer());
  const sentencepiece::util::Status s = t->sp_->Load(model_path);
  if (!s.ok())
    return Status::error(model_path + ": not a SentencePiece model: " + s.ToString());
  const int n = t->sp_->GetPieceSize();
  if (n <= 0) return Status::error(model_path + ": the SentencePiece model has no pieces");
  t->vocab_size_ = static_cast<uint32_t>(n);
  t->files_ = std::move(files);
  for (auto [id, out] : {std::pair{t->sp_->eos_id(), &t->eos_id_}, {t->sp_->bos_id(), &t->bos_id_},
                         {t->sp_->pad_id(), &t->pad_id_}})
    if (id >= 0 && id < n) *out = static_cast<uint32_t>(id);
  PACKMOE_RETURN_IF_ERROR(t->apply_config(config));
  return t;
}

Result<std::vector<uint32_t>> SentencePieceTokenizer::encode(std::string_view text) const {
  PACKMOE_RETURN_IF_ERROR(check_utf8(text));
  std::vector<int> ids;
  const sentencepiece::util::Status s =
      sp_->Encode(absl::string_view(text.data(), text.size()), &ids);
  if (!s.ok()) return Status::error("SentencePiece encode failed: " + s.ToString());
  return std::vector<uint32_t>(ids.begin(), ids.end());
}

std::string SentencePieceTokenizer::decode(std::span<const uint32_t> ids, bool skip_special) const {
  std::vector<int> keep;
  keep.reserve(ids.size());
  for (uint32_t id : ids)
    if (id < vocab_size_ && !(skip_special && is_special(id))) keep.push_back(static_cast<int>(id));
  std::string text;
  const sentencepiece::util::Status s = sp_->Decode(keep, &text);
  PACKMOE_CHECK(s.ok(), "SentencePiece decode of in-range ids failed: " << s.ToString());
  return text;
}

std::optional<uint32_t> SentencePieceTokenizer::token_id(std::string_view token) const {
  const int id = sp_->PieceToId(absl::string_view(token.data(), token.size()));
  // PieceToId answers unk_id for an unknown piece: only the unknown piece itself maps there.
  if (id < 0 || id >= static_cast<int>(vocab_size_)) return std::nullopt;
  if (sp_->IsUnknown(id) && sp_->IdToPiece(id) != token) return std::nullopt;
  return static_cast<uint32_t>(id);
}

bool SentencePieceTokenizer::is_special(uint32_t id) const {
  return id < vocab_size_ && (sp_->IsControl(static_cast<int>(id)) ||
                              sp_->IsUnknown(static_cast<int>(id)));
}

Result<std::unique_ptr<Tokenizer>> make_sentencepiece_tokenizer(const std::string& model_path,
                                                                const TokenizerConfig& config,
                                                                std::vector<std::string> files) {
  Result<std::unique_ptr<SentencePieceTokenizer>> t =
      SentencePieceTokenizer::load(model_path, config, std::move(files));
  if (!t) return t.status();
  return std::unique_ptr<Tokenizer>(std::move(t.value()));
}

}  // namespace packmoe::tokenize
