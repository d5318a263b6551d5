"""Rank functions for the probe tests: train a few steps with telemetry on and report, with independent sums."""

from __future__ import annotations

import torch

from workbench.config import Config


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train_and_measure(cfg: Config, steps: int = 2) -> dict:
    import torch.distributed as dist

    from workbench.engine.data import TokenData
    from workbench.engine.mesh import build_mesh
    from workbench.engine.trainer import Trainer
    from workbench.pool import rank

    with rank.unchecked():
        trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", TokenData.for_config(cfg), telemetry=True)
        checks = _compare_memory_with_the_walks(trainer)
        metrics = [trainer.step(i) for i in range(steps)]
    trainer.close()
    m = metrics[-1]
    # Independent measures, straight from the tensors (to_local, nbytes, the optimizer's state_dict).
    params = sum(_local(p).nbytes for mod in trainer.modules for p in mod.parameters())
    opt_state = 0
    for opt in trainer.optimizers:
        inner = getattr(opt, "optim", opt)
        for state in inner.state_dict()["state"].values():
            opt_state += sum(_local(v).nbytes for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    full = sum(p.numel() * 4 for p in __import__("workbench.models.transformer", fromlist=["x"]).build_model(
        cfg.model, cfg.seed).parameters())
    # The buffers torch's pipeline stages receive activations and gradients into (private in torch 2.13).
    receive = 0
    for stage in trainer.pipeline.stages if trainer.pipeline else ():
        infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
        receive += sum(i.buffer.nbytes for mb in infos for i in mb if not i.is_root_arg and i.buffer is not None)
    return {
        "memory": m.memory, "peak": m.peak_memory, "independent_params": params, "independent_optimizer": opt_state,
        "full_params": full, "flops": m.flops, "mfu": m.mfu, "basis": m.mfu_basis,
        "comm": [(iv.name, iv.bytes, iv.group_size) for iv in m.intervals if iv.kind == "comm"],
        "compute": [iv.name for iv in m.intervals if iv.kind == "compute"],
        "comm_time_s": m.comm_time_s, "exposed_comm_s": m.exposed_comm_s, "overlap": m.overlap,
        "step_time_s": m.step_time_s, "world": dist.get_world_size(), "actions": m.pipeline_actions,
        "receive_buffers": receive, "pp_rank": trainer.pipeline.pp_rank if trainer.pipeline else 0,
        "memory_checks": checks,
    }


def _compare_memory_with_the_walks(trainer) -> list[tuple[str, int, int]]:
    """Each time the probe asks its per-layout memory counts during the steps, the full walks over modules and
    optimizers (telemetry.memory's functions) are asked too: (what, cached answer, walked answer)."""
    from workbench.telemetry import memory

    cached, seen = trainer.probe.memory, []
    walks = {"parameter_bytes": lambda: memory.parameter_bytes(trainer.modules),
             "gradient_bytes": lambda: memory.gradient_bytes(trainer.modules),
             "optimizer_bytes": lambda: memory.optimizer_bytes(trainer.optimizers, trainer.device)}
    for name, walk in walks.items():
        def both(answer=getattr(cached, name), walk=walk, name=name):
            value = answer()
            seen.append((name, value, walk()))
            return value
        setattr(cached, name, both)
    return seen


class _Shortened:
    """The trainer's batches, cut to `seq_len` positions from step `from_step` on: a batch shape the layout had not
    seen, which the activation meter must measure again."""

    def __init__(self, data, from_step: int, seq_len: int) -> None:
        self.data, self.from_step, self.seq_len = data, from_step, seq_len

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        tokens = self.data.local_batch(step, dp_rank, dp_size)
        return tokens[:, :self.seq_len + 1] if step >= self.from_step else tokens


def train_sampled(cfg: Config, steps: int, every: int, shorten_at: int | None = None) -> list[dict]:
    """`steps` steps with the activation meter sampling one step in `every` once settled (and the batches shortened
    to half their positions from step `shorten_at`): per step, the reported activation figures, the step they
    were measured at, and how many tensors the meter's pack hook saw in it (0 on a step it did not watch)."""
    from workbench.engine.data import TokenData
    from workbench.engine.mesh import build_mesh
    from workbench.engine.trainer import Trainer
    from workbench.pool import rank
    from workbench.telemetry.activations import MeterSampling

    with rank.unchecked():
        trainer = Trainer(cfg, build_mesh(cfg, "cpu"), "cpu", TokenData.for_config(cfg), telemetry=True)
        probe = trainer.probe
        probe.sampling = MeterSampling(every=every, every_step=probe.sampling.every_step)
        if shorten_at is not None:
            trainer.data = _Shortened(trainer.data, shorten_at, cfg.seq_len // 2)
        packs = [0]
        pack = probe.meter._pack

        def counting(t):
            packs[0] += 1
            return pack(t)

        probe.meter._pack = counting  # watching() installs the instance's _pack
        rows = []
        for i in range(steps):
            packs[0] = 0
            m = trainer.step(i)
            rows.append({"step": m.step, "measured_at": m.activations_step, "packs": packs[0],
                         "peak": m.peak_memory["activations"], "live": m.memory["activations"]})
    trainer.close()
    return rows
