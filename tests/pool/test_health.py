"""The health verdict as a pure function: made-up rank states and times, no processes."""

from __future__ import annotations

import pytest

from workbench.pool import health
from workbench.pool.commands import Command
from workbench.pool.errors import CollectiveTimeout, RankFrozen, RemoteError, WorkerDied
from workbench.pool.health import AskWhere, Broken, Healthy, Limits, ProcessSample, Waiting
from workbench.pool.roster import RankState

LIMITS = Limits(timeout_s=30.0, heartbeat_timeout_s=10.0, frozen_after_s=2.0)
NOW = 1000.0


def rank(r: int, *, local: bool = True, heartbeat_ago: float = 0.1, cpu_rate: float = 0.0, busy_with: int | None = None,
         active_ago: float = 0.0) -> RankState:
    """A rank whose heartbeats came every 0.25 s until `heartbeat_ago` seconds before NOW, using `cpu_rate` cores."""
    state = RankState(r, "inc", f"r{r}:inc:main".encode(), 100 + r, "host", local=local, io_id=f"r{r}:inc:io".encode())
    last = NOW - heartbeat_ago
    state.last_heartbeat, state.last_activity = last, NOW - active_ago
    for i in range(8, -1, -1):
        t = last - 0.25 * i
        state.cpu.append((t, 5.0 + cpu_rate * (t - NOW)))
    if busy_with is not None:
        state.outstanding.append(busy_with)
    return state


def judge(ranks, *, exits=None, samples=None, commands=(), now=NOW, asked_at=None, explain=None):
    return health.judge({s.rank: s for s in ranks}, exits or {}, samples or {}, list(commands), now, LIMITS,
                        asked_at, explain)


def test_healthy_ranks_are_healthy_whether_idle_or_busy():
    assert judge([rank(0), rank(1, cpu_rate=1.0, busy_with=1, active_ago=5.0)]) == Healthy()


def test_an_exit_code_is_a_dead_rank_at_once():
    verdict = judge([rank(0), rank(1)], exits={0: None, 1: -9})
    assert isinstance(verdict, Broken) and isinstance(verdict.error, WorkerDied)
    assert verdict.error.rank == 1 and verdict.error.signal == "SIGKILL"


def test_a_closed_connection_is_death_for_a_remote_rank_at_once_and_for_a_local_one_after_the_grace():
    remote = rank(0, local=False)
    remote.disconnected_at = NOW - 0.01
    assert isinstance(judge([remote]), Broken)
    local = rank(0)
    local.disconnected_at = NOW - 0.01
    assert judge([local]) == Healthy(), "its exit code may still come: wait for it"
    local.disconnected_at = NOW - LIMITS.disconnect_grace_s - 0.1
    assert "connection" in str(judge([local]).error)


def test_a_remote_rank_silent_past_the_heartbeat_timeout_is_dead():
    assert judge([rank(0, local=False, heartbeat_ago=9.0)]) == Healthy()
    verdict = judge([rank(0, local=False, heartbeat_ago=11.0)])
    assert isinstance(verdict.error, WorkerDied) and "no heartbeat for 11.0 s" in str(verdict.error)


def test_only_silent_local_ranks_are_sampled():
    ranks = {0: rank(0, heartbeat_ago=2.5), 1: rank(1), 2: rank(2, local=False, heartbeat_ago=2.5)}
    assert health.silent(ranks, NOW, LIMITS) == [0]


def test_a_stopped_process_is_frozen_after_the_others_were_asked_where_they_are():
    frozen, waiting = rank(1, heartbeat_ago=2.5, busy_with=7, active_ago=2.5), rank(0, busy_with=7, active_ago=2.5)
    samples = {1: ProcessSample("T", cpu_s=5.0)}
    command = Command(7, {0, 1}, "train", sent_at=NOW - 4.0)
    first = judge([waiting, frozen], samples=samples, commands=[command])
    assert first == AskWhere((0, 1))
    assert judge([waiting, frozen], samples=samples, commands=[command], asked_at=NOW - 0.1) == Waiting()
    waiting.stack = '  File "x.py", line 3, in train\n    dist.all_reduce(t)\n'
    waiting.diagnostics = {"collectives": "all_reduce #12 of dp, waiting"}
    verdict = judge([waiting, frozen], samples=samples, commands=[command], asked_at=NOW - 0.1,
                    explain=lambda d: f"explained {sorted(d)}")
    assert isinstance(verdict, Broken) and isinstance(verdict.error, RankFrozen)
    message = str(verdict.error)
    assert verdict.error.rank == 1 and "rank 1" in message and "stopped" in message
    assert "train" in message and "4.0 s" in message, "what the frozen rank was doing"
    assert "dist.all_reduce(t)" in message and "all_reduce #12 of dp, waiting" in message, "what the others do"
    assert "explained [0]" in message
    assert verdict.error.diagnostics == {0: {"collectives": "all_reduce #12 of dp, waiting"}}


