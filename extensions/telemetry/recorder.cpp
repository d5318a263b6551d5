#include "recorder.h"

#include <stdexcept>

#include "clock.h"

namespace wbt {

Recorder::Recorder(size_t capacity) : capacity_(capacity) {}

int64_t Recorder::begin(Kind kind, std::string name, std::string stream) {
  if (!enabled()) {
    return 0;
  }
  Record r;
  r.kind = kind;
  r.name = std::move(name);
  r.stream = std::move(stream);
  r.start_ns = now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t token = next_token_++;
  open_.emplace(token, std::move(r));
  return token;
}

void Recorder::end(int64_t token) {
  if (token == 0) {
    return;
  }
  // Stamp before taking the lock so waiting on it is not counted.
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(token);
  if (it == open_.end()) {
    throw std::invalid_argument(
        "unknown or already ended token " + std::to_string(token));
  }
  Record r = std::move(it->second);
  open_.erase(it);
  r.end_ns = t;
  push_locked(std::move(r));
}

void Recorder::add(Record r) {
  if (!enabled()) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  push_locked(std::move(r));
}

void Recorder::push_locked(Record&& r) {
  // Bounded so a rank whose telemetry is never drained cannot grow without
  // limit; the count of losses is reported instead.
  if (done_.size() >= capacity_) {
    ++dropped_;
    return;
  }
  done_.push_back(std::move(r));
}

std::vector<Record> Recorder::drain() {
  std::vector<Record> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(done_);
  return out;
}

size_t Recorder::open_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_.size();
}

uint64_t Recorder::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

const std::shared_ptr<Recorder>& global_recorder() {
  // Leaked on purpose: completion callbacks on communication threads may
  // still fire while the interpreter shuts down.
  static auto* r = new std::shared_ptr<Recorder>(std::make_shared<Recorder>());
  return *r;
}

} // namespace wbt
