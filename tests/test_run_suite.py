"""`make test`'s two halves: each test in one of them, the run's result from both."""

from tests.run_suite import NO_TESTS_COLLECTED, _combined, _pure_arguments


def test_the_run_fails_if_either_half_fails_and_is_empty_only_if_both_are():
    assert _combined([0, 0]) == 0
    assert _combined([1, 0]) == 1 and _combined([0, 1]) == 1
    assert _combined([0, NO_TESTS_COLLECTED]) == 0 and _combined([NO_TESTS_COLLECTED, 0]) == 0
    assert _combined([NO_TESTS_COLLECTED, 2]) == 2
    assert _combined([NO_TESTS_COLLECTED, NO_TESTS_COLLECTED]) == NO_TESTS_COLLECTED


def test_the_pure_half_writes_its_own_junit_report():
    assert _pure_arguments(["-q", "--junitxml=out/run.xml", "--durations=30"]) == [
        "-q", "--junitxml=out/run-pure.xml", "--durations=30"]
