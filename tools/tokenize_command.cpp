// `packmoe tokenize`: text files, folders and JSONL files -> a Megatron .bin/.idx dataset, one
// document per text file (or per --separator-line section) and per JSONL line, each followed by
// an end-of-document token. Documents are encoded on several threads and written in input order,
// so the output bytes do not depend on --threads. Invariant: every input is checked (flags,
// tokenizer, paths) before the output is created, and the output files appear only when the whole
// corpus has been tokenized (io/megatron_writer.h): a bad input leaves nothing behind.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/checked_math.h"
#include "core/json_limits.h"
#include "io/megatron_writer.h"
#include "io/read_file.h"
#include "tokenize/encode_documents.h"
#include "tokenize/tokenizer.h"
#include "tools/commands.h"
#include "tools/exact_integer.h"

namespace packmoe::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Documents encoded per batch: enough to keep every thread busy, few enough to bound memory.
constexpr size_t kBatchDocuments = 4096;
constexpr size_t kBatchBytes = size_t{32} << 20;

struct InputFile {
  std::string path;
  bool jsonl = false;
  uint64_t bytes = 0;
};

bool is_jsonl(const fs::path& p) { return p.extension() == ".jsonl" || p.extension() == ".json"; }

bool hidden_below(const fs::path& root, const fs::path& p) {
  for (const fs::path& part : fs::relative(p, root))
    if (const std::string s = part.string(); !s.empty() && s[0] == '.' && s != "." && s != "..")
      return true;
  return false;
}

// Files in command-line order; a folder contributes its regular files, recursively, sorted by
// path, hidden ones skipped.
Result<std::vector<InputFile>> collect_inputs(const std::vector<std::string>& inputs) {
  std::vector<InputFile> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(in, ec);
    if (ec || !fs::exists(st)) return Status::error("--input " + in + ": not found");
    std::vector<std::string> found;
    if (fs::is_directory(st)) {
      for (auto it = fs::recursive_directory_iterator(in, ec); !ec && it != fs::end(it);
           it.increment(ec)) {
        std::error_code fec;
        if (it->is_regular_file(fec) && !hidden_below(in, it->path()))
          found.push_back(it->path().string());
      }
      if (ec) return Status::error("--input " + in + ": cannot list the folder: " + ec.message());
      std::sort(found.begin(), found.end());
      if (found.empty()) return Status::error("--input " + in + ": the folder holds no files");
    } else {
      found.push_back(in);
    }
    for (const std::string& f : found) {
      Result<io::RegularFile> r = io::RegularFile::open(f);  // refuses FIFOs and devices
      if (!r) return Status::error("--input " + r.status().message());
      files.push_back({f, is_jsonl(f), r.value().size()});
    }
  }
  return files;
}

// One input file's documents, with a name for each in error messages.
struct Documents {
  std::vector<std::string> text;
  std::vector<std::string> where;  // "file:line" or "file"
};

Status read_documents(const InputFile& in, const TokenizeArgs& args, Documents* docs) {
  const uint64_t limit = static_cast<uint64_t>(host_memory_bytes() / 4);
  Result<std::string> data = io::read_regular_file(in.path, limit);
  if (!data) return data.status();
  const std::string_view text = data.value();
  size_t line_begin = 0, line_no = 0, doc_begin = 0;
  auto add = [&](std::string_view doc, const std::string& where) {
    if (doc.empty()) return;  // as Megatron's preprocess_data.py, empty documents are dropped
    docs->text.emplace_back(doc);
    docs->where.push_back(where);
  };
  while (line_begin <= text.size()) {
    if (!in.jsonl && args.separator_line.empty()) {  // the whole file is one document
      add(text, in.path);
      return Status::ok();
    }
    const size_t nl = text.find('\n', line_begin);
    const size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    const size_t next = nl == std::string_view::npos ? text.size() + 1 : nl + 1;
    std::string_view line = text.substr(line_begin, line_end - line_begin);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    ++line_no;
    const std::string where = in.path + ":" + std::to_string(line_no);
    if (in.jsonl) {
      if (line.find_first_not_of(" \t") != std::string_view::npos) {
        Result<json> j = parse_json_text(line, where);
        if (!j) return j.status();
        if (!j.value().is_object()) return Status::error(where + ": a JSONL line must be an object");
        const auto it = j.value().find(args.json_key);
        if (it == j.value().end())
          return Status::error(where + ": no \"" + printable_text(args.json_key) +
                               "\" field (--json-key)");
        if (!it->is_string())
          return Status::error(where + ": \"" + printable_text(args.json_key) +
                               "\" must be a string (got " + json_brief(*it) + ")");
        add(it->get_ref<const std::string&>(), where);
      }
    } else if (line == args.separator_line) {
      add(text.substr(doc_begin, line_begin - doc_begin), where);
      doc_begin = next;
    }
    line_begin = next;
  }
  if (!in.jsonl && doc_begin < text.size())
    add(text.substr(doc_begin), in.path + ":" + std::to_string(line_no));
  return Status::ok();
}

