"""Thirty applies across layouts with telemetry on leave each rank holding one model, as after the first few.

Issue 17: every apply used to keep the previous trainer alive (its model, optimizer, corpus mapping and an fd),
through the step probe's gradient hooks. Counted on the ranks by `workbench.engine.session.held`, which
walks the garbage collector's objects, so a model kept alive by anything at all is seen.
"""

from __future__ import annotations

import workbench as wb
from workbench.engine.session import held

TINY = wb.Config(model=wb.ModelConfig.preset("tiny"), batch_size=4, seq_len=16)
# Every kind of layout change: tensor parallel, ZeRO-1, FSDP2, a pipeline, and back to plain DDP, where the
# parameters alive can be compared exactly with the model's (FSDP2 keeps unsharded twins of its parameters).
LAYOUTS = [TINY.replace(tp=2), TINY.replace(dp=2, zero=1), TINY.replace(dp=2, zero=3),
           TINY.replace(pp=2, micro_batches=2), TINY.replace(dp=2)]
APPLIES = 30
MIB = 2**20


def test_thirty_applies_across_layouts_hold_one_model(pool):
    # Fresh ranks: the shared pool's ranks keep what earlier tests left on purpose (compiled code in dynamo's
    # caches, which holds the modules it compiled, for a fast return to a layout; rank functions' globals), so
    # counted after them the parameters alive depended on which tests ran first (it failed after tests/ui/ and
    # tests/models/). What this test holds is that its own applies leave nothing behind.
    pool.restart()
    bench = wb.Workbench(pool=pool)
    seen = {}
    for i in range(APPLIES):
        bench.apply(LAYOUTS[i % len(LAYOUTS)])
        if i % len(LAYOUTS) == len(LAYOUTS) - 1:  # a step per round: the gradient and optimizer hooks fire
            bench.train(1).wait()
        if i + 1 in (2 * len(LAYOUTS), APPLIES):  # after two rounds every mesh exists; then twenty applies more
            seen[i + 1] = pool.run(held)
    for early, late in zip(seen[2 * len(LAYOUTS)], seen[APPLIES]):
        for h in (early, late):
            assert h.trainers == 1, h
            assert h.parameters == h.session_parameters, f"parameters of another model are alive: {h}"
        # Leaked, each apply kept a model (~10 MB with AdamW's moments) and an fd on the corpus file.
        assert late.open_fds <= early.open_fds + 2, (early, late)
        assert late.threads == early.threads, (early, late)
        assert late.rss_bytes - early.rss_bytes < 40 * MIB, (early.rss_bytes / MIB, late.rss_bytes / MIB)
