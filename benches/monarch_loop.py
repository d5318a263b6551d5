"""benches/ddp_loop.py as a Monarch actor (benches/peers.py): its procs import this module by name, so it lives
apart from peers.py, which the procs need not import."""

from __future__ import annotations

from monarch.actor import Actor, endpoint


class Loop(Actor):
    @endpoint
    def noop(self) -> int:
        return 0

    @endpoint
    def build(self) -> None:
        """The torch.distributed world (Monarch's setup_torch_elastic_env gave its address) and the model, kept."""
        import torch.distributed as dist

        import ddp_loop

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        self.state = ddp_loop.build()

    @endpoint
    def steps(self) -> float:
        import ddp_loop

        return ddp_loop.steps(*self.state)
