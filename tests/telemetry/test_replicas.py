"""The replica check: the pure comparison on made-up digests, and one 2-rank DDP run where one replica is nudged."""

from __future__ import annotations

from workbench.config import Config, ModelConfig
from workbench.telemetry.replicas import first_divergence

BASE = Config(model=ModelConfig.preset("tiny"), batch_size=8, seq_len=64)


def test_replicas_in_agreement_have_no_divergence():
    same = [("a", "1"), ("b", "2")]
    assert first_divergence({0: same, 1: list(same), 2: list(same)}) is None
    assert first_divergence({0: same}) is None, "one rank has no replica"


def test_the_odd_rank_out_and_the_first_differing_parameter_are_named():
    good, bad = [("a", "1"), ("b", "2"), ("c", "3")], [("a", "1"), ("b", "X"), ("c", "Y")]
    found = first_divergence({0: good, 1: bad, 2: good})
    assert (found.ranks, found.parameter, found.reference) == ((1,), "b", (0, 2))
    assert "rank 1 holds different bytes for 'b'" in str(found)


def test_with_two_replicas_rank_0_is_the_reference_and_a_missing_parameter_is_a_divergence():
    found = first_divergence({0: [("a", "1")], 1: [("a", "2")]})
    assert (found.ranks, found.reference) == ((1,), (0,))
    found = first_divergence({0: [("a", "1"), ("b", "2")], 1: [("a", "1")]})
    assert (found.ranks, found.parameter) == ((1,), "b")


def test_a_nudged_replica_is_named_with_the_parameter_on_every_rank(pool):
    from tests.telemetry import replica_rank_fns as fns

    results = pool.run(fns.perturb_one_replica, BASE.replace(dp=2), 1, 3)
    assert results[0]["perturbed"] == results[1]["perturbed"]
    for r in results:
        assert r["found"] is not None, "the nudge went unnoticed"
        assert (r["found"]["ranks"], r["found"]["parameter"]) == ([1], r["perturbed"])
