// Saved-tensor hooks that count activation bytes live; see activation_meter.h.
// Every call comes from autograd with the GIL held (pack in forward, unpack in backward,
// release when the graph drops a saved tensor), so the counts need no lock of their own.

#include "activation_meter.h"

#include <torch/csrc/autograd/python_variable.h>

namespace py = pybind11;

namespace wbt {

void MeterCounts::add(uintptr_t storage, int64_t bytes) {
  auto [it, fresh] = refs.try_emplace(storage, 0, bytes);
  if (fresh) {
    live += bytes;
    peak = std::max(peak, live);
  }
  ++it->second.first;
}

void MeterCounts::release(uintptr_t storage) {
  auto it = refs.find(storage);
  if (it == refs.end()) {
    return;
  }
  if (--it->second.first == 0) {
    live -= it->second.second;
    refs.erase(it);
  }
}

SavedActivation::SavedActivation(at::Tensor tensor, py::object wrapper, uintptr_t storage,
                                 std::shared_ptr<MeterCounts> counts)
    : tensor_(std::move(tensor)), wrapper_(std::move(wrapper)), storage_(storage), counts_(std::move(counts)) {}

SavedActivation::~SavedActivation() {
  if (counts_) { // a moved-from object counts nothing
    counts_->release(storage_);
  }
}

py::object SavedActivation::unpack() const {
  return wrapper_ ? wrapper_ : py::cast(tensor_);
}

ActivationMeter::ActivationMeter(const std::vector<uintptr_t>& ignored, py::object wrapper_pack)
    : counts_(std::make_shared<MeterCounts>()), wrapper_pack_(std::move(wrapper_pack)) {
  counts_->ignored.insert(ignored.begin(), ignored.end());
}

py::object ActivationMeter::track(py::object alias, uintptr_t storage, int64_t bytes, bool wrapper) {
  if (bytes == 0 || counts_->ignored.count(storage)) {
    return alias;
  }
  counts_->add(storage, bytes);
  at::Tensor tensor = wrapper ? at::Tensor() : THPVariable_Unpack(alias.ptr());
  return py::cast(SavedActivation(std::move(tensor), wrapper ? std::move(alias) : py::object(), storage, counts_));
}

py::object ActivationMeter::pack(py::handle obj) {
  if (!THPVariable_Check(obj.ptr())) {
    return py::reinterpret_borrow<py::object>(obj);
  }
  const at::Tensor& t = THPVariable_Unpack(obj.ptr());
  if (t.key_set().has(c10::DispatchKey::Python) || !t.has_storage()) {
    // A wrapper subclass, or a tensor without storage of its own: Python knows how to look through it.
    py::object r = wrapper_pack_(obj);
    if (!py::isinstance<py::tuple>(r)) {
      return r; // not an activation: saved as it is
    }
    auto found = r.cast<py::tuple>();
    return track(found[0], found[1].cast<uintptr_t>(), found[2].cast<int64_t>(), true);
  }
  const at::TensorBase& base = t.is_view() ? t._base() : static_cast<const at::TensorBase&>(t);
  if (base.is_leaf() && base.requires_grad()) {
    return py::reinterpret_borrow<py::object>(obj); // a parameter or a view of one, not an activation
  }
  at::Tensor alias = t.detach();
  const c10::Storage& storage = alias.storage();
  const auto address = reinterpret_cast<uintptr_t>(storage.data());
  const auto bytes = static_cast<int64_t>(storage.nbytes());
  if (bytes == 0 || counts_->ignored.count(address)) {
    return py::cast(alias);
  }
  counts_->add(address, bytes);
  return py::cast(SavedActivation(std::move(alias), py::object(), address, counts_));
}

py::object ActivationMeter::unpack(py::handle saved) {
  if (py::isinstance<SavedActivation>(saved)) {
    return saved.cast<const SavedActivation&>().unpack();
  }
  return py::reinterpret_borrow<py::object>(saved);
}

void bind_activation_meter(py::module_& m) {
  py::class_<SavedActivation>(m, "SavedActivation");
  py::class_<ActivationMeter>(m, "ActivationMeter")
      .def(py::init<const std::vector<uintptr_t>&, py::object>(), py::arg("ignored"), py::arg("wrapper_pack"))
      .def("pack", &ActivationMeter::pack)
      .def_static("unpack", &ActivationMeter::unpack)
      .def_property_readonly("live", &ActivationMeter::live)
      .def_property_readonly("peak", &ActivationMeter::peak)
      .def("reset_peak", &ActivationMeter::reset_peak);
}

} // namespace wbt
