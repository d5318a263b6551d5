#pragma once

#include <chrono>
#include <cstdint>

namespace wbt {

// steady_clock is CLOCK_MONOTONIC on Linux, the same clock as Python's
// time.monotonic_ns(), so stamps taken here and in Python can be mixed.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

} // namespace wbt
