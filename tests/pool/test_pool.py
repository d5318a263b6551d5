"""The pool's contract: results in rank order, state across calls, output, errors."""

from __future__ import annotations

import types

import pytest

import workbench as wb
from tests.pool import rank_fns


pytestmark = pytest.mark.mostly_waits  # make test runs it beside the tests that compute (tests/run_suite.py)


def test_results_come_back_in_rank_order(pool):
    results = pool.run(rank_fns.whoami)
    assert [r[:3] for r in results] == [(0, 2, 0), (1, 2, 1)]
    assert [r[3] for r in results] == pool.pids


def test_state_is_kept_across_calls(pool):
    pool.run(rank_fns.remember, "answer", 42)
    assert pool.run(rank_fns.recall, "answer") == [(42, 0), (42, 1)]


@pytest.mark.smoke
def test_collectives_run_in_the_world(pool):
    assert pool.run(rank_fns.all_reduce_sum, 3) == [6.0, 6.0]


def test_functions_defined_in_a_notebook_cell_run_on_ranks(pool):
    # A notebook cell's code lives in __main__, which ranks cannot import: it must travel by value.
    cell = types.ModuleType("__main__")
    exec("def double(x):\n    import torch.distributed as dist\n    return 2 * x + dist.get_rank()\n"
         "triple = lambda x: 3 * x", cell.__dict__)
    assert pool.run(cell.double, 5) == [10, 11]
    assert pool.run(cell.triple, 2) == [6, 6]
    assert pool.run(lambda: "lambda") == ["lambda", "lambda"]


def test_printed_output_reaches_the_notebook_prefixed_by_rank(pool, capsys):
    pool.run(rank_fns.shout, "hello")
    out, err = capsys.readouterr()
    assert "[rank 0] hello from 0" in out.splitlines()
    assert "[rank 1] hello from 1" in out.splitlines()
    assert "[rank 0] to stderr" in err.splitlines()


def test_a_remote_exception_names_the_rank_and_carries_its_traceback(pool):
    with pytest.raises(wb.RemoteError) as info:
        pool.run(rank_fns.fail_on, 1)
    e = info.value
    assert e.rank == 1 and e.exc_type == "KeyError"
    assert "fail_on" in e.remote_traceback and "the rank that fails" in str(e)
    assert not pool.broken, "a rank that raised alone leaves the world intact"
    assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]


def test_ranks_left_waiting_on_a_failed_rank_are_stopped_quickly(pool):
    import time

    t0 = time.monotonic()
    with pytest.raises(wb.RemoteError) as info:
        pool.run(rank_fns.fail_before_collective, 0)
    assert info.value.rank == 0 and "left waiting" in str(info.value)
    assert time.monotonic() - t0 < 10, "must not wait for the collective timeout"
    assert pool.broken
    pool.restart()
    assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]


def test_mismatched_collectives_never_pass_silently(pool):
    # gloo alone lets the rank with the smaller tensor "succeed"; the pool's check makes both fail at once.
    with pytest.raises(wb.RemoteError) as info:
        pool.run(rank_fns.mismatched_shapes)
    e = info.value
    assert e.exc_type == "CollectiveMismatch"
    assert "rank 0: all_reduce(tensor(4,):float32)" in str(e) and "rank 1: all_reduce(tensor(8,):float32)" in str(e)
    assert not pool.broken, "both ranks refused the collective: the world is intact"
    assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]
    with pytest.raises(wb.RemoteError, match="broadcast"):
        pool.run(rank_fns.mismatched_ops)


def test_torch_ddp_runs_on_the_checked_world_group(pool):
    # torch's DETAIL checker would crash here (DDP segfaults on a wrapped group in torch 2.13)
    loss0, loss1 = pool.run(rank_fns.ddp_step)
    assert loss0 == loss1


def test_async_handles_and_flags(pool):
    handle = pool.run_async(rank_fns.wait_for_flag, "go", 30)
    assert not handle.done()
    pool.set_flag("go", "now")
    assert handle.result(timeout=30) == ["now", "now"]
    assert handle.done()


def test_events_reach_subscribers_in_order(pool):
    seen = []
    unsubscribe = pool.subscribe(lambda r, e: seen.append((r, e["i"])))
    try:
        assert pool.run(rank_fns.emit_events, 5) == [5, 5]
    finally:
        unsubscribe()
    for r in (0, 1):
        assert [i for rr, i in seen if rr == r] == list(range(5))


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="world_size"):
        wb.Pool(0)
    with pytest.raises(ValueError, match="device"):
        wb.Pool(2, device="tpu")


def test_a_call_a_rank_cannot_unpickle_is_an_error_not_a_dead_rank(pool):
    class Unloadable:
        def __reduce__(self):
            return (__import__, ("a_module_that_does_not_exist",))

    with pytest.raises(wb.RemoteError, match="a_module_that_does_not_exist"):
        pool.run(print, Unloadable())
    assert not pool.broken
    assert pool.run(rank_fns.all_reduce_sum, 1) == [2.0, 2.0]


def test_a_scatter_whose_list_only_the_root_holds_is_not_a_mismatch(pool):
    assert pool.run(rank_fns.scatter_from_zero) == [[0.0, 0.0], [1.0, 1.0]]


def test_thousands_of_commands_in_flight_all_complete_in_order(pool):
    # Far more than fit in a socket buffer at once: sends must queue, never block the notebook or drop a command.
    handles = [pool.run_async(abs, -i) for i in range(2500)]
    assert [h.result(timeout=120) for h in handles] == [[i, i] for i in range(2500)]


def test_large_arguments_and_results_cross_intact(pool):
    # Frames far larger than a socket buffer, both ways, while small commands queue behind them.
    blob = bytes(range(256)) * (24 * 1024 * 4)  # 24 MiB
    big = pool.run_async(rank_fns.echo_with_rank, blob)
    small = pool.run_async(abs, -3)
    results = big.result(timeout=120)
    assert [r for r, _ in results] == [0, 1]
    assert all(echoed == blob for _, echoed in results)
    assert small.result(timeout=60) == [3, 3]
