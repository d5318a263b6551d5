"""`make test`'s parts: each test in one of them, the run's result from all."""

import pytest

from tests.run_suite import BESIDE, FOREGROUND, NO_TESTS_COLLECTED, _arguments, _codes, _combined


def test_the_run_fails_if_any_part_fails_and_is_empty_only_if_all_are():
    assert _combined([0, 0, 0]) == 0
    assert _combined([1, 0, 0]) == 1 and _combined([0, 1, 0]) == 1 and _combined([0, 0, 2]) == 2
    assert _combined([0, NO_TESTS_COLLECTED, 0]) == 0 and _combined([NO_TESTS_COLLECTED, 0, 0]) == 0
    assert _combined([NO_TESTS_COLLECTED, 2, NO_TESTS_COLLECTED]) == 2
    assert _combined([NO_TESTS_COLLECTED] * 3) == NO_TESTS_COLLECTED


def test_every_part_beside_the_foreground_writes_its_own_junit_report():
    args = ["-q", "--junitxml=out/run.xml", "--durations=30"]
    assert _arguments(args, FOREGROUND.label) == args
    assert [_arguments(args, p.label)[1] for p in BESIDE] == ["--junitxml=out/run-pure.xml",
                                                              "--junitxml=out/run-waits.xml"]


def test_the_parts_markers_take_every_test_once():
    # A test is pure or starts processes; one that does either mostly waits or not: three disjoint sets.
    sets = {p.markers for p in (FOREGROUND, *BESIDE)}
    assert sets == {"processes and not mostly_waits", "not processes", "processes and mostly_waits"}


def test_a_stream_that_did_not_finish_counts_as_failed():
    assert _codes("...\nexit codes: 0 5") == [0, 5]
    assert _codes("...\n= 3 passed in 1.0s =") == [1]


def test_busy_cores_and_idle_time_per_file_are_what_the_samples_say():
    from tests.core_use import busy_cores, by_file

    # 2 cores, 200 jiffies elapsed, 50 of them idle: 1.5 cores busy.
    assert busy_cores((1000, 400), (1200, 450), 2) == 1.5
    assert busy_cores((1000, 400), (1000, 400), 2) == 0.0
    rows = [("tests/a.py::x", 10.0, 2.0), ("tests/a.py::y", 10.0, 1.0), ("tests/b.py::z", 4.0, 0.5)]
    assert by_file(rows, 2) == [("tests/a.py", 20.0, 1.5, 10.0), ("tests/b.py", 4.0, 0.5, 6.0)]


@pytest.mark.processes
def test_the_parts_beside_run_one_after_another_with_the_arguments_as_given(tmp_path):
    import tempfile

    from tests.run_suite import _beside

    with tempfile.TemporaryFile("w+") as log:
        # --version: each part's pytest starts, reads its arguments (quoted for the shell) and exits at once.
        stream = _beside(["-k", "a or $(echo the shell ran this >&2)'s", "--version"], log)
        assert stream.wait(timeout=120) == 0
        log.seek(0)
        report = log.read()
    assert _codes(report) == [0, 0], report
    assert "the shell ran this" not in report, "an argument reached the shell unquoted"
    assert report.index('-m "not processes"') < report.index('-m "processes and mostly_waits"')


def test_the_parts_write_bytecode_whatever_the_callers_environment_says(monkeypatch):
    from tests.run_suite import _environment

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = _environment()
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["OMP_NUM_THREADS"] == "1"
