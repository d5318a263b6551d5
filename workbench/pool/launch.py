"""How ranks are started: the key file they prove themselves with, and the commands that start them.

Local pools spawn `python -m workbench.pool.worker` themselves. For ranks on
other machines the notebook prints a torchrun (or srun) command; those ranks
connect back to the notebook's address with the same entry point.
"""

from __future__ import annotations

import os
import shlex
import stat
import sys
from pathlib import Path

from workbench.pool.protocol import KEY_BYTES, new_key


def write_key_file(path: str | os.PathLike, key: bytes | None = None) -> bytes:
    """Create (or replace) a key file readable by its owner only; returns the key."""
    key = key or new_key()
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    # O_EXCL with mode 0600: the key is never readable by others, not even for an instant.
    if tmp.exists():
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.hex().encode())
    os.replace(tmp, path)
    return key


def read_key_file(path: str | os.PathLike) -> bytes:
    """Read a key file, refusing one that others can read."""
    path = Path(path).expanduser()
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"{path} is readable by other users (mode {oct(mode & 0o777)}); run chmod 600 {path}")
    key = bytes.fromhex(path.read_text().strip())
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path} does not hold a {KEY_BYTES}-byte workbench key")
    return key


def package_root() -> str:
    """The folder that holds the `workbench` package, so ranks import the same code as the notebook."""
    return str(Path(__file__).resolve().parents[2])


def local_worker_argv(address: str, key_file: str, rank: int, world_size: int) -> list[str]:
    return [sys.executable, "-m", "workbench.pool.worker", "--connect", address, "--key-file", key_file,
            "--rank", str(rank), "--world-size", str(world_size), "--local"]


def torchrun_command(address: str, key_file: str, *, nnodes: int, nproc_per_node: int, node_rank: int | str = "$NODE_RANK",
                     master_addr: str = "$MASTER_ADDR", master_port: int = 29500, python: str = "python") -> str:
    """The command to run on each node: its ranks connect back to the notebook at `address`."""
    args = [python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}",
            "-m", "workbench.pool.worker", "--connect", address, "--key-file", key_file]
    # $VARS stay unquoted so the node's shell fills them in.
    return " ".join(a if a.startswith("--node-rank=$") or a.startswith("--master-addr=$") else shlex.quote(a)
                    for a in args)


def srun_command(address: str, key_file: str, *, nodes: int, tasks_per_node: int, python: str = "python") -> str:
    """Slurm: one task per rank; the worker reads SLURM_PROCID/SLURM_NTASKS; MASTER_ADDR/PORT must be exported."""
    return (f"srun --nodes={nodes} --ntasks-per-node={tasks_per_node} {shlex.quote(python)} -m workbench.pool.worker "
            f"--connect {shlex.quote(address)} --key-file {shlex.quote(key_file)}")
