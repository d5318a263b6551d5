// The per-rank ring of recent collectives; see flight_recorder.h.

#include "flight_recorder.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/utils/pybind.h>

#include "clock.h"
#include "completion.h"
#include "recorded_work.h"
#include "torch_handles.h"

namespace wbt {

namespace {

constexpr size_t kDefaultCapacity = 256; // ~40 KB: several steps of a small layout's collectives

const char* state_name(FlightState s) {
  switch (s) {
    case FlightState::Issued:
      return "issued";
    case FlightState::Enqueued:
      return "enqueued";
    case FlightState::Done:
      return "done";
    case FlightState::Failed:
      return "failed";
  }
  return "issued";
}

} // namespace

FlightRing::FlightRing(size_t capacity) : slots_(std::max<size_t>(capacity, 1)) {}

FlightTicket FlightRing::issue(std::string group, std::string uid, std::string op, uint64_t seq, int64_t bytes,
                               int64_t group_size, std::string backend) {
  FlightEntry e;
  e.group = std::move(group);
  e.uid = std::move(uid);
  e.op = std::move(op);
  e.seq = seq;
  e.bytes = bytes;
  e.group_size = group_size;
  e.backend = std::move(backend);
  e.start_ns = now_ns();
  int64_t stale_mark = 0;
  FlightTicket ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    e.id = ticket.id = next_id_++;
    FlightEntry& slot = slots_[(e.id - 1) % slots_.size()];
    stale_mark = slot.end_mark; // an unread CUDA mark of the entry this one replaces
    slot = std::move(e);
  }
  cuda_release_mark(stale_mark);
  return ticket;
}

void FlightRing::complete(FlightTicket ticket, bool failed, bool enqueued_only, int64_t mark) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    FlightEntry& slot = slots_[(ticket.id - 1) % slots_.size()];
    if (slot.id == ticket.id) {
      slot.end_ns = now_ns();
      slot.state = failed ? FlightState::Failed : enqueued_only ? FlightState::Enqueued : FlightState::Done;
      slot.end_mark = mark;
      return;
    }
  }
  cuda_release_mark(mark); // the entry was overwritten meanwhile: nobody will read the mark
}

void FlightRing::settle(uint64_t id, bool failed) {
  std::lock_guard<std::mutex> lock(mu_);
  FlightEntry& slot = slots_[(id - 1) % slots_.size()];
  if (slot.id == id && slot.state == FlightState::Enqueued) {
    slot.state = failed ? FlightState::Failed : FlightState::Done;
    slot.end_mark = 0; // the reader's read released it
  }
}

std::vector<FlightEntry> FlightRing::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightEntry> out;
  out.reserve(slots_.size());
  const size_t n = slots_.size();
  const size_t first = (next_id_ - 1) % n; // the oldest slot, once the ring has wrapped
  for (size_t i = 0; i < n; ++i) {
    const FlightEntry& e = slots_[(first + i) % n];
    if (e.id != 0) {
      out.push_back(e);
    }
  }
  return out;
}

void FlightRing::reset(size_t capacity) {
  std::vector<int64_t> marks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& e : slots_) {
      if (e.end_mark != 0) {
        marks.push_back(e.end_mark);
      }
    }
    slots_.assign(std::max<size_t>(capacity, 1), FlightEntry{});
  }
  for (int64_t m : marks) {
    cuda_release_mark(m);
  }
}

size_t FlightRing::capacity() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slots_.size();
}

FlightRing& flight_ring() {
  static FlightRing ring(kDefaultCapacity);
  return ring;
}

c10::intrusive_ptr<c10d::Work> flight_watch(
    c10::intrusive_ptr<c10d::Work> work,
    FlightTicket ticket,
    const at::Device& device) {
  if (!work || ticket.id == 0) {
    return work;
  }
  const auto fut = future_of(work);
  if (!fut) { // wait() says when it is done
    return c10::make_intrusive<RecordedWork>(std::move(work), nullptr, std::nullopt, nullptr, ticket);
  }
  const bool cuda = device.is_cuda();
  // Captures no Work (a future owning its Work back would never be freed). On CUDA,
  // uses_future=true runs it on a stream made to wait for the collective, so a mark
  // recorded there is done when the collective is, on the device.
  fut->addCallback(
      [ticket, cuda, device](c10::ivalue::Future& f) {
        const bool failed = f.hasError();
        const int64_t mark = cuda && !failed ? cuda_mark_now(device) : 0;
        flight_ring().complete(ticket, failed, cuda, mark);
      },
      /*uses_future=*/cuda);
  return work;
}

void bind_flight(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("flight_snapshot", [] {
    std::vector<FlightEntry> entries;
    {
      py::gil_scoped_release nogil; // the lock is held by communication threads too
      entries = flight_ring().snapshot();
    }
    py::list out(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      const auto& e = entries[i];
      out[i] = py::make_tuple(e.id, e.group, e.uid, e.op, e.seq, e.bytes, e.group_size, e.backend, e.start_ns,
                              e.end_ns, state_name(e.state), e.end_mark);
    }
    return out;
  });
  m.def("flight_settle", [](uint64_t id, bool failed) { flight_ring().settle(id, failed); },
        py::arg("id"), py::arg("failed"));
  m.def("flight_reset", [](size_t capacity) { flight_ring().reset(capacity); }, py::arg("capacity"));
  m.def("flight_capacity", [] { return flight_ring().capacity(); });
}

} // namespace wbt
