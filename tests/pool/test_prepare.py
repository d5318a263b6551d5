"""A rank's preparation (`workbench.pool.world.prepare`): what it leaves behind for the commands that follow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench.rank_session import RECORDING_BACKEND, SESSION_MODULE

PREPARE = f'''
import gc, json, sys
from workbench.pool import world
before = gc.isenabled()
world.prepare({{"device": "cpu", "threads": 1, "preload": ["{SESSION_MODULE}"], "backend_setup": "{RECORDING_BACKEND}"}}, 0, 1)
print(json.dumps({{"collecting": gc.isenabled(), "frozen": gc.get_freeze_count(), "before": before,
                  "zero1 imported": "torch.distributed.optim" in sys.modules, "dynamo imported": "torch._dynamo" in sys.modules}}))
'''


@pytest.mark.processes
def test_preparation_collects_again_freezes_what_it_imported_and_skips_what_only_zero1_needs():
    out = subprocess.run([sys.executable, "-c", PREPARE], capture_output=True, text=True, timeout=120, check=True)
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    # The collector is off while importing (its passes over the growing heap found nothing) and on again after.
    assert facts["before"] and facts["collecting"]
    # torch and the engine are frozen out of every later collection: hundreds of thousands of objects.
    assert facts["frozen"] > 100_000
    assert facts["dynamo imported"]  # the first optimizer's import, paid here rather than in the first apply
    # torch.distributed.optim compiles TorchScript on import (~0.18 s); only a zero=1 apply imports it.
    assert not facts["zero1 imported"]
