#pragma once

// The emulation's timer: one sleeping thread completes CPU futures at their
// deadlines (condition_variable::wait_until); nothing spins.

#include <cstdint>
#include <functional>

namespace wbt::emulation {

// Runs `fn` on the timer thread at or after `deadline_ns` (monotonic ns).
// `fn` completes a future: its callbacks (the recorder's stamp, DDP's) run there.
void run_at(int64_t deadline_ns, std::function<void()> fn);

} // namespace wbt::emulation
