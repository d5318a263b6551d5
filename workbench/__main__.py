"""The user's standby from a shell: `python -m workbench --prepare-ahead | --standbys | --stop-standbys`.

`--prepare-ahead` starts the user's standby for a Workbench's ranks (or finds the one running) and returns once it is
prepared (~2 s on 2 cores). `make lab` runs it while JupyterLab starts, so that the quickstart's first cell forks its
ranks (~0.3 s) instead of waiting for torch, torch._dynamo and the engine to import (1.3–2.3 s on 2 cores, with the
host; benches/first_cell.py). The standby is the one a kernel's `import workbench` starts: it ends after
$WORKBENCH_STANDBY_IDLE_S (30 minutes) with no kernel. With $WORKBENCH_STANDBY=0 or $WORKBENCH_ZYGOTE=0 (no standby
wanted) it does nothing.

`--standbys` lists the user's running standbys; `--stop-standbys` ends them at once (`workbench.pool.user_standby`).
"""

from __future__ import annotations

import os
import sys
import time

USAGE = "usage: python -m workbench --prepare-ahead | --standbys | --stop-standbys"
WAIT_S = 120.0
"""How long it waits for the standby (a bound on a hang, as the pool's start_timeout_s)."""


def main(argv: list[str]) -> int:
    if argv == ["--standbys"] or argv == ["--stop-standbys"]:
        from workbench.pool import user_standby

        if argv == ["--stop-standbys"]:
            print("ended:", user_standby.stop() or "none")
        for standby in user_standby.running():
            print(f"{standby['name']}: pid {standby['pid']}, up {time.time() - standby['started']:.0f} s")
        return 0
    if argv != ["--prepare-ahead"]:
        print(USAGE, file=sys.stderr)
        return 2
    return _prepare_the_standby()


def _prepare_the_standby() -> int:
    if os.environ.get("WORKBENCH_STANDBY", "1") == "0":
        print("workbench: no ranks prepared ahead ($WORKBENCH_STANDBY=0)")
        return 0
    from workbench.pool import zygotes
    from workbench.pool.pool import prepare_ahead
    from workbench.pool.standby_process import IDLE_S
    from workbench.rank_session import RECORDING_BACKEND, SESSION_MODULE

    if not zygotes.usable("auto"):
        print("workbench: no ranks prepared ahead (ranks on CUDA are spawned, not forked; or $WORKBENCH_ZYGOTE=0)")
        return 0
    try:
        prepared = prepare_ahead(preload=(SESSION_MODULE,), backend_setup=RECORDING_BACKEND, standby=True,
                                 wait_s=WAIT_S)
    finally:
        zygotes.close_all()  # this process's connection to the standby; the standby goes on
    print(f"workbench: ranks prepared for the first Workbench (a standby that ends after {IDLE_S / 60:g} idle minutes)"
          if prepared else
          "workbench: the standby did not prepare: the first Workbench prepares its own ranks (see its log)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
