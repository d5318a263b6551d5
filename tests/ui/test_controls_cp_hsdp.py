"""The context-parallel and HSDP inputs: each maps to its Config field, explains itself, and a combination Config
refuses is explained inline with Config's own message (never sent to the ranks)."""

from __future__ import annotations

import pytest

import workbench as wb
from tests.ui.fakes import fake_workbench
from workbench.config import ConfigError
from workbench.ui.controls import Controls


def _refusal(**values) -> str:
    with pytest.raises(ConfigError) as e:
        wb.Config(**values)
    return str(e.value)


def test_the_cp_degree_maps_to_the_config_and_says_what_each_rank_holds():
    c = Controls(fake_workbench(world_size=2))
    c.dp.value, c.cp.value, c.seq_len.value = 1, 2, 512
    assert c.config == wb.Config(cp=2, seq_len=512) and c.config.world_size == 2
    assert "each rank holds 256 of the 512 tokens of every sequence (2 balanced chunks of 128)" in c.explain.value
    c.set_config(wb.Config(dp=2))
    assert c.cp.value == 1 and "cp=" not in c.explain.value


@pytest.mark.parametrize("changes, field", [
    (dict(cp=2), "dp·cp·tp·pp"),                             # dp2·cp2 = 4 ranks on a pool of 2
    (dict(dp=1, cp=2, seq_len=102), "seq_len"),             # 2·cp balanced chunks
    (dict(dp=1, cp=2, model="tiny-moe"), "cp"),             # a mixture of experts routes whole sequences
])
def test_a_context_parallel_refusal_is_the_configs_own_message(changes, field):
    c = Controls(fake_workbench(world_size=2))
    with c.model.hold_trait_notifications():
        for name, value in changes.items():
            getattr(c, name).value = value
    c.validate()
    assert c.config is None and c.apply_button.disabled and c.error.startswith(field)
    if field != "dp·cp·tp·pp":  # the world is the pool's refusal, the rest Config's own
        assert c.error == _refusal(**c.values())


def test_hsdp_replicas_map_to_the_config_and_explain_the_two_level_sync():
    bench = fake_workbench(world_size=4)
    c = Controls(bench)
    c.zero.value, c.dp_replicate.value = 3, 2
    assert c.config == wb.Config(dp=4, zero=3, dp_replicate=2, batch_size=32) and c.config.hsdp
    assert "HSDP: 2 replica groups of 2 ranks" in c.explain.value
    c.zero.value = 0  # DDP replicates everything already: Config says so, inline
    assert c.config is None and c.error == _refusal(**c.values()) and c.error.startswith("dp_replicate")
    assert c.apply() is None and bench.session.applied == []
