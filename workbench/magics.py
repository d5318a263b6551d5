"""`%%ranks`: run a notebook cell on every rank of a Workbench's pool.

    %load_ext workbench.ui
    %%ranks            # or `%%ranks bench` to name the Workbench variable
    w = model.layers["0"].feed_forward.w1.weight
    print(w.placements)        # comes back as "[rank N] ..." lines
    w.to_local().shape         # the last expression's value, shown per rank

In scope on each rank: `rank`, `world_size`, `mesh`, `model` (the trainer's
module; a list of its modules for pipeline layouts, where a rank holds
several), `modules` (always the list), `trainer`, `torch` and `dist`.
Names a cell defines stay defined for the next `%%ranks` cell on that rank,
until the pool restarts.
"""

from __future__ import annotations

import ast
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class

from workbench import kernel

NAMESPACE_KEY = "ranks_magic_namespace"
"""Where each rank keeps the names its %%ranks cells defined (in workbench.pool.rank.state)."""


def run_cell(source: str, cell_name: str = "<%%ranks cell>") -> str | None:
    """Executed on each rank: run `source` in the rank's cell namespace; repr of its last expression, or None.

    The value comes back as its repr so a CUDA tensor never travels to the
    notebook (which must not touch CUDA) and anything unpicklable still shows.
    """
    import torch
    import torch.distributed as dist

    from workbench.pool import rank as this_rank

    ns = this_rank.state.setdefault(NAMESPACE_KEY, {"__name__": "__ranks__"})
    from workbench.engine.session import current_or_none

    session = current_or_none()
    trainer = getattr(session, "trainer", None)
    modules = list(getattr(trainer, "modules", []))
    ns.update(rank=this_rank.get_rank(), world_size=this_rank.get_world_size(), torch=torch, dist=dist,
              trainer=trainer, mesh=getattr(trainer, "mesh", None), modules=modules,
              model=modules[0] if len(modules) == 1 else (modules or None))
    tree = ast.parse(source, cell_name)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    # The user's own collectives are theirs to match; the pool's mismatch check stays on for them.
    exec(compile(tree, cell_name, "exec"), ns)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), cell_name, "eval"), ns)
    return None if value is None else repr(value)


@magics_class
class RankMagics(Magics):
    @cell_magic
    def ranks(self, line: str, cell: str) -> None:
        """Run this cell on every rank of the Workbench (`%%ranks NAME` picks the variable NAME)."""
        bench = self._find_bench(line.strip())
        values = bench.pool.run(run_cell, cell)
        for r, value in enumerate(values):
            if value is not None:
                print(f"[rank {r}] Out: {value}")

    def _find_bench(self, name: str) -> Any:
        ns = self.shell.user_ns
        if name:
            if name not in ns:
                raise UsageError(f"%%ranks {name}: no variable {name!r} in this notebook")
            if not kernel.is_workbench(ns[name]):
                raise UsageError(f"%%ranks {name}: {name} is a {type(ns[name]).__name__}, not a wb.Workbench")
            return ns[name]
        found: dict[int, list[str]] = {}
        for var, value in ns.items():
            if (kernel.is_workbench(value) and not var.startswith("_") and not value.closed
                    and not value.pool.broken):
                found.setdefault(id(value), []).append(var)
        if not found:
            raise UsageError("%%ranks: no running wb.Workbench in this notebook; create one "
                             "(bench = wb.Workbench(world_size=2)) or name it: %%ranks bench")
        if len(found) > 1:
            names = ", ".join(vs[0] for vs in found.values())
            first = next(iter(found.values()))[0]
            raise UsageError(f"%%ranks: several Workbenches ({names}); name one: %%ranks {first}")
        return ns[next(iter(found.values()))[0]]


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(RankMagics)
