#include "completion.h"

#include <ATen/core/ivalue.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>

#include "clock.h"
#include "recorded_work.h"

namespace wbt {

namespace {

std::atomic<HostFuncLauncher> g_launcher{nullptr};
std::atomic<uint64_t> g_unstamped{0};

void* current_stream(const at::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device).native_handle();
}

} // namespace

struct CudaStamp {
  std::shared_ptr<Recorder> recorder;
  Record record;
  // Written by the driver's callback thread, read by the end callback, which
  // the stream order runs strictly later; atomic to say so.
  std::atomic<int64_t> start_ns{0};
  // Where the start was enqueued: the only stream on which freeing is
  // ordered after it.
  void* start_stream = nullptr;
};

namespace {

void on_cuda_start(void* p) {
  static_cast<CudaStamp*>(p)->start_ns.store(now_ns());
}

void on_cuda_end(void* p) {
  std::unique_ptr<CudaStamp> s(static_cast<CudaStamp*>(p));
  s->record.end_ns = now_ns();
  s->record.start_ns = s->start_ns.load();
  s->recorder->add(std::move(s->record));
}

void on_cuda_discard(void* p) {
  delete static_cast<CudaStamp*>(p);
}

} // namespace

void set_host_func_launcher(HostFuncLauncher launcher) {
  g_launcher.store(launcher);
}

bool has_host_func_launcher() {
  return g_launcher.load() != nullptr;
}

uint64_t unstamped_cuda_ops() {
  return g_unstamped.load();
}

c10::intrusive_ptr<c10d::Work> stamp_cpu_completion(
    c10::intrusive_ptr<c10d::Work> work,
    Record record,
    std::shared_ptr<Recorder> recorder) {
  if (!work) {
    return work;
  }
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  try {
    fut = work->getFuture();
  } catch (const c10::Error&) {
    // No future (gloo's send/recv, and its reduce_scatter, which finishes
    // inside wait()): stamp when wait returns instead.
  }
  if (!fut) {
    return c10::make_intrusive<RecordedWork>(
        std::move(work), nullptr, std::move(record), std::move(recorder));
  }
  // One callback both stamps and completes the future we hand out, so the
  // span is stored before anyone can see the collective done. It captures
  // no Work: a Work owns its future, and a future owning the Work back
  // through a callback would never be freed.
  auto stamped = fut->then(
      [recorder = std::move(recorder),
       record = std::move(record)](c10::ivalue::Future& f) {
        if (!f.hasError()) { // a failed op is not a timing
          Record done = record;
          done.end_ns = now_ns();
          recorder->add(std::move(done));
        }
        return f.value(); // rethrows a failure into the stamped future
      },
      fut->elementType());
  return c10::make_intrusive<RecordedWork>(
      std::move(work), std::move(stamped), std::nullopt, nullptr);
}

CudaStamp* cuda_begin(
    const at::Device& device,
    std::shared_ptr<Recorder> recorder) {
  const HostFuncLauncher launch = g_launcher.load();
  if (launch == nullptr) {
    ++g_unstamped;
    return nullptr;
  }
  auto* s = new CudaStamp{std::move(recorder), Record{}, {}};
  s->start_stream = current_stream(device);
  if (launch(s->start_stream, on_cuda_start, s) != 0) {
    delete s; // not enqueued, so nothing will touch it
    ++g_unstamped;
    return nullptr;
  }
  return s;
}

c10::intrusive_ptr<c10d::Work> cuda_end(
    c10::intrusive_ptr<c10d::Work> work,
    CudaStamp* stamp,
    Record record,
    const at::Device& device) {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  try {
    fut = work ? work->getFuture() : nullptr;
  } catch (const c10::Error&) {
  }
  if (!fut) {
    ++g_unstamped;
    cuda_discard(stamp);
    return work;
  }
  stamp->record = std::move(record);
  const HostFuncLauncher launch = g_launcher.load();
  // uses_future=true: the callback then runs with the current stream made
  // to wait for the collective's completion events, which is the point.
  fut->addCallback(
      [stamp, launch, device](c10::ivalue::Future& f) {
        if (f.hasError() ||
            launch(current_stream(device), on_cuda_end, stamp) != 0) {
          ++g_unstamped;
          cuda_discard(stamp);
        }
      },
      /*uses_future=*/true);
  return work;
}

void cuda_discard(CudaStamp* stamp) {
  // The start host function may still be queued: free behind it on its
  // stream, never here. If even that cannot be enqueued, leaking is the only
  // safe choice left.
  const HostFuncLauncher launch = g_launcher.load();
  (void)launch(stamp->start_stream, on_cuda_discard, stamp);
}

} // namespace wbt
