#pragma once

// The per-rank buffer of timed spans. Written from the Python thread
// (begin/end around compute), from communication threads (completion
// callbacks of collectives, which never hold the GIL) and from the CUDA
// driver's callback thread; drained from Python.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace wbt {

// Wait: a thread blocked in Work::wait() for a collective. Compute spans that
// contain one did not compute meanwhile, so overlap subtracts waits from them.
enum class Kind : uint8_t { Compute = 0, Comm = 1, Wait = 2 };

struct Record {
  Kind kind = Kind::Compute;
  std::string name;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  int64_t bytes = 0;
  int64_t group_size = 1;
  std::string stream;
  std::string group;
  // CUDA collectives: the two marks (CUDA events, extensions/cuda/marks.cu)
  // that time it, resolved into start/end later in Python; 0 = host-stamped.
  int64_t start_mark = 0;
  int64_t end_mark = 0;
  // Spans of one queue ran one after another on one stream (the group's).
  std::string queue;
};

class Recorder {
 public:
  // ~150 bytes a record: the default bounds an undrained buffer near 20 MB.
  explicit Recorder(size_t capacity = size_t{1} << 17);

  // Opens a span stamped now; returns a token for end(). Returns 0 (and
  // end(0) does nothing) while disabled, so probes need no branch.
  int64_t begin(Kind kind, std::string name, std::string stream);
  void end(int64_t token);

  // Adds a finished span (from a completion callback).
  void add(Record r);

  // Takes every finished span, oldest first. Open spans stay open.
  std::vector<Record> drain();

  void set_enabled(bool on) {
    enabled_.store(on);
  }
  bool enabled() const {
    return enabled_.load(std::memory_order_relaxed);
  }
  size_t open_count() const;
  // Spans thrown away because nobody drained and the buffer was full.
  uint64_t dropped() const;

 private:
  void push_locked(Record&& r);

  mutable std::mutex mu_;
  std::vector<Record> done_;
  std::unordered_map<int64_t, Record> open_;
  int64_t next_token_ = 1;
  size_t capacity_;
  uint64_t dropped_ = 0;
  std::atomic<bool> enabled_{true};
};

// The rank's recorder: one process is one rank, and the recording backend
// of every process group writes here.
const std::shared_ptr<Recorder>& global_recorder();

} // namespace wbt
