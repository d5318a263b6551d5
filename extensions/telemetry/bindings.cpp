// Python bindings. Names here are private to workbench.telemetry.native,
// which is the public face; keep this file to conversions only.

#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include <pybind11/stl.h>

#include "clock.h"
#include "completion.h"
#include "crash_frames.h"
#include "emulation.h"
#include "emulation_model.h"
#include "emulation_works.h"
#include "flight_recorder.h"
#include "quantize.h"
#include "recorder.h"
#include "recording_backend.h"

namespace py = pybind11;
namespace emu = wbt::emulation;

namespace {

wbt::Kind parse_kind(const std::string& kind) {
  if (kind == "compute") {
    return wbt::Kind::Compute;
  }
  if (kind == "comm") {
    return wbt::Kind::Comm;
  }
  if (kind == "wait") {
    return wbt::Kind::Wait;
  }
  throw py::value_error("kind must be \"compute\", \"comm\" or \"wait\", got \"" + kind + "\"");
}

py::list drain(wbt::Recorder& r) {
  // Copy out under the recorder's lock, then build Python objects without
  // it, so communication threads are never held up by Python allocation.
  const auto records = r.drain();
  py::list out(records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    const auto& x = records[i];
    out[i] = py::make_tuple(
        x.kind == wbt::Kind::Comm ? "comm" : x.kind == wbt::Kind::Wait ? "wait" : "compute",
        x.name,
        x.start_ns,
        x.end_ns,
        x.bytes,
        x.group_size,
        x.stream,
        x.group,
        x.start_mark,
        x.end_mark,
        x.queue);
  }
  return out;
}

c10::intrusive_ptr<c10d::Backend> optional_backend(const py::object& obj) {
  if (obj.is_none()) {
    return {};
  }
  return obj.cast<c10::intrusive_ptr<c10d::Backend>>();
}

using PyLines = std::vector<std::pair<double, double>>;

emu::Lines to_lines(const PyLines& in) {
  emu::Lines out;
  for (const auto& [latency, per_byte] : in) {
    out.lines.push_back({latency, per_byte});
  }
  return out;
}

// The emulation (workbench.emulation.rank): a group's lines, the dilation, the CUDA pacer.
void bind_emulation(py::module_& m) {
  m.def(
      "emulation_set_group",
      [](const std::string& uid,
         const std::unordered_map<std::string, PyLines>& target,
         const std::vector<PyLines>& peers,
         const std::unordered_map<std::string, PyLines>& real,
         int me,
         const std::string& arrivals,
         size_t offset) {
        auto model = std::make_shared<emu::GroupModel>();
        const int n = static_cast<int>(peers.size());
        model->me = me;
        if (!arrivals.empty()) {
          model->arrivals = std::make_shared<emu::Arrivals>(arrivals, offset, n, me);
        }
        for (const auto& [kind, lines] : target) {
          model->target[kind] = to_lines(lines);
        }
        for (const auto& lines : peers) {
          model->peers.push_back(to_lines(lines));
        }
        for (const auto& [kind, lines] : real) {
          model->real[kind] = to_lines(lines);
        }
        emu::set_group(uid, std::move(model));
      },
      py::arg("uid"),
      py::arg("target"),
      py::arg("peers"),
      py::arg("real"),
      py::arg("me"),
      py::arg("arrivals") = "",
      py::arg("offset") = 0);
  m.def("emulation_arrivals_bytes", [](int n) { return emu::Arrivals::bytes_for(n); }, py::arg("group_size"));
  m.def("emulation_clear", &emu::clear_groups);
  m.def("emulation_set_dilation", &emu::set_dilation, py::arg("dilation"));
  m.def("emulation_dilation", &emu::dilation);
  m.def("emulation_on", &wbt::emulation_on);
  m.def("emulation_groups", &emu::group_uids);
  // (collectives paced, of which the real transfer outlasted the emulated time)
  m.def("emulation_counts", [] {
    const auto [paced, overruns] = emu::counts();
    return py::make_tuple(paced, overruns);
  });
  m.def(
      "emulation_set_cuda_pacer",
      [](uintptr_t stamp, uintptr_t hold) {
        emu::set_cuda_pacer(reinterpret_cast<emu::CudaStartStamp>(stamp), reinterpret_cast<emu::CudaHold>(hold));
      },
      py::arg("stamp"),
      py::arg("hold"));
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("now_ns", &wbt::now_ns);
  m.def("install_crash_frames", &wbt::install_crash_frames);

  py::class_<wbt::Recorder, std::shared_ptr<wbt::Recorder>>(m, "Recorder")
      .def(py::init<size_t>(), py::arg("capacity") = size_t{1} << 17)
      .def(
          "begin",
          [](wbt::Recorder& r, const std::string& kind, std::string name, std::string stream) {
            return r.begin(parse_kind(kind), std::move(name), std::move(stream));
          },
          py::arg("kind"),
          py::arg("name"),
          py::arg("stream") = "main")
      .def("end", &wbt::Recorder::end, py::arg("token"))
      .def("drain", &drain)
      .def("set_enabled", &wbt::Recorder::set_enabled)
      .def_property_readonly("enabled", &wbt::Recorder::enabled)
      .def_property_readonly("open_count", &wbt::Recorder::open_count)
      .def_property_readonly("dropped", &wbt::Recorder::dropped);
  m.def("recorder", [] { return wbt::global_recorder(); });

  m.def(
      "recording_backend",
      [](int rank, int size, const py::object& cpu, const py::object& cuda, std::string group_name) {
        return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<wbt::RecordingBackend>(
            rank, size, optional_backend(cpu), optional_backend(cuda),
            std::move(group_name), wbt::global_recorder()));
      },
      py::arg("rank"),
      py::arg("size"),
      py::arg("cpu"),
      py::arg("cuda"),
      py::arg("group_name") = "");
  m.def("is_recording_backend", [](const c10::intrusive_ptr<c10d::Backend>& b) {
    return dynamic_cast<wbt::RecordingBackend*>(b.get()) != nullptr;
  });
  m.def(
      "set_cuda_marker",
      [](uintptr_t mark, uintptr_t release) {
        wbt::set_cuda_marker(
            reinterpret_cast<wbt::CudaMarker>(mark), reinterpret_cast<wbt::CudaMarkRelease>(release));
      },
      py::arg("mark"),
      py::arg("release"));
  m.def("has_cuda_marker", &wbt::has_cuda_marker);
  m.def("unstamped_cuda_ops", &wbt::unstamped_cuda_ops);
  m.def("delay_cpu_stamps", &wbt::delay_cpu_stamps, py::arg("ns"));

  wbt::bind_quantize(m);
  bind_emulation(m);
  wbt::bind_flight(m);
}
