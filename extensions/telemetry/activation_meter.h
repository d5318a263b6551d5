// The bytes autograd saves for backward, counted live by a pair of saved-tensor hooks
// (workbench.telemetry.activations.ActivationMeter is the Python face).
//
// Why native: autograd calls the pack hook for every tensor it saves (~180 a forward of
// the tiny model) and the unpack hook again in backward. Written in Python, the hooks'
// bodies cost ~7 us a tensor on top of autograd's own ~5 us, over 1% of a small step;
// here the common case (a plain tensor) never enters the interpreter.
//
// What counts: each storage once however many ops save it (views, wrappers), not a
// leaf that requires grad (a parameter, a pipeline stage's receive buffer) nor a view
// of one, not the model's buffers (`ignored`). The meter keeps only a detached alias of
// each saved tensor: an op's own output carries that op's grad_fn, which owns the packed
// object, a cycle through C++ that Python's gc cannot see (a graph dropped without
// backward would hold its saved tensors for ever). Wrapper subclasses (DTensor, an async
// collective's result) own no storage: the Python `wrapper_pack` looks through them and
// hands back (alias, storage address, bytes) for this meter to count.

#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace wbt {

struct MeterCounts {
  std::unordered_map<uintptr_t, std::pair<int64_t, int64_t>> refs; // storage -> (saves, bytes)
  std::unordered_set<uintptr_t> ignored;
  int64_t live = 0;
  int64_t peak = 0;

  void add(uintptr_t storage, int64_t bytes);
  void release(uintptr_t storage);
};

// What autograd keeps instead of a counted tensor; its bytes are released when autograd
// drops it (the graph freed, by backward or by going out of scope).
class SavedActivation {
 public:
  SavedActivation(at::Tensor tensor, pybind11::object wrapper, uintptr_t storage,
                  std::shared_ptr<MeterCounts> counts);
  SavedActivation(SavedActivation&&) noexcept = default;
  SavedActivation(const SavedActivation&) = delete;
  ~SavedActivation();
  pybind11::object unpack() const;

 private:
  at::Tensor tensor_;
  pybind11::object wrapper_; // set for wrapper subclasses: the Python object to hand back
  uintptr_t storage_;
  std::shared_ptr<MeterCounts> counts_;
};

class ActivationMeter {
 public:
  ActivationMeter(const std::vector<uintptr_t>& ignored, pybind11::object wrapper_pack);
  pybind11::object pack(pybind11::handle tensor);
  static pybind11::object unpack(pybind11::handle saved);
  int64_t live() const { return counts_->live; }
  int64_t peak() const { return counts_->peak; }
  void reset_peak() { counts_->peak = counts_->live; }

 private:
  pybind11::object track(pybind11::object alias, uintptr_t storage, int64_t bytes, bool wrapper);

  std::shared_ptr<MeterCounts> counts_;
  pybind11::object wrapper_pack_; // a module-level function: holding a bound method would make a cycle gc cannot see
};

void bind_activation_meter(pybind11::module_& m);

} // namespace wbt
