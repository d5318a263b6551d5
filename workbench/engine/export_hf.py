"""The trained model written back as a Hugging Face checkpoint: safetensors and config.json (`bench.export_hf`).

Every rank gathers the whole model (as `export_full_state` does for a reshard: any layout, pipeline stages and
expert slices included), and rank 0 writes it with the source's config, in the parameters' own dtype (fp32 as
trained). What `HFModel(folder, weights=folder)` loads back is then bit for bit what was exported, and so is a second
export of it; transformers' `from_pretrained(folder)` reads the same folder.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from workbench.config import HFModel
from workbench.engine.reshard import export_full_model
from workbench.models.weights import write


def export_hf(trainer, directory: str, max_shard_bytes: int) -> list[str]:
    """Write `trainer`'s model into `directory` (collective: all ranks); the files written, on every rank."""
    source = trainer.cfg.model
    if not isinstance(source, HFModel):
        raise TypeError(f"export_hf writes a Hugging Face checkpoint, and the model is a {type(source).__name__}: "
                        "use bench.save() for a workbench checkpoint")
    tensors = export_full_model(trainer)
    written: list[object] = [None]
    if dist.get_rank() == 0:
        written[0] = [str(p) for p in write(directory, tensors, source.config, max_shard_bytes=max_shard_bytes)]
    dist.broadcast_object_list(written, src=0)
    return [str(Path(p)) for p in written[0]]
