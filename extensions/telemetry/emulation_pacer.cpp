// The emulation's timer thread; see emulation_pacer.h.

#include "emulation_pacer.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "clock.h"

namespace wbt::emulation {

namespace {

class Pacer {
 public:
  void at(int64_t deadline, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!started_) {
        // Detached: it lives as long as the process, like the rank's recorder.
        std::thread([this] { loop(); }).detach();
        started_ = true;
      }
      due_.emplace(deadline, std::move(fn));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (due_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const auto first = due_.begin();
      if (now_ns() < first->first) {
        cv_.wait_until(lock, std::chrono::steady_clock::time_point(std::chrono::nanoseconds(first->first)));
        continue;
      }
      auto fn = std::move(first->second);
      due_.erase(first);
      lock.unlock();
      fn(); // completes a future: its callbacks (the recorder's stamp, DDP's) run here
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<int64_t, std::function<void()>> due_;
  bool started_ = false;
};

Pacer& pacer() {
  static Pacer* p = new Pacer(); // never destroyed: its thread may outlive static destruction
  return *p;
}

} // namespace

void run_at(int64_t deadline_ns, std::function<void()> fn) {
  pacer().at(deadline_ns, std::move(fn));
}

} // namespace wbt::emulation
