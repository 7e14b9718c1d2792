// One fuzz target per parser of untrusted input: safetensors (header and tensors), the Megatron
// .idx and llm.c shard headers, JSON configs (--config / config.json / the "train" object), a
// checkpoint's trainer_state.json and its complete.json, a tokenizer.json, and text through
// the tokenizer (any bytes: encoded or refused, valid text decodes back). Each takes any bytes and must return
// (a Status or a value), never crash, hang, leak or read outside its input. Shared by the libFuzzer
// executables (tests/fuzz/fuzz_*.cpp, -DPACKMOE_FUZZ=ON) and the deterministic corpus-and-mutation
// test CI runs (tests/unit/test_fuzz_corpus.cpp), which also takes its seed inputs from here.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/json_limits.h"
#include "io/checkpoint_dir.h"
#include "io/safetensors.h"
#include "io/token_data.h"
#include "train/checkpoint.h"
#include "train/model_config.h"
#include "train/train_config.h"
#include "train/trainer.h"
#include "common/test_tokenizer_json.h"
#include "tokenize/tokenizer.h"

namespace packmoe::fuzz {

namespace fs = std::filesystem;

using Bytes = std::vector<uint8_t>;

inline void write_file(const fs::path& path, const uint8_t* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

inline Bytes read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), {});
}

// A private scratch directory for the process, removed at exit.
inline const fs::path& scratch() {
  static const fs::path dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    fs::path d = fs::path(tmp ? tmp : "/tmp") / ("packmoe_fuzz_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  static const struct Remover {
    ~Remover() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } remover;
  return dir;
}

// ---- safetensors ----------------------------------------------------------------------------

inline int fuzz_safetensors(const uint8_t* data, size_t size) {
  Result<io::SafetensorsFile> f = io::SafetensorsFile::parse(Bytes(data, data + size), "fuzz");
  if (!f) return 0;
  uint64_t sum = 0;  // touch every tensor byte: each must lie inside the input
  for (const io::SafetensorsEntry& e : f.value().entries()) {
    for (uint8_t b : e.bytes) sum += b;
    sum += static_cast<uint64_t>(e.numel());
  }
  return sum == 1 ? 0 : 0;
}

// ---- token files ----------------------------------------------------------------------------

