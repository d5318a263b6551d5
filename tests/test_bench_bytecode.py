"""benches/bytecode.py: the startup benches refuse to measure where torch would be compiled from source."""

from __future__ import annotations

import importlib.util
import py_compile
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def _bytecode_module():
    spec = importlib.util.spec_from_file_location("bench_bytecode", BENCHES / "bytecode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_probe_module_without_bytecode_is_named_until_it_is_compiled(tmp_path):
    bytecode = _bytecode_module()
    for probe in bytecode.PROBES:
        (tmp_path / probe).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / probe).write_text("x = 1\n")
    assert bytecode.missing_bytecode(tmp_path) == list(bytecode.PROBES)
    py_compile.compile(str(tmp_path / bytecode.PROBES[0]), doraise=True)
    assert bytecode.missing_bytecode(tmp_path) == list(bytecode.PROBES[1:])
    for probe in bytecode.PROBES[1:]:
        py_compile.compile(str(tmp_path / probe), doraise=True)
    assert bytecode.missing_bytecode(tmp_path) == []


def test_a_module_not_installed_is_not_reported(tmp_path):
    assert _bytecode_module().missing_bytecode(tmp_path) == []


def test_require_compiled_exits_naming_the_make_target(tmp_path, monkeypatch):
    bytecode = _bytecode_module()
    monkeypatch.setattr(bytecode, "missing_bytecode", lambda: ["torch/__init__.py"])
    with pytest.raises(SystemExit) as stop:
        bytecode.require_compiled("benches/first_cell.py")
    assert "make .venv/.compiled" in str(stop.value) and "torch/__init__.py" in str(stop.value)
