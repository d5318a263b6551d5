"""Rank functions for the replica-check tests: train a step, compare the replicas, perturb one, compare again."""

from __future__ import annotations

from workbench.config import Config


def perturb_one_replica(cfg: Config, perturbed_rank: int = 1, index: int = 3) -> dict:
    """One step of `cfg`, a check that must pass, then parameter number `index` nudged by 1e-3 in one element on
    `perturbed_rank` only, and the check again: what it raised, on this rank."""
    import torch
    import torch.distributed as dist

    from workbench.engine.data import TokenData
    from workbench.engine.mesh import build_mesh
    from workbench.engine.replicas import check_replicas
    from workbench.engine.trainer import Trainer
    from workbench.pool import rank
    from workbench.telemetry.memory import local_tensor
    from workbench.telemetry.replicas import ReplicaDivergence, parameter_digests

    with rank.unchecked():
        trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", TokenData.for_config(cfg))
        trainer.step(0)
        check_replicas(trainer)  # replicas after a step: equal
        name, _ = parameter_digests(trainer.modules)[index]
        param = list(trainer.modules[0].parameters())[index]
        if dist.get_rank() == perturbed_rank:
            with torch.no_grad():
                local_tensor(param).view(-1)[0] += 1e-3
        try:
            check_replicas(trainer)
            found = None
        except ReplicaDivergence as e:
            found = {"ranks": list(e.divergence.ranks), "parameter": e.divergence.parameter, "message": str(e)}
    trainer.close()
    return {"perturbed": name, "found": found}


def nudge_the_sessions_parameter(perturbed_rank: int = 1, index: int = 3) -> str:
    """Parameter number `index` of the session's model nudged by 1e-3 in one element on `perturbed_rank` only (a
    flipped bit's stand-in); returns its name as the replica check names it."""
    import torch

    from workbench.engine import session
    from workbench.pool import rank
    from workbench.telemetry.memory import local_tensor
    from workbench.telemetry.replicas import parameter_digests

    trainer = session.current().trainer
    name, _ = parameter_digests(trainer.modules)[index]
    if rank.get_rank() == perturbed_rank:
        with torch.no_grad():
            local_tensor(list(trainer.modules[0].parameters())[index]).view(-1)[0] += 1e-3
    return name