// The input as <prefix>.idx beside a fixed 16-token .bin.
inline int fuzz_megatron_idx(const uint8_t* data, size_t size) {
  const fs::path prefix = scratch() / "megatron";
  static const bool bin = [&] {
    const uint16_t tokens[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    write_file(prefix.string() + ".bin", reinterpret_cast<const uint8_t*>(tokens), sizeof tokens);
    return true;
  }();
  (void)bin;
  write_file(prefix.string() + ".idx", data, size);
  (void)io::read_megatron(prefix.string());
  return 0;
}

inline int fuzz_llmc_shard(const uint8_t* data, size_t size) {
  const fs::path path = scratch() / "shard.bin";
  write_file(path, data, size);
  (void)io::read_llmc_shard(path.string());
  (void)io::read_llmc_shard(path.string(), 50256);
  return 0;
}

// ---- JSON configs ---------------------------------------------------------------------------

// What `train --config` does with a file: parse with limits, the "train" object onto a
// TrainConfig, the other keys as a model; plus config.json's own parser.
inline int fuzz_json_config(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  (void)train::parse_model_config(text);
  Result<nlohmann::json> j = parse_json_text(text, "fuzz");
  if (!j || !j.value().is_object()) return 0;
  nlohmann::json model_keys = j.value();
  train::TrainConfig config;
  if (model_keys.contains("train")) {
    if (train::apply_train_json(model_keys["train"], &config))
      (void)train::validate(config, train::model_config_preset("tiny").value());
    model_keys.erase("train");
  }
  Result<ModelConfig> m = train::model_config_from_json(model_keys);
  if (m) {
    (void)train::parameter_count(m.value());
    (void)train::check_run_fits(config, m.value(), int64_t{1} << 30);
  }
  return 0;
}

// ---- tokenizers -----------------------------------------------------------------------------
// The input as a tokenizer.json; when it loads, a few texts go through encode and decode.
inline int fuzz_tokenizer_json(const uint8_t* data, size_t size) {
  const fs::path dir = scratch() / "tokenizer";
  fs::create_directories(dir);
  write_file(dir / "tokenizer.json", data, size);
  Result<std::unique_ptr<tokenize::Tokenizer>> t = tokenize::load_tokenizer(dir.string());
  if (!t) return 0;
  for (const char* text : {"hello world", "<|im_start|>it's 123\n\n  x", "\xE6\x97\xA5\xF0\x9F\x98\x80"}) {
    Result<std::vector<uint32_t>> ids = t.value()->encode(text);
    if (ids) (void)t.value()->decode(ids.value());
  }
  return 0;
}

// The input as text for the test tokenizer (tests/common/test_tokenizer_json.h): any bytes are
// encoded or refused as invalid UTF-8, and valid text decodes back to itself.
inline int fuzz_tokenizer_encode(const uint8_t* data, size_t size) {
  static const std::unique_ptr<tokenize::Tokenizer> tok = [] {
    const fs::path dir = scratch() / "tokenizer_encode";
    fs::create_directories(dir);
    std::ofstream(dir / "tokenizer.json") << test::test_tokenizer_json().dump();
    return std::move(tokenize::load_tokenizer(dir.string()).value());
  }();
  const std::string text(reinterpret_cast<const char*>(data), size);
  Result<std::vector<uint32_t>> ids = tok->encode(text);
  if (ids && tok->decode(ids.value()) != text) std::abort();
  return 0;
}

// ---- checkpoints ----------------------------------------------------------------------------

// A real checkpoint of a very small model, written once per process: ROOT/step-00000001.
inline const fs::path& seed_checkpoint() {
  static const fs::path dir = [] {
    ModelConfig m = train::model_config_preset("tiny").value();
    m.vocab_size = 16;
    m.hidden_size = 8;
    m.intermediate_size = 8;
    m.moe_intermediate_size = 32;
    m.num_hidden_layers = 1;
    m.num_attention_heads = 2;
    m.num_key_value_heads = 1;
    m.head_dim = 4;
    m.num_experts = 2;
    m.num_experts_per_tok = 1;
    train::TrainConfig c;
    c.steps = 2;
    c.micro_batch_size = 1;
    c.seq_len = 4;
    c.eval_interval = 0;
    c.warmup_steps = 1;
    train::TrainData d;
    io::TokenDataset tokens;
    for (int i = 0; i < 64; ++i) tokens.tokens.push_back(static_cast<uint32_t>(i % 16));
    d.train = train::single_source(std::move(tokens));
    auto trainer = train::Trainer::create(cpu_backend(), m, c, std::move(d)).value();
    (void)trainer->train_step();
    const fs::path root = scratch() / "ckpt";
    return fs::path(trainer->save_checkpoint(root.string(), 1).value().info.dir);
  }();
  return dir;
}

// The marker rewritten so every listed file's size and CRC-32C match again.
inline void reseal(const fs::path& dir) {
  nlohmann::json m = nlohmann::json::parse(read_file(dir / io::kCheckpointMarker));
  for (auto& f : m["files"]) {
    const Bytes b = read_file(dir / f["name"].get<std::string>());
    char crc[9];
    std::snprintf(crc, sizeof crc, "%08x", io::crc32c(b));
    f["crc32c"] = crc;
    f["bytes"] = b.size();
  }
  const std::string text = m.dump();
  write_file(dir / io::kCheckpointMarker, reinterpret_cast<const uint8_t*>(text.data()),
             text.size());
}

// The input as trainer_state.json of an otherwise valid checkpoint (its CRC made to match, so
// the parser, not the checksum, meets the bytes), then read as a resume would.
inline int fuzz_trainer_state(const uint8_t* data, size_t size) {
  const fs::path& dir = seed_checkpoint();
  static const Bytes original = read_file(dir / "trainer_state.json");
  static const Bytes marker = read_file(dir / io::kCheckpointMarker);
  write_file(dir / "trainer_state.json", data, size);
  reseal(dir);
  (void)train::read_trainer_checkpoint(dir.string());
  write_file(dir / "trainer_state.json", original.data(), original.size());
  write_file(dir / io::kCheckpointMarker, marker.data(), marker.size());
  return 0;
}

// The input as complete.json of the checkpoint, read as --resume auto and --keep-last read it.
inline int fuzz_complete_json(const uint8_t* data, size_t size) {
  const fs::path& dir = seed_checkpoint();
  static const Bytes marker = read_file(dir / io::kCheckpointMarker);
  write_file(dir / io::kCheckpointMarker, data, size);
  (void)io::verify_checkpoint(dir.string());
  (void)io::latest_checkpoint(dir.parent_path().string());
  write_file(dir / io::kCheckpointMarker, marker.data(), marker.size());
  return 0;
}

// ---- the table the corpus test walks ----------------------------------------------------------

struct Target {
  const char* name;
  int (*run)(const uint8_t*, size_t);
  std::function<std::vector<Bytes>()> seeds;  // valid (and nearly valid) inputs to mutate
};

inline Bytes bytes_of(const std::string& s) { return Bytes(s.begin(), s.end()); }

inline Bytes safetensors_seed(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  return bytes_of(out + header + std::string(data_bytes, '\x3F'));
}

inline std::vector<Target> targets() {
  return {
      {"safetensors", fuzz_safetensors,
       [] {
         return std::vector<Bytes>{
             safetensors_seed(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 16),
             safetensors_seed(R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16",)"
                              R"("shape":[3],"data_offsets":[0,6]},"c":{"dtype":"F4",)"
                              R"("shape":[4],"data_offsets":[6,8]}}  )",
                              8),
         };
       }},
#if PACKMOE_WITH_TOKENIZERS  // a build without PCRE2 / ICU / SentencePiece refuses every load
      {"tokenizer_json", fuzz_tokenizer_json,
       [] {
         nlohmann::json gpt2 = test::test_tokenizer_json(test::PreTokenizer::kGpt2);
         gpt2["normalizer"] = {{"type", "NFC"}};
         return std::vector<Bytes>{bytes_of(test::test_tokenizer_json().dump()),
                                   bytes_of(gpt2.dump())};
       }},
      {"tokenizer_encode", fuzz_tokenizer_encode,
       [] {
         return std::vector<Bytes>{bytes_of("<|im_start|>user\nhello world<|im_end|>"),
                                   bytes_of("it's 123 \xE6\x97\xA5x \xF0\x9F\x98\x80!  \t\r\n"),
                                   bytes_of("e\xCC\x81 <think>'T \xE3\x80\x80")};
       }},
#endif
      {"megatron_idx", fuzz_megatron_idx,
       [] {
         io::TokenDataset d;
         for (uint32_t i = 1; i <= 16; ++i) d.tokens.push_back(i);
         d.doc_offsets = {0, 5, 16};
         const fs::path p = scratch() / "seed_megatron";
         (void)io::write_megatron(p.string(), d);
         return std::vector<Bytes>{read_file(p.string() + ".idx")};
       }},
      {"llmc_shard", fuzz_llmc_shard,
       [] {
         const fs::path p = scratch() / "seed_shard.bin";
         const std::vector<uint32_t> tokens = {50256, 1, 2, 3, 50256, 4};
         (void)io::write_llmc_shard(p.string(), tokens);
         return std::vector<Bytes>{read_file(p)};
       }},
      {"json_config", fuzz_json_config,
       [] {
         nlohmann::json j =
             train::model_config_to_json(train::model_config_preset("tiny").value());
         j["train"] = train::train_config_to_json(train::TrainConfig{});
         return std::vector<Bytes>{bytes_of(j.dump()), bytes_of(R"({"train":{"steps":3}})")};
       }},
      {"trainer_state", fuzz_trainer_state,
       [] { return std::vector<Bytes>{read_file(seed_checkpoint() / "trainer_state.json")}; }},
      {"complete_json", fuzz_complete_json,
       [] { return std::vector<Bytes>{read_file(seed_checkpoint() / io::kCheckpointMarker)}; }},
  };
}

}  // namespace packmoe::fuzz
