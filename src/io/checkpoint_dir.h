// Training-checkpoint directories (docs/checkpoints.md). A checkpoint is ROOT/step-00000123 holding
// flat files plus a complete.json marker (step, every file's size and CRC-32C); it is written as
// ROOT/.tmp-step-00000123-<pid> and renamed into place only after every file, the marker and the
// directory are fsync'd. Invariant: a step-* directory with a valid marker was completely written;
// a crash or error at any point leaves every earlier checkpoint as it was.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace packmoe::io {

inline constexpr const char* kCheckpointMarker = "complete.json";

// CRC-32C (Castagnoli, reflected 0x82F63B78, init and final xor 0xFFFFFFFF): crc32c of "123456789"
// is 0xE3069283. `crc` chains calls: crc32c(b, crc32c(a)) == crc32c(a then b).
uint32_t crc32c(std::span<const uint8_t> bytes, uint32_t crc = 0);

// "step-00000123": eight digits at least, more for steps above 99999999.
std::string checkpoint_dir_name(int64_t step);

struct CheckpointFile {
  std::string name;  // a plain file name inside the checkpoint directory
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

struct CheckpointInfo {
  int64_t step = -1;
  std::string dir;                    // the checkpoint directory
  std::vector<CheckpointFile> files;  // sorted by name; the marker itself is not listed
};

// Writes one checkpoint. begin() makes the temporary directory; the caller writes regular files
// (no subdirectories) into dir(), then commit() publishes them. Destroying or abort()ing an
// uncommitted writer removes its temporary directory.
class CheckpointWriter {
 public:
  // keep_last >= 1: after a commit at step s, the newest keep_last checkpoints with a step <= s
  // that verify (verify_checkpoint; the new one included) stay and older complete ones are
  // deleted; newer ones, and damaged ones among the kept, are not touched.
  static Result<CheckpointWriter> begin(const std::string& root, int64_t step, int keep_last);

  CheckpointWriter(CheckpointWriter&& other) noexcept;
  CheckpointWriter& operator=(CheckpointWriter&& other) noexcept;
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter();

  const std::string& dir() const { return tmp_dir_; }    // where the caller writes
  std::string path(const std::string& file_name) const;  // dir() + "/" + file_name
  int64_t step() const { return step_; }

  struct Committed {
    CheckpointInfo info;                // info.dir is ROOT/step-...
    std::vector<std::string> removed;   // directories deleted after the commit
    std::vector<std::string> warnings;  // clean-up failures or a failed fsync of ROOT after the
                                        // rename; the checkpoint is complete and in place
  };
  // fsyncs every file, writes the marker, fsyncs the directory, renames it to ROOT/step-... (an
  // existing directory of the same step is replaced), fsyncs ROOT, then removes checkpoints beyond
  // keep_last and temporary directories of writers that are no longer running (same host).
  // On error the temporary directory is removed and ROOT's checkpoints are unchanged.
  Result<Committed> commit();
  void abort();  // drop the temporary directory; the writer is then spent

 private:
  CheckpointWriter() = default;
  std::string root_;
  std::string tmp_dir_;  // empty once committed or aborted
  int64_t step_ = -1;
  int keep_last_ = 1;
};

// Re-reads a checkpoint directory: the marker parses, its step matches the directory name (when it
// is step-N), every listed file exists with the recorded size and CRC-32C, and no unlisted file is
// present. Errors name the offending file, e.g. "ROOT/step-00000123/model.safetensors: 4096 bytes,
// complete.json records 8192 (truncated?)".
Result<CheckpointInfo> verify_checkpoint(const std::string& dir);

struct LatestCheckpoint {
  std::optional<CheckpointInfo> found;  // none: ROOT holds no complete checkpoint (or is missing)
  std::vector<std::string> skipped;     // why each newer step-* directory was passed over
};
// The newest step-* directory under ROOT that passes verify_checkpoint (so its files are read
// once here). An error only when ROOT exists but cannot be listed.
Result<LatestCheckpoint> latest_checkpoint(const std::string& root);

// The step-* checkpoint directories under `root`, complete or not, newest first (none when
// `root` does not exist): a new run refuses a root that holds some (another run's).
Result<std::vector<std::string>> checkpoint_dirs(const std::string& root);
// Deletes every directory checkpoint_dirs(root) lists (train --overwrite).
Status remove_checkpoints(const std::string& root);

}  // namespace packmoe::io
