"""Precision: fp32, bf16 autocast, fp16 autocast with dynamic loss scaling, bf16 by FSDP2 mixed precision.

Parameters, gradients and optimizer state stay fp32 in every mode; autocast
runs the matmuls in the low precision and the loss in fp32 (`loss_fn`), the
same way in every layout, so a parallel run can be compared with a
single-process one.

Config.mixed_precision "fsdp" (bf16 under ZeRO 2/3) is torchtitan's way instead:
FSDP2's MixedPrecisionPolicy (`parallel.data_parallel.fsdp_policies`) casts each
unit's parameters to bf16 when it gathers them, so every op of the model, the
norms and residual adds too, runs in bf16 with no autocast; the fp32 shards stay
the master copy the optimizer updates, and gradients are reduced in fp32. Here
that only means: no autocast.

fp16 overflows where bf16 does not, so its loss is multiplied by a scale
before backward and the gradients divided by it before the optimizer
(`torch.amp.GradScaler`). A step whose gradients hold inf/nan must be skipped
and the scale halved — on every rank, or the replicas diverge. GradScaler
does not guarantee that agreement by itself:
- with DTensor gradients (FSDP2, TP) its inf check is all-reduced (max) over
  the mesh axes on which the *first* gradient is not replicated, so it agrees
  within one dp (or dp×tp) group but not across pipeline stages;
- with plain tensors (DDP, ZeroRedundancyOptimizer) each rank checks only its
  own gradients and relies on them being identical after the all-reduce;
  anything that touches one rank's gradients afterwards goes unnoticed.
So the trainer folds each rank's found-inf flag into the step's single world
all-reduce and hands the agreed verdict back here (`step(..., overflow=...)`).
"""

from __future__ import annotations

import contextlib

import torch

from workbench.config import Config

DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                                         # fp8: the linears run in float8 (parallel/float8.py), the rest in bf16
                                         "fp8_tensorwise": torch.bfloat16, "fp8_rowwise": torch.bfloat16,
                                         "mxfp8": torch.bfloat16}


class MixedPrecision:
    """Autocast and loss scaling for one trainer on one rank."""

    def __init__(self, cfg: Config, device_type: str) -> None:
        self.device_type = device_type
        # Under FSDP2 mixed precision the parameters arrive in bf16 already: autocast would change nothing.
        self.dtype = None if cfg.mixed_precision == "fsdp" else DTYPES[cfg.precision]
        self.scaler = torch.amp.GradScaler(device_type, enabled=cfg.precision == "fp16")
        if self.scaler.is_enabled():
            # GradScaler creates its scale on the first scale() call, which pipeline stages without
            # the loss never make; they still unscale the gradients the loss's stage sent back.
            self.scaler.scale(torch.zeros((), device=device_type))

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (unchanged unless fp16)."""
        return self.scaler.scale(loss)

    def unscale(self, optimizers: list[torch.optim.Optimizer]) -> torch.Tensor:
        """Divide the gradients by the scale in place; 1.0 if this rank saw inf/nan in them, else 0.0."""
        found = torch.zeros((), device=self.device_type)
        if not self.scaler.is_enabled():
            return found
        for opt in optimizers:
            self.scaler.unscale_(opt)
            for flag in self.scaler._found_inf_per_device(opt).values():
                found = found + flag.to(found.device)
        return found.clamp(max=1.0)

    def step(self, optimizers: list[torch.optim.Optimizer], *, overflow: bool, skip: bool) -> None:
        """Update the weights unless the step is skipped, and adapt the scale, from verdicts every rank agreed."""
        if not self.scaler.is_enabled():
            if not skip:
                for opt in optimizers:
                    opt.step()
            return
        for opt in optimizers:
            # The agreed verdict replaces this rank's own: GradScaler.step and update read these flags
            # (its per-optimizer record; torch's own ShardedGradScaler all-reduces the same tensors).
            for flag in self.scaler._found_inf_per_device(opt).values():
                flag.fill_(float(overflow))
            if not skip:
                self.scaler.step(opt)  # steps only if the flags are clear
        if skip and not overflow:
            # Skipped for another reason (e.g. out of memory): the scale was not at fault, keep it.
            self.scaler.update(new_scale=self.scaler.get_scale())
        else:
            self.scaler.update()

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler.is_enabled() else None
