#pragma once

// The Work handed back for a recorded CPU collective: gloo's own Work with
// completion stamped natively. Everything is forwarded, except that
//  - getFuture() returns a future completed only after the span is stored.
//    gloo's future flags itself done *before* running its callbacks, so
//    whoever learns of completion through it (DDP's reducer, comm hooks)
//    could otherwise drain before the span arrives; wait() and
//    isCompleted() answer from that future too: a paced Work's future (the
//    emulation's) wakes its waiters before its callbacks run;
//  - a Work without a future (gloo's send/recv and reduce_scatter, which
//    finish inside wait()) is stamped when wait() returns: in C++, but only
//    once the caller looks. So is its flight-recorder entry (`flight`); a
//    Work wrapped only for that (no future, no record) times no waits.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <memory>
#include <optional>

#include "flight_recorder.h"
#include "recorder.h"

namespace wbt {

// Shorter waits are bookkeeping, not blocking: not worth a record.
constexpr int64_t kMinWaitNs = 20'000;

class RecordedWork final : public c10d::Work {
 public:
  // `future` is the stamped future, or null to stamp on wait().
  RecordedWork(
      c10::intrusive_ptr<c10d::Work> inner,
      c10::intrusive_ptr<c10::ivalue::Future> future,
      std::optional<Record> stamp_on_wait,
      std::shared_ptr<Recorder> recorder,
      FlightTicket flight = {});

  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  void blockCurrentStream() override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override;
  float getDuration() const override;
  uint64_t getSequencenumber() const override;

 private:
  void stamp();

  c10::intrusive_ptr<c10d::Work> inner_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::optional<Record> record_;
  std::shared_ptr<Recorder> recorder_;
  std::atomic<bool> stamped_{false};
  FlightTicket flight_;
};

} // namespace wbt
