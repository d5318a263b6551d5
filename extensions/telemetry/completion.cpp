#include "completion.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "clock.h"
#include "recorded_work.h"
#include "torch_handles.h"

namespace wbt {

namespace {

std::atomic<CudaMarker> g_marker{nullptr};
std::atomic<CudaMarkRelease> g_release{nullptr};
std::atomic<uint64_t> g_unstamped{0};
std::atomic<int64_t> g_stamp_delay_ns{0};

} // namespace

struct CudaStamp {
  std::shared_ptr<Recorder> recorder;
  int64_t start_mark = 0;
};

void set_cuda_marker(CudaMarker mark, CudaMarkRelease release) {
  g_release.store(release);
  g_marker.store(mark);
}

bool has_cuda_marker() {
  return g_marker.load() != nullptr;
}

void delay_cpu_stamps(int64_t ns) {
  g_stamp_delay_ns.store(ns);
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
  const auto fut = future_of(work);
  if (!fut) { // stamped when wait returns instead
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
          if (const int64_t delay = g_stamp_delay_ns.load(std::memory_order_relaxed); delay > 0) {
            std::this_thread::sleep_for(std::chrono::nanoseconds(delay));
          }
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
  const int64_t id = cuda_mark_now(device);
  if (id == 0) {
    ++g_unstamped;
    return nullptr;
  }
  return new CudaStamp{std::move(recorder), id};
}

c10::intrusive_ptr<c10d::Work> cuda_end(
    c10::intrusive_ptr<c10d::Work> work,
    CudaStamp* stamp,
    Record record,
    const at::Device& device) {
  std::unique_ptr<CudaStamp> owned(stamp);
  const auto fut = future_of(work);
  if (!fut) {
    ++g_unstamped;
    cuda_release_mark(owned->start_mark);
    return work;
  }
  record.start_mark = owned->start_mark;
  // uses_future=true: the callback runs with a pool stream made current and
  // made to wait for the collective's completion events, which is the point.
  // It captures no Work (a future owning its Work back would never be freed).
  fut->addCallback(
      [stamp = owned.release(), record = std::move(record), device](c10::ivalue::Future& f) mutable {
        std::unique_ptr<CudaStamp> s(stamp);
        const int64_t end = f.hasError() ? 0 : cuda_mark_now(device);
        if (end == 0) {
          ++g_unstamped;
          cuda_release_mark(s->start_mark);
          return;
        }
        record.end_mark = end;
        s->recorder->add(std::move(record));
      },
      /*uses_future=*/true);
  return work;
}

int64_t cuda_mark_now(const at::Device& device) {
  const CudaMarker mark = g_marker.load();
  const int64_t id = mark == nullptr ? 0 : mark(device.index(), current_stream(device));
  return id > 0 ? id : 0;
}

void cuda_release_mark(int64_t mark) {
  const CudaMarkRelease release = g_release.load();
  if (release != nullptr && mark > 0) {
    release(&mark, 1);
  }
}

void cuda_discard(CudaStamp* stamp) {
  std::unique_ptr<CudaStamp> owned(stamp);
  cuda_release_mark(owned->start_mark);
}

} // namespace wbt