def test_an_asleep_process_that_uses_no_cpu_is_frozen_but_one_that_computes_is_not():
    silent = rank(1, heartbeat_ago=2.5)
    asleep = {1: ProcessSample("S", cpu_s=5.0)}  # no CPU since its last heartbeat
    assert judge([rank(0), silent], samples=asleep) == AskWhere((0, 1))
    holding_the_gil = {1: ProcessSample("R", cpu_s=7.4)}  # C code holding the GIL: heartbeats blocked, CPU busy
    assert judge([rank(0), silent], samples=holding_the_gil) == Healthy()
    asleep_but_computed = {1: ProcessSample("S", cpu_s=7.0)}
    assert judge([rank(0), silent], samples=asleep_but_computed) == Healthy()
    in_io = {1: ProcessSample("D", cpu_s=5.0)}  # e.g. reading a file from a slow disk
    assert judge([rank(0), silent], samples=in_io) == Healthy()


def test_a_suspect_whose_heartbeat_returns_is_not_frozen():
    answered = rank(1)  # it was silent when asked; its heartbeat has come since
    assert judge([rank(0), answered], samples={}, asked_at=NOW - 0.6) == Healthy()


def test_a_local_rank_without_process_information_is_judged_by_the_heartbeat_timeout():
    assert judge([rank(0), rank(1, heartbeat_ago=5.0)]) == Healthy()
    assert judge([rank(0), rank(1, heartbeat_ago=11.0)]) == AskWhere((0, 1))


def test_a_rank_stuck_in_a_collective_is_reported_at_the_timeout_with_where_it_is():
    stuck = [rank(0, busy_with=3, active_ago=31.0), rank(1, busy_with=3, active_ago=31.0, cpu_rate=1.0)]
    assert judge([rank(0, busy_with=3, active_ago=29.0), rank(1, busy_with=3, active_ago=29.0)]) == Healthy()
    assert judge(stuck) == AskWhere((0, 1))
    assert judge(stuck, asked_at=NOW - 0.1) == Waiting()
    stuck[0].stack, stuck[1].stack = "in barrier\n", "in matmul\n"
    stuck[0].diagnostics = {"collectives": "barrier #3"}
    verdict = judge(stuck, asked_at=NOW - 0.1)
    assert isinstance(verdict.error, CollectiveTimeout)
    assert verdict.error.rank == 1, "the busy rank is the likely culprit; the other waits for it"
    assert verdict.error.ranks == [0, 1]
    message = str(verdict.error)
    assert "rank 0: waiting" in message and "barrier #3" in message and "rank 1: busy" in message
    assert verdict.error.diagnostics == {0: {"collectives": "barrier #3"}}


def test_unanswered_questions_do_not_hold_the_verdict_for_ever():
    stuck = [rank(0, busy_with=3, active_ago=31.0)]
    verdict = judge(stuck, asked_at=NOW - LIMITS.answer_s - 0.01)
    assert isinstance(verdict.error, CollectiveTimeout) and "no stack received" in str(verdict.error)


def test_ranks_left_waiting_for_a_failed_one_break_the_pool_after_the_grace():
    command = Command(5, {0}, "step")
    command.errors[1] = {"exc_type": "ValueError", "message": "bad", "traceback": "tb"}
    command.first_error_at = NOW - 0.5
    waiting = rank(0, busy_with=5)
    assert judge([waiting, rank(1)], commands=[command]) == Healthy()
    command.first_error_at = NOW - 1.5
    verdict = judge([waiting, rank(1)], commands=[command])
    assert isinstance(verdict.error, RemoteError) and verdict.error.rank == 1 and "left waiting" in str(verdict.error)
    working = rank(0, busy_with=5, cpu_rate=1.0)
    assert judge([working, rank(1)], commands=[command]) == Healthy(), "still computing: it may yet finish"


@pytest.mark.parametrize("state, stopped", [("T", True), ("t", True), ("S", False), ("R", False)])
def test_process_sample_states(state, stopped):
    assert ProcessSample(state, 0.0).stopped is stopped
