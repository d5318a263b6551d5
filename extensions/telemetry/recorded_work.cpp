#include "recorded_work.h"

#include <ATen/core/ivalue.h>

#include "clock.h"

namespace wbt {

RecordedWork::RecordedWork(
    c10::intrusive_ptr<c10d::Work> inner,
    c10::intrusive_ptr<c10::ivalue::Future> future,
    std::optional<Record> stamp_on_wait,
    std::shared_ptr<Recorder> recorder,
    FlightTicket flight)
    : c10d::Work(-1, inner->retrieveOpType()),
      inner_(std::move(inner)),
      future_(std::move(future)),
      record_(std::move(stamp_on_wait)),
      recorder_(std::move(recorder)),
      flight_(flight) {}

void RecordedWork::stamp() {
  if (stamped_.exchange(true)) {
    return;
  }
  if (flight_.id != 0) {
    flight_ring().complete(flight_, false, false, 0);
  }
  if (!record_) {
    return;
  }
  record_->end_ns = now_ns();
  recorder_->add(std::move(*record_));
}

bool RecordedWork::isCompleted() {
  // Done once the span is stored: the inner Work reports itself done before
  // its future has run the callback that stores it.
  const bool done = future_ ? future_->completed() : inner_->isCompleted();
  if (done) {
    stamp();
  }
  return done;
}

bool RecordedWork::wait(std::chrono::milliseconds timeout) {
  const int64_t start = now_ns();
  bool ok = false;
  try {
    ok = inner_->wait(timeout);
    if (ok && future_) {
      // The inner Work wakes its waiters before its future runs callbacks, so
      // it can return while the callback that stores the span has yet to run:
      // a step drained then loses the collective to the next step's discard
      // (one rank's step saw it, the other's did not). The stamped future
      // completes only after the span is stored.
      future_->wait();
    }
  } catch (...) {
    if (flight_.id != 0 && !stamped_.exchange(true)) {
      flight_ring().complete(flight_, true, false, 0);
    }
    throw;
  }
  stamp();
  if (!future_ && !record_ && !recorder_) {
    return ok; // wrapped for the flight recorder only: its caller's wait is timed by the wrapper outside
  }
  const int64_t end = now_ns();
  // A wait that blocked (not one on a collective already done) is time the
  // calling thread did not compute: FSDP2 waiting for its all-gather, a
  // tensor-parallel wait_tensor, a pipeline recv.
  // Works whose end is stamped through their future carry no recorder of their own.
  const auto& recorder = recorder_ ? recorder_ : global_recorder();
  if (end - start > kMinWaitNs && recorder->enabled()) {
    Record r;
    r.kind = Kind::Wait;
    r.name = "wait " + c10d::opTypeToString(retrieveOpType());
    r.start_ns = start;
    r.end_ns = end;
    r.stream = "caller";
    recorder->add(std::move(r));
  }
  return ok;
}

c10::intrusive_ptr<c10::ivalue::Future> RecordedWork::getFuture() {
  return future_ ? future_ : inner_->getFuture();
}

bool RecordedWork::isSuccess() const {
  return inner_->isSuccess();
}

std::exception_ptr RecordedWork::exception() const {
  return inner_->exception();
}

int RecordedWork::sourceRank() const {
  return inner_->sourceRank();
}

std::vector<at::Tensor> RecordedWork::result() {
  return inner_->result();
}

void RecordedWork::synchronize() {
  inner_->synchronize();
}

void RecordedWork::blockCurrentStream() {
  inner_->blockCurrentStream();
}

void RecordedWork::abort() {
  inner_->abort();
}

c10::intrusive_ptr<c10::ivalue::Future> RecordedWork::getFutureResult() {
  return inner_->getFutureResult();
}

float RecordedWork::getDuration() const {
  return inner_->getDuration();
}

uint64_t RecordedWork::getSequencenumber() const {
  return inner_->getSequencenumber();
}

} // namespace wbt
