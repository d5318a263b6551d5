#pragma once

// Emulated links (workbench.emulation): every collective of a group the
// emulation knows completes no earlier than the emulated cluster would
// finish it, scaled by the time dilation (this machine's time for the step's
// FLOPs over the target GPU's). The data still moves for real, through the
// inner gloo/NCCL backend; only the moment the Work reports completion moves.
//
// The target time of a collective is the lowest of a few lines, latency +
// bytes × seconds_per_byte (workbench/links.py computes them per group and
// kind, per peer for send/recv). The completion deadline is
//     max(start, real_end - real_estimate) + dilation × target
// where real_estimate is this machine's own time for the transfer (loopback
// at a measured bandwidth): a collective whose peers arrived late starts
// when the last one did, and that start is its real end less its transfer.
//
// Nothing spins: CPU works complete from one sleeping timer thread
// (condition_variable::wait_until), or in wait() by sleep_until; CUDA works
// hold the consumer's stream with a kernel that waits on the GPU clock
// (extensions/cuda/emulate.cu), never a host thread.

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <functional>
#include <string>

namespace wbt {

using IssueFn = std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&)>;

// Whether any group is emulated now (one relaxed atomic load).
bool emulation_on();

// `issue`, made to return a Work that completes no earlier than the emulated
// cluster would finish `op` of `bytes` on group `uid` (`peer`: the group rank
// at the other end of a send/recv, else -1). Returns `issue` itself when
// emulation is off or the group is not emulated.
IssueFn emulated(
    const IssueFn& issue,
    const std::string& uid,
    const char* op,
    int64_t bytes,
    int peer,
    const at::Device& device);

// The same for a coalesced batch that started at `start_ns` and was just issued.
c10::intrusive_ptr<c10d::Work> emulated_batch(
    c10::intrusive_ptr<c10d::Work> work,
    const std::string& uid,
    const std::string& op,
    int64_t bytes,
    int64_t start_ns,
    const at::Device& device);

} // namespace wbt