// The end-of-document token: --eod-token (an id or a token's text), "none", or the tokenizer's eos.
Result<std::optional<uint32_t>> resolve_eod(const TokenizeArgs& args,
                                            const tokenize::Tokenizer& t) {
  const std::string& e = args.eod_token;
  if (e == "none") return std::optional<uint32_t>();
  if (e.empty()) {
    if (!t.eos_id())
      return Status::error("--tokenizer " + args.tokenizer +
                           " names no eos token: give --eod-token ID|TOKEN (or --eod-token none)");
    return std::optional<uint32_t>(*t.eos_id());
  }
  if (std::all_of(e.begin(), e.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
      e.size() <= 10) {
    const uint64_t id = std::stoull(e);
    if (id >= t.vocab_size())
      return Status::error("--eod-token " + e + " is not below the tokenizer's vocab_size " +
                           std::to_string(t.vocab_size()));
    return std::optional<uint32_t>(static_cast<uint32_t>(id));
  }
  if (const auto id = t.token_id(e)) return std::optional<uint32_t>(*id);
  return Status::error("--eod-token " + printable_text(e) + " is neither an id nor a token of " +
                       args.tokenizer);
}

class ProgressBar {
 public:
  ProgressBar(bool on, uint64_t total) : on_(on), total_(std::max<uint64_t>(total, 1)) {}
  void update(uint64_t done, uint64_t docs, bool last = false) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    if (!last && now - drawn_ < std::chrono::milliseconds(200)) return;
    drawn_ = now;
    const double f = std::min(1.0, static_cast<double>(done) / static_cast<double>(total_));
    const double s = std::chrono::duration<double>(now - start_).count();
    const int width = 30, fill = static_cast<int>(f * width);
    std::fprintf(stderr, "\rtokenize [%s%s] %3d%% %.1f/%.1f MB, %llu documents, %.1f MB/s ",
                 std::string(fill, '#').c_str(), std::string(width - fill, ' ').c_str(),
                 static_cast<int>(f * 100), done / 1e6, total_ / 1e6,
                 static_cast<unsigned long long>(docs), s > 0 ? done / 1e6 / s : 0.0);
    if (last) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  }

 private:
  bool on_;
  uint64_t total_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), drawn_{};
};

}  // namespace

void add_tokenize_command(CLI::App& app, TokenizeArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "Tokenize text into a Megatron-LM indexed dataset PREFIX.bin + PREFIX.idx (what\n"
      "`packmoe train --data megatron:PREFIX` and Megatron-LM read). Inputs: text files (each one\n"
      "document, or split at --separator-line lines), JSONL files (.jsonl or .json: one document\n"
      "per line, the string field --json-key), and folders (their files, recursively, sorted by\n"
      "path, hidden ones skipped). Each document is followed by the end-of-document token (the\n"
      "tokenizer's eos unless --eod-token); empty documents are dropped. Token ids are uint16 when\n"
      "the vocabulary has at most 65536 entries, else int32. Documents are encoded on --threads\n"
      "threads and written in input order: the output does not depend on the thread count. The\n"
      "files appear only once everything is tokenized; a bad input writes nothing.\n"
      "Tokenizers: a Hugging Face tokenizer.json (byte-level BPE: GPT-2, Qwen2/3, Llama-3), a\n"
      "SentencePiece .model, or a folder holding either (tokenizer_config.json beside it gives\n"
      "eos_token).");
  cmd->add_option("--tokenizer", args.tokenizer,
                  "tokenizer.json, a SentencePiece .model, or a folder holding one")
      ->required();
  cmd->add_option("--input", args.inputs, "text / JSONL files and folders, in order")
      ->required()
      ->expected(1, -1);
  cmd->add_option("--output", args.output,
                  "output prefix: writes PREFIX.bin and PREFIX.idx (the folder must exist)")
      ->required();
  cmd->add_option("--json-key", args.json_key, "JSONL field holding the text (default: text)");
  cmd->add_option("--separator-line", args.separator_line,
                  "in text files, a line of exactly this text ends a document (e.g. % for "
                  "fortune files); default: each text file is one document");
  cmd->add_option("--eod-token", args.eod_token,
                  "end-of-document token after each document: an id, a token's text (e.g. "
                  "\"<|im_end|>\"), or none (default: the tokenizer's eos token)");
  cmd->add_flag("--add-bos", args.add_bos,
                "also put the tokenizer's bos token before each document (Llama-3 style)");
  cmd->add_option("--threads", args.threads,
                  "encoding threads (default: the hardware's, " +
                      std::to_string(tokenize::default_threads()) + ")")
      ->check(exact_integer<int>());
  cmd->add_flag("--quiet", args.quiet, "no progress bar and no summary line");
}

