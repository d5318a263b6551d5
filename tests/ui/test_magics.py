"""`%%ranks`: a cell's code on every rank, its printed lines prefixed, its last value shown per rank."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import workbench as wb
from tests.ui.fakes import fake_workbench
from workbench.magics import run_cell


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "workbench.ui")
    yield ip
    InteractiveShell.clear_instance()


@pytest.fixture
def clean_ns(shell):
    before = set(shell.user_ns)
    yield shell
    for name in set(shell.user_ns) - before:
        del shell.user_ns[name]


def test_run_cell_returns_the_last_expression_per_rank_and_keeps_names(pool):
    assert pool.run(run_cell, "x = rank * 10\nx + world_size") == ["2", "12"]
    assert pool.run(run_cell, "x") == ["0", "10"]  # the namespace outlives the cell
    assert pool.run(run_cell, "y = 1") == [None, None]
    assert pool.run(run_cell, "torch.tensor([rank]).sum().item(), dist.get_world_size()") == ["(0, 2)", "(1, 2)"]


def test_the_magic_on_real_ranks(clean_ns, pool, capfd):
    clean_ns.user_ns["bench"] = wb.Workbench(pool=pool)
    result = clean_ns.run_cell("%%ranks\nprint('hello from', rank)\nt = torch.ones(2) * (rank + 1)\n"
                               "dist.all_reduce(t)\nt.tolist()")
    result.raise_error()
    out = capfd.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 0] Out: [3.0, 3.0]" in out and "[rank 1] Out: [3.0, 3.0]" in out


def test_the_model_is_in_scope_after_apply(clean_ns, pool, capfd):
    bench = wb.Workbench(pool=pool)
    bench.apply(wb.Config(tp=2))
    clean_ns.user_ns["bench"] = bench
    clean_ns.run_cell("%%ranks bench\nw1 = model.layers['0'].feed_forward.w1.weight\n"
                      "type(model).__name__, tuple(w1.to_local().shape), mesh['tp'].size()").raise_error()
    out = capfd.readouterr().out
    assert "[rank 0] Out: ('Transformer', (192, 128), 2)" in out


def test_a_rank_error_names_the_rank(clean_ns, pool):
    clean_ns.user_ns["bench"] = wb.Workbench(pool=pool)
    result = clean_ns.run_cell("%%ranks\nif rank == 1:\n    raise ValueError('only on one')")
    assert isinstance(result.error_in_exec, wb.RemoteError) and "rank 1" in str(result.error_in_exec)


def test_finding_the_workbench(clean_ns):
    ns = clean_ns.user_ns
    with pytest.raises(UsageError, match="no running wb.Workbench"):
        clean_ns.find_cell_magic("ranks").__self__._find_bench("")
    ns["a"] = fake_workbench()
    ns["also_a"] = ns["a"]
    magic = clean_ns.find_cell_magic("ranks").__self__
    assert magic._find_bench("") is ns["a"]
    ns["b"] = fake_workbench()
    with pytest.raises(UsageError, match="several Workbenches"):
        magic._find_bench("")
    assert magic._find_bench("b") is ns["b"]
    with pytest.raises(UsageError, match="no variable 'c'"):
        magic._find_bench("c")
    ns["c"] = 3
    with pytest.raises(UsageError, match="not a wb.Workbench"):
        magic._find_bench("c")
