"""`make test`'s parts: each test in one of them, the run's result from all."""

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