Status run_tokenize(const TokenizeArgs& args) {
  const int threads = args.threads == 0 ? tokenize::default_threads() : args.threads;
  if (threads < 1 || threads > 4096)
    return Status::error("--threads " + std::to_string(args.threads) + " must be in [1, 4096]");
  if (args.json_key.empty()) return Status::error("--json-key must not be empty");
  const fs::path out_dir = fs::path(args.output).parent_path();
  if (fs::path(args.output).filename().empty())
    return Status::error("--output " + args.output + " must be a file prefix, not a folder");
  std::error_code ec;
  if (!out_dir.empty() && !fs::is_directory(out_dir, ec))
    return Status::error("--output " + args.output + ": the folder " + out_dir.string() +
                         " does not exist");
  Result<std::unique_ptr<tokenize::Tokenizer>> loaded = tokenize::load_tokenizer(args.tokenizer);
  if (!loaded) return loaded.status();
  const tokenize::Tokenizer& tok = *loaded.value();
  Result<std::optional<uint32_t>> eod = resolve_eod(args, tok);
  if (!eod) return eod.status();
  if (args.add_bos && !tok.bos_id())
    return Status::error("--add-bos: --tokenizer " + args.tokenizer + " names no bos token");
  Result<std::vector<InputFile>> inputs = collect_inputs(args.inputs);
  if (!inputs) return inputs.status();
  uint64_t total_bytes = 0;
  for (const InputFile& f : inputs.value()) total_bytes += f.bytes;

  const io::MegatronDType dtype =
      tok.vocab_size() <= 65536 ? io::MegatronDType::kU16 : io::MegatronDType::kI32;
  Result<io::MegatronWriter> writer = io::MegatronWriter::create(args.output, dtype);
  if (!writer) return writer.status();
  ProgressBar bar(!args.quiet && isatty(STDERR_FILENO) != 0, total_bytes);
  const auto start = std::chrono::steady_clock::now();
  uint64_t done_bytes = 0, text_bytes = 0;
  std::vector<uint32_t> doc;
  for (const InputFile& in : inputs.value()) {
    Documents docs;
    PACKMOE_RETURN_IF_ERROR(read_documents(in, args, &docs));
    for (size_t first = 0; first < docs.text.size();) {
      size_t last = first, bytes = 0;
      while (last < docs.text.size() && last - first < kBatchDocuments && bytes < kBatchBytes)
        bytes += docs.text[last++].size();
      std::vector<std::string_view> batch(docs.text.begin() + first, docs.text.begin() + last);
      tokenize::EncodeFailure failure;
      Result<std::vector<std::vector<uint32_t>>> ids =
          tokenize::encode_documents(tok, batch, threads, &failure);
      if (!ids)
        return Status::error(docs.where[first + failure.document] + ": " +
                             failure.status.message());
      for (const std::vector<uint32_t>& d : ids.value()) {
        doc.clear();
        if (args.add_bos) doc.push_back(*tok.bos_id());
        doc.insert(doc.end(), d.begin(), d.end());
        if (eod.value()) doc.push_back(*eod.value());
        PACKMOE_RETURN_IF_ERROR(writer.value().add_document(doc));
      }
      text_bytes += bytes;
      bar.update(done_bytes + std::min<uint64_t>(text_bytes, in.bytes), writer.value().documents());
      first = last;
    }
    done_bytes += in.bytes;
    text_bytes = 0;
    bar.update(done_bytes, writer.value().documents());
  }
  if (writer.value().documents() == 0)
    return Status::error("--input: no documents (every input is empty)");
  PACKMOE_RETURN_IF_ERROR(writer.value().finish());
  bar.update(total_bytes, writer.value().documents(), true);
  if (!args.quiet) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("tokenized %llu documents from %zu files into %llu tokens (%s, %s, vocab %u) in "
                "%.1f s: %s.bin, %s.idx\n",
                static_cast<unsigned long long>(writer.value().documents()), inputs.value().size(),
                static_cast<unsigned long long>(writer.value().tokens()), tok.kind(),
                dtype == io::MegatronDType::kU16 ? "uint16" : "int32", tok.vocab_size(), s,
                args.output.c_str(), args.output.c_str());
  }
  return Status::ok();
}

}  // namespace packmoe::tools
