// The crashing thread's native frames on a fatal signal; see crash_frames.h.

#include "crash_frames.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace wbt {

namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
constexpr int kMaxFrames = 64;
// How long the handlers after this one may take before the process is ended anyway. torch's symbolizes with
// malloc; after glibc found a corrupted heap inside malloc (malloc_consolidate) the crashing thread still holds
// the arena's lock, so that handler waits on it for ever and the rank, its other threads alive, hangs instead of
// dying (seen in a rank: reported as stuck after 180 s instead of dead in seconds).
constexpr unsigned kHandOnSeconds = 5;

volatile sig_atomic_t g_fatal_signal = 0;

struct sigaction g_previous[NSIG];
std::atomic<bool> g_installed{false};

void put(const char* s) {
  size_t left = std::strlen(s);
  while (left > 0) {
    const ssize_t n = ::write(2, s, left);
    if (n <= 0) {
      return;
    }
    s += n;
    left -= static_cast<size_t>(n);
  }
}

// Decimal without allocating (printf may not be called from a signal handler).
void put_number(long value) {
  char digits[24];
  int i = sizeof(digits) - 1;
  digits[i] = '\0';
  const bool negative = value < 0;
  unsigned long v = negative ? -static_cast<unsigned long>(value) : static_cast<unsigned long>(value);
  do {
    digits[--i] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0 && i > 1);
  if (negative) {
    digits[--i] = '-';
  }
  put(digits + i);
}

// The handlers after this one did not finish: the fatal signal again, at its default action, to the process. The
// hung thread blocks that signal (it is inside its handler); another thread takes it and the process ends with it.
void on_hand_on_timeout(int) {
  const int sig = g_fatal_signal;
  put("workbench: the fatal-signal handlers after this one did not finish in ");
  put_number(kHandOnSeconds);
  put(" s; the process ends with signal ");
  put_number(sig);
  put("\n");
  struct sigaction fallback{};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(sig, &fallback, nullptr);
  ::kill(::getpid(), sig);
}

void on_fatal_signal(int sig, siginfo_t* info, void* context) {
  put(kCrashFramesHeader);
  put(" (thread ");
  put_number(static_cast<long>(::syscall(SYS_gettid)));
  put(", signal ");
  put_number(sig);
  put("):\n");
  void* frames[kMaxFrames];
  const int n = ::backtrace(frames, kMaxFrames);
  ::backtrace_symbols_fd(frames, n, 2);
  put("\n");
  // Hand the signal on as faulthandler does: the previous disposition back, the signal raised again on this
  // thread; it stays blocked until this handler returns, then the previous handler (or the default action) has it.
  // An alarm first, in case that handler never returns.
  g_fatal_signal = sig;
  struct sigaction watchdog{};
  watchdog.sa_handler = on_hand_on_timeout;
  sigemptyset(&watchdog.sa_mask);
  ::sigaction(SIGALRM, &watchdog, nullptr);
  ::alarm(kHandOnSeconds);
  ::sigaction(sig, &g_previous[sig], nullptr);
  ::raise(sig);
  (void)info;
  (void)context;
}

} // namespace

void install_crash_frames() {
  if (g_installed.exchange(true)) {
    return;
  }
  // backtrace() loads libgcc's unwinder on its first call, which allocates: do it now, not in a crash.
  void* warm[1];
  ::backtrace(warm, 1);
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = on_fatal_signal;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (int sig : kSignals) {
    ::sigaction(sig, &action, &g_previous[sig]);
  }
}

} // namespace wbt
