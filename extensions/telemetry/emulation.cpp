// The emulation's entry points from the recording backend; see emulation.h.
// The model is in emulation_model.*, the shared arrivals in emulation_arrivals.*,
// the timer in emulation_pacer.*, the paced Works in emulation_works.*.

#include "emulation.h"

#include "clock.h"
#include "emulation_model.h"
#include "emulation_works.h"

namespace wbt {

namespace {

using emulation::Cost;
using emulation::Start;

c10::intrusive_ptr<c10d::Work> pace(
    c10::intrusive_ptr<c10d::Work> work,
    Start start,
    int64_t cuda_slot,
    const Cost& c,
    const at::Device& device) {
  if (!work) {
    return work;
  }
  emulation::count_paced();
  if (device.is_cuda()) {
    return emulation::paced_cuda(std::move(work), device, cuda_slot, c.real_ns, c.target_ns);
  }
  return emulation::paced_cpu(std::move(work), std::move(start), c.target_ns);
}

} // namespace

bool emulation_on() {
  return emulation::on();
}

IssueFn emulated(
    const IssueFn& issue,
    const std::string& uid,
    const char* op,
    int64_t bytes,
    int peer,
    const at::Device& device) {
  const Cost c = emulation::cost_of(uid, op, bytes, peer);
  if (!c.paced) {
    return issue;
  }
  return [issue, c, device](c10d::Backend& backend) {
    // On CUDA the start is a GPU-clock stamp on the caller's stream, which the
    // collective's stream waits for: the moment it could start.
    const int64_t slot = device.is_cuda() ? emulation::cuda_stamp(device) : 0;
    Start start = emulation::arrive(c, now_ns());
    return pace(issue(backend), std::move(start), slot, c, device);
  };
}

c10::intrusive_ptr<c10d::Work> emulated_batch(
    c10::intrusive_ptr<c10d::Work> work,
    const std::string& uid,
    const std::string& op,
    int64_t bytes,
    int64_t start_ns,
    const at::Device& device) {
  if (!emulation_on()) {
    return work;
  }
  const Cost c = emulation::cost_of(uid, op, bytes, -1);
  if (!c.paced) {
    return work;
  }
  // A batch's start was not stamped on the GPU: its hold counts from when the batch is done.
  const int64_t slot = device.is_cuda() ? emulation::cuda_stamp(device) : 0;
  Start start; // a batch's peers are several: its start is estimated, not read
  start.own_ns = start_ns;
  start.real_ns = c.real_ns;
  return pace(std::move(work), std::move(start), slot, c, device);
}

} // namespace wbt
