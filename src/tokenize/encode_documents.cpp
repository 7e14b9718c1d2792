// Documents handed out by an atomic counter; each thread writes only its own documents' slots.
#include "tokenize/encode_documents.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

namespace packmoe::tokenize {

int default_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

Result<std::vector<std::vector<uint32_t>>> encode_documents(const Tokenizer& tokenizer,
                                                            std::span<const std::string_view> docs,
                                                            int threads, EncodeFailure* failure) {
  PACKMOE_CHECK(threads >= 1, "threads = " << threads);
  std::vector<std::vector<uint32_t>> out(docs.size());
  std::atomic<size_t> next{0};
  std::mutex mu;
  size_t failed_at = docs.size();
  Status failed;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < docs.size();) {
      Result<std::vector<uint32_t>> ids = tokenizer.encode(docs[i]);
      if (ids) {
        out[i] = std::move(ids.value());
        continue;
      }
      std::lock_guard<std::mutex> lock(mu);
      if (i < failed_at) failed_at = i, failed = ids.status();
    }
  };
  const int n = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), docs.size()));
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (failed_at < docs.size()) {
    if (failure) *failure = {failed_at, failed};
    return failed;
  }
  return out;
}

}  // namespace packmoe::tokenize
