#pragma once

// On a fatal signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT), the crashing
// thread's native frames to stderr, without allocating: a crash that corrupted
// the heap (a collective writing into freed memory) leaves malloc unusable,
// and torch's own fatal-signal handler, which symbolizes with malloc, then
// aborts before it reaches the crashing thread ("malloc_consolidate():
// unaligned fastbin chunk detected", seen in a rank). backtrace() and
// backtrace_symbols_fd() write straight to the descriptor; names come from the
// libraries' dynamic symbols (mangled). Then the handler installed before this
// one runs (torch's, faulthandler's), as if this one were not there; if it has
// not ended the process 5 s later (torch's waits for ever on the lock of the
// corrupted heap's malloc), the signal is raised again at its default action.

namespace wbt {

// Idempotent. The block starts with kCrashFramesHeader.
void install_crash_frames();

constexpr const char* kCrashFramesHeader = "workbench: native frames of the crashing thread";

} // namespace wbt
