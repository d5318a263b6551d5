// The paced Works; see emulation_works.h.

#include "emulation_works.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "clock.h"
#include "emulation_pacer.h"
#include "torch_handles.h"

namespace wbt::emulation {

namespace {

std::atomic<CudaStartStamp> g_cuda_stamp{nullptr};
std::atomic<CudaHold> g_cuda_hold{nullptr};

void hold_current_stream(const at::Device& device, int64_t slot, int64_t target_ns, int64_t real_ns) {
  const CudaHold hold = g_cuda_hold.load();
  const int err = hold(device.index(), current_stream(device), slot, target_ns, real_ns);
  TORCH_CHECK(err == 0, "workbench emulation: holding the stream failed (CUDA error ", err, ")");
}

// What both paced Works forward unchanged to the inner backend's Work.
class PacedBase : public c10d::Work {
 public:
  explicit PacedBase(c10::intrusive_ptr<c10d::Work> inner)
      : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)) {}

  bool isSuccess() const override {
    return inner_->isSuccess();
  }
  std::exception_ptr exception() const override {
    return inner_->exception();
  }
  int sourceRank() const override {
    return inner_->sourceRank();
  }
  std::vector<at::Tensor> result() override {
    return inner_->result();
  }
  void abort() override {
    inner_->abort();
  }
  float getDuration() const override {
    return inner_->getDuration();
  }
  uint64_t getSequencenumber() const override {
    return inner_->getSequencenumber();
  }
 protected:
  c10::intrusive_ptr<c10d::Work> inner_;
};

// --- CPU: a Work whose completion waits for the deadline ----------------------

class PacedWork final : public PacedBase {
 public:
  PacedWork(c10::intrusive_ptr<c10d::Work> inner, Start start, int64_t target_ns)
      : PacedBase(std::move(inner)),
        start_(std::move(start)),
        target_ns_(target_ns) {
    const auto fut = future_of(inner_);
    if (!fut) { // paced in wait()
      return;
    }
    future_ = c10::make_intrusive<c10::ivalue::Future>(fut->elementType());
    // Captures no Work (a future owning its Work back would never be freed).
    fut->addCallback([out = future_, start = start_, target_ns](c10::ivalue::Future& f) {
      if (f.hasError()) {
        out->setError(f.exception_ptr());
        return;
      }
      const int64_t end = now_ns();
      const int64_t due = deadline_ns(start, end, target_ns);
      if (due <= end) {
        out->markCompleted(f.value());
        return;
      }
      run_at(due, [out, value = f.value()]() mutable { out->markCompleted(std::move(value)); });
    });
  }

  bool isCompleted() override {
    if (future_) {
      return future_->completed();
    }
    return inner_->isCompleted() && now_ns() >= resolve_deadline();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    const bool ok = inner_->wait(timeout);
    if (future_) {
      future_->wait(); // a condition variable: sleeps until the timer completes it
      future_->value(); // rethrows a failure
    } else {
      std::this_thread::sleep_until(
          std::chrono::steady_clock::time_point(std::chrono::nanoseconds(resolve_deadline())));
    }
    return ok;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_ ? future_ : inner_->getFuture();
  }
  void synchronize() override {
    inner_->synchronize();
  }

 private:
  // A Work without a future learns of its real end when it is first found
  // complete: the deadline counts from then.
  int64_t resolve_deadline() {
    int64_t due = deadline_.load();
    if (due == 0) {
      const int64_t fresh = deadline_ns(start_, now_ns(), target_ns_);
      if (deadline_.compare_exchange_strong(due, fresh)) {
        due = fresh;
      }
    }
    return due;
  }

  c10::intrusive_ptr<c10::ivalue::Future> future_;
  Start start_;
  int64_t target_ns_;
  std::atomic<int64_t> deadline_{0};
};

// --- CUDA: the consumer's stream is held by a kernel waiting on the GPU clock ---

// NCCL's Work: wait() makes the caller's stream wait for the collective; ours
// then also makes it wait for the deadline. The future handed out completes
// after a hold recorded on the callback's stream, which CUDA futures make
// their consumers wait for. isCompleted() reports the real completion only:
// the deadline lives on the GPU clock.
class PacedCudaWork final : public PacedBase {
 public:
  PacedCudaWork(
      c10::intrusive_ptr<c10d::Work> inner,
      at::Device device,
      int64_t slot,
      int64_t real_ns,
      int64_t target_ns)
      : PacedBase(std::move(inner)),
        device_(device),
        slot_(slot),
        real_ns_(real_ns),
        target_ns_(target_ns) {}

  bool isCompleted() override {
    return inner_->isCompleted();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    const bool ok = inner_->wait(timeout);
    hold_current_stream(device_, slot_, target_ns_, real_ns_);
    return ok;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!future_) {
      auto fut = inner_->getFuture();
      future_ = fut->then(
          [device = device_, slot = slot_, target = target_ns_, real = real_ns_](c10::ivalue::Future& f) {
            if (!f.hasError()) {
              hold_current_stream(device, slot, target, real);
            }
            return f.value();
          },
          fut->elementType());
    }
    return future_;
  }
  void synchronize() override {
    inner_->synchronize();
    hold_current_stream(device_, slot_, target_ns_, real_ns_);
  }
  void blockCurrentStream() override {
    inner_->blockCurrentStream();
    hold_current_stream(device_, slot_, target_ns_, real_ns_);
  }

 private:
  at::Device device_;
  int64_t slot_, real_ns_, target_ns_;
  std::mutex mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace

c10::intrusive_ptr<c10d::Work> paced_cpu(c10::intrusive_ptr<c10d::Work> inner, Start start, int64_t target_ns) {
  return c10::make_intrusive<PacedWork>(std::move(inner), std::move(start), target_ns);
}

c10::intrusive_ptr<c10d::Work> paced_cuda(
    c10::intrusive_ptr<c10d::Work> inner,
    const at::Device& device,
    int64_t slot,
    int64_t real_ns,
    int64_t target_ns) {
  return c10::make_intrusive<PacedCudaWork>(std::move(inner), device, slot, real_ns, target_ns);
}

void set_cuda_pacer(CudaStartStamp stamp, CudaHold hold) {
  g_cuda_stamp.store(stamp);
  g_cuda_hold.store(hold);
}

int64_t cuda_stamp(const at::Device& device) {
  const CudaStartStamp stamp = g_cuda_stamp.load();
  TORCH_CHECK(
      stamp != nullptr && g_cuda_hold.load() != nullptr,
      "workbench emulation: CUDA collectives need the CUDA library's pacer "
      "(workbench.emulation.rank installs it; build it with python -m workbench.doctor --build)");
  const int64_t slot = stamp(device.index(), current_stream(device));
  TORCH_CHECK(slot >= 0, "workbench emulation: stamping the start failed (CUDA error ", -slot, ")");
  return slot;
}

} // namespace wbt::emulation
