"""A kernel-like driver for the standby's drills: `python -m tests.pool.standby_driver HOLD [PRELOAD]`.

It starts a 2-rank CPU pool with the user's standby (its runtime folder from the environment), prints one JSON
line (the ranks' pids and parents, where they came from, what they find in their state), then: HOLD "close"
closes the pool and exits; "idle" keeps the pool, doing nothing; "busy" keeps the ranks in a command. The test
kills it (or the standby) where it wants.
"""

from __future__ import annotations

import json
import os
import sys
import time

SECRET = "a model the next kernel must never see"


def _look() -> dict:
    """What this rank finds of an earlier kernel's ranks (their state, a module they changed), and leaves its own."""
    import torch

    from workbench.pool import rank

    found = {"state": rank.state.get("secret"), "module": getattr(torch, "_left_behind", None)}
    rank.state["secret"] = SECRET
    torch._left_behind = SECRET
    return {"pid": os.getpid(), "ppid": os.getppid(), "found": found}


def main() -> None:
    import workbench as wb

    hold = sys.argv[1]
    preload = tuple(sys.argv[2:])
    pool = wb.Pool(2, device="cpu", standby=True, preload=preload)
    looks = pool.run(_look)
    print(json.dumps({"ranks": looks, "from": pool.ranks_from, "standby": pool._zygote.pid,
                      "driver": os.getpid()}), flush=True)
    if hold == "close":
        pool.close()
        return
    if hold == "busy":
        pool.run_async(time.sleep, 600)
    print(json.dumps({"holding": hold}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
