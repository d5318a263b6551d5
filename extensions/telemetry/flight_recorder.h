// The flight recorder: a small ring, per rank process, of the last collectives this
// rank issued, on every process group, and whether each has completed. It is what tells
// a hang apart from a desync: when ranks wait in a collective that another rank never
// issued, every rank's ring shows it (workbench.telemetry.flight explains the mismatch).
//
// The recording backend writes it (one call where a collective is issued, a watch on the
// Work it returns); it is on whether or not telemetry records spans, costs one short
// locked copy per collective, and holds at most `capacity` entries (no Work, no tensor).
// Readable from any thread, also while the main thread is blocked inside a collective.
//
// Completion: on CPU (gloo) when the Work's future completes, or, for Works without a
// future (gloo's send/recv and reduce_scatter, done inside wait()), when wait() returns.
// On CUDA (NCCL) a Work's future completes when the collective is enqueued, so the
// entry then only says so ("enqueued") and, where the CUDA marker is loaded, holds a
// mark recorded behind the collective on the device; the reader asks the CUDA library
// whether that mark is done (workbench.telemetry.flight.snapshot does).

#pragma once

#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace wbt {

enum class FlightState : uint8_t { Issued = 0, Enqueued = 1, Done = 2, Failed = 3 };

struct FlightEntry {
  uint64_t id = 0;   // issue order on this rank, from 1; 0 = empty slot
  std::string group; // as the recording backend labels the group ("mesh_dp", or its uid)
  std::string uid;   // the group's unique name: the same group on every member rank
  std::string op;    // "all_reduce", "send+recv" (a coalesced batch), ...
  uint64_t seq = 0;  // this collective's number within its group on this rank, from 1
  int64_t bytes = 0; // payload as nccl-tests counts it (the recorder's convention)
  int64_t group_size = 1;
  std::string backend; // "gloo" or "nccl"
  int64_t start_ns = 0; // issued (steady clock, as the recorder's spans)
  int64_t end_ns = 0;   // completed on the host (0 until then)
  int64_t end_mark = 0; // CUDA: mark behind the collective on the device, 0 if none
  FlightState state = FlightState::Issued;
};

struct FlightTicket {
  uint64_t id = 0;
};

class FlightRing {
 public:
  explicit FlightRing(size_t capacity);
  FlightTicket issue(std::string group, std::string uid, std::string op, uint64_t seq, int64_t bytes, int64_t group_size,
                     std::string backend);
  // The collective completed on the host (failed: with an error); `mark`: see above.
  void complete(FlightTicket ticket, bool failed, bool enqueued_only, int64_t mark);
  // The reader found an enqueued CUDA collective's mark done (or failed).
  void settle(uint64_t id, bool failed);
  // Every entry held, oldest first.
  std::vector<FlightEntry> snapshot() const;
  // Empties the ring and sets how many entries it keeps.
  void reset(size_t capacity);
  size_t capacity() const;

 private:
  mutable std::mutex mu_;
  std::vector<FlightEntry> slots_;
  uint64_t next_id_ = 1;
};

// The rank's ring (one process is one rank; every group's backend writes here).
FlightRing& flight_ring();

// Watches `work` (the inner backend's) and completes `ticket` when it completes; returns
// the Work to hand on (wrapped when only its wait() can tell).
c10::intrusive_ptr<c10d::Work> flight_watch(
    c10::intrusive_ptr<c10d::Work> work,
    FlightTicket ticket,
    const at::Device& device);

// Adds flight_snapshot / flight_settle / flight_reset / flight_capacity (called from bindings.cpp).
void bind_flight(pybind11::module_& m);

} // namespace wbt
