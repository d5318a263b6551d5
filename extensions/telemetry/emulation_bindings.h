#pragma once

// The emulation's Python functions (emulation.cpp), added to the extension module by bindings.cpp.

#include <pybind11/pybind11.h>

namespace wbt {

void bind_emulation(pybind11::module_& m);

} // namespace wbt
