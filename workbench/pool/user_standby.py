"""The kernel's side of the user's standby: ranks forked by a prepared process that outlives the kernel.

A notebook's first cell pays for importing torch and the engine once (~2.5 s of a core here), and again after
every kernel restart. The standby (`standby_process`) is a zygote that is not the kernel's: started by the first
kernel that needs one, it stays after that kernel ends, so the next kernel of the user connects to it and forks
its ranks at once. One runs per fingerprint: what the prepared state depends on (workbench's source, Python,
torch, the environment torch reads at import, what the ranks preload, the device). A kernel whose fingerprint
differs from a running standby's starts fresh ranks and a standby of its own, and says why; the other ends after
its idle timeout. The world size does not matter: a rank's threads, rank and world are set after the fork.

`Pool(..., standby=False)` (or `Workbench(..., standby=False)`, or $WORKBENCH_STANDBY=0) keeps ranks to a zygote
of the kernel's own, which ends with it. `stop()` ends the user's standbys now.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from workbench.pool import launch, protocol, runtime_dir, standby_wire as wire
from workbench.pool.zygote import Zygote, hang_up, zygote_environment

log = logging.getLogger("workbench.pool")

START_S = 10.0
"""How long a kernel waits for a standby it started to listen (it binds its socket before it imports anything)."""
WELCOME_S = 300.0
"""How long a kernel waits for a standby's welcome (it answers once prepared: a cold start's worth)."""
ENV_THAT_MATTERS = ("PYTHON", "LD_", "TORCH", "OMP_", "MKL", "KMP_", "GOMP_", "OPENBLAS", "CUDA", "NVIDIA", "NCCL_",
                    "GLOO_", "WORKBENCH_", "VIRTUAL_ENV", "CONDA_PREFIX", "HOME", "XDG_CACHE_HOME", "TMPDIR")
"""Environment variables read while a standby prepares (Python's and torch's at import, ours, where caches are):
one that differs makes another standby. The others are the rank's own: a forked rank's environment is its
kernel's."""
ALSO_GIVEN = ("PATH", "USER", "LOGNAME", "LANG", "LC_", "XDG_RUNTIME_DIR")
"""What a standby gets of the first kernel's environment besides ENV_THAT_MATTERS, and nothing else: it outlives
that kernel, and keeps none of its variables (tokens, a session's settings) for the kernels after it."""
SOCKET_PATH_BYTES = 108
"""What a Unix socket's path may hold on Linux (sun_path), its final NUL included."""
NOT_PREPARED_BY = ("WORKBENCH_RUNTIME_DIR", "WORKBENCH_STANDBY_IDLE_S", "WORKBENCH_STANDBY_HANDSHAKE_S")


def fingerprint(env: dict[str, str], prepare: dict) -> dict[str, Any]:
    """What a standby's prepared state depends on; a kernel takes over only a standby with the same."""
    return {
        "python": [sys.executable, sys.version],
        "torch": torch_version(),
        # Its version needs no entry of its own: it is a line of workbench/__init__.py, whose stamp is here.
        "workbench": [launch.package_root(), source_stamp()],
        "prepare": {k: v for k, v in sorted(prepare.items()) if k not in ("private_dir", "threads")},
        "env": {k: v for k, v in sorted(env.items()) if k.startswith(ENV_THAT_MATTERS) and k not in NOT_PREPARED_BY},
    }


def source_stamp() -> str:
    """Every source file of the package and its extensions, by size and modification time (a few ms): any edit
    makes a different standby."""
    import hashlib

    root = Path(launch.package_root())
    digest = hashlib.sha256()
    for folder in (root / "workbench", root / "extensions"):
        for dirpath, dirnames, files in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".cpp", ".h", ".cu", ".hpp")):
                    info = os.stat(os.path.join(dirpath, name))
                    digest.update(f"{dirpath}/{name} {info.st_size} {info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def connect(env: dict[str, str], prepare: dict) -> Zygote | None:
    """A Zygote that is the user's standby for ranks with this environment and preparation: the running one, or
    one started now (a cold start, which it pays instead of a zygote of this kernel's); None where the user has
    no usable runtime folder or it could not start (the pool then uses a zygote of its own)."""
    try:
        folder = runtime_dir.ensure()
    except (OSError, runtime_dir.RuntimeDirError) as e:
        log.warning("workbench pool: no standby (%s): ranks come from this kernel's own zygote", e)
        return None
    mine = fingerprint(env, prepare)
    paths = wire.Paths(folder, wire.name_for(mine))
    if len(os.fsencode(paths.socket)) >= SOCKET_PATH_BYTES:
        log.warning("workbench pool: no standby: %s is too long a path for a Unix socket; set $%s to a shorter "
                    "folder", paths.socket, runtime_dir.ENV)
        return None
    sock = _connect(paths.socket)
    origin = "the user's standby"
    if sock is None:
        if why := _why_not_theirs(folder, paths.name, mine):
            log.warning("workbench pool: %s; starting fresh ranks and a standby for this kernel's configuration",
                        why)
            origin += f" (new: {why})"
        _start(paths, env, prepare, mine)
        deadline = time.monotonic() + START_S
        while sock is None and time.monotonic() < deadline:
            time.sleep(0.02)
            sock = _connect(paths.socket)
        if sock is None:
            log.warning("workbench pool: the standby did not start (see %s): ranks come from this kernel's own "
                        "zygote", paths.log)
            return None
    try:
        pid = json.loads(paths.description.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        pid = 0
    return Zygote(StandbyChannel(sock, paths, mine), pid, f"{origin}, pid {pid}")


class StandbyChannel:
    """The kernel's end of one connection to the standby (see standby_wire for the handshake)."""

    def __init__(self, sock: socket.socket, paths: wire.Paths, fingerprint: dict) -> None:
        self.sock, self.paths, self.fingerprint = sock, paths, fingerprint
        self.signed: wire.SignedChannel | None = None

    def handshake(self, timeout_s: float = WELCOME_S) -> dict:
        nonce = secrets.token_hex(16)
        self.sock.send(wire.knock(nonce))
        if not select.select([self.sock], [], [], timeout_s)[0]:
            raise TimeoutError(f"no answer within {timeout_s:.0f} s")
        data, fds = wire.receive(self.sock, wire.REPLY_BYTES, 0)
        if not data:
            raise ConnectionError(f"it ended before answering: {_last_words(self.paths.log)}")
        verifier = protocol.Verifier(launch.read_key_file(self.paths.key))
        sender, welcome = verifier.open(data, adopt_session=True)
        if sender != "standby" or welcome.get("type") != "welcome" or welcome.get("nonce") != nonce:
            raise protocol.Rejected("not a welcome to this knock")
        if welcome.get("fingerprint") != self.fingerprint:
            raise protocol.Rejected("it was prepared for another configuration")
        self.signed = wire.SignedChannel(self.sock, verifier.key, "kernel", verifier.session, verifier)
        self.signed.send({"type": "hello", "challenge": welcome["challenge"]})
        return {"prepared": True}

    def send(self, message: dict, fds: list[int] | None = None) -> None:
        self.signed.send(message, fds)

    def recv(self) -> dict | None:
        try:
            return self.signed.recv(wire.REPLY_BYTES)[0]
        except protocol.Rejected as e:
            log.warning("workbench pool: the standby's connection closed: %s", e)
            return None

    def close(self) -> None:
        hang_up(self.sock)


def _connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(str(path))
    except OSError:  # none there, or a dead standby's socket
        sock.close()
        return None
    return sock


def _start(paths: wire.Paths, env: dict[str, str], prepare: dict, mine: dict) -> None:
    """Start a standby in a session of its own (the kernel's process group may be signalled as it ends); if one
    starts at the same moment for the same name, one of them takes the lock and the other exits."""
    own = {k: v for k, v in env.items() if k.startswith(ENV_THAT_MATTERS + ALSO_GIVEN)}
    env = {**zygote_environment(own, prepare), wire.FINGERPRINT_ENV: json.dumps(mine)}
    proc = subprocess.Popen([sys.executable, "-m", "workbench.pool.standby_process", str(paths.folder), paths.name],
                            env=env, cwd=paths.folder, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    # Reaped here if it ends while this kernel lives (its idle timeout); after the kernel, by whoever adopts it.
    threading.Thread(target=proc.wait, name="workbench-standby-reaper", daemon=True).start()


def _why_not_theirs(folder: Path, name: str, mine: dict) -> str:
    """Why a running standby of another fingerprint does not fit this kernel, if one runs ('' if none does)."""
    reasons = []
    for described in sorted(folder.glob("standby-*.json")):
        other = wire.Paths(folder, described.stem)
        if other.name == name or not _running(other):
            continue
        try:
            theirs = json.loads(described.read_text())
        except (OSError, ValueError):
            continue
        diff = _differences(theirs.get("fingerprint", {}), mine)
        reasons.append(f"the standby pid {theirs.get('pid')} was prepared for {diff}")
    return "; ".join(reasons)


def _differences(theirs: dict, mine: dict) -> str:
    said = []
    if theirs.get("torch") != mine["torch"]:
        said.append(f"torch {theirs.get('torch')} (this kernel: {mine['torch']})")
    if theirs.get("python") != mine["python"]:
        said.append(f"Python {theirs.get('python', ['?'])[0]} (this kernel: {mine['python'][0]})")
    if theirs.get("workbench") != mine["workbench"]:
        said.append("another version or source of workbench (a file changed since)")
    if theirs.get("prepare") != mine["prepare"]:
        changed = sorted(k for k in {*theirs.get("prepare", {}), *mine["prepare"]}
                         if theirs.get("prepare", {}).get(k) != mine["prepare"].get(k))
        said.append("other ranks: " + ", ".join(f"{k}={theirs.get('prepare', {}).get(k)!r} (this kernel: "
                                                f"{mine['prepare'].get(k)!r})" for k in changed))
    if theirs.get("env") != mine["env"]:
        env = theirs.get("env", {})
        changed = sorted(k for k in {*env, *mine["env"]} if env.get(k) != mine["env"].get(k))
        said.append("another environment (" + ", ".join(changed[:4]) + (", ..." if len(changed) > 4 else "") + ")")
    return "; ".join(said) or "another configuration"


def _running(paths: wire.Paths) -> bool:
    """Whether a standby holds this name's lock (a lock is freed with its process, however it ended)."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _last_words(log_path: Path) -> str:
    try:
        return log_path.read_text()[-2000:].strip() or f"nothing in {log_path}"
    except OSError:
        return f"no {log_path}"


def running() -> list[dict[str, Any]]:
    """The user's standbys that run now: pid, when started, and what they are prepared for."""
    try:
        folder = runtime_dir.ensure()
    except (OSError, runtime_dir.RuntimeDirError):
        return []
    found = []
    for described in sorted(folder.glob("standby-*.json")):
        if _running(wire.Paths(folder, described.stem)):
            try:
                found.append({"name": described.stem, **json.loads(described.read_text())})
            except (OSError, ValueError):
                pass
    return found


def stop(timeout_s: float = 5.0) -> list[int]:
    """End the user's standbys now (their ranks end with them); returns their pids."""
    ended = []
    for standby in running():
        pid = standby.get("pid")
        try:
            if isinstance(pid, int) and Path(f"/proc/{pid}/comm").read_text().strip() == "wb-standby":
                os.kill(pid, signal.SIGTERM)
                ended.append(pid)
        except (OSError, ProcessLookupError):
            pass
    deadline = time.monotonic() + timeout_s
    for pid in ended:
        while Path(f"/proc/{pid}").exists() and _state(pid) not in ("Z", "X") and time.monotonic() < deadline:
            time.sleep(0.02)
    return ended


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def torch_version() -> str:
    """The installed torch's version, read from its version.py without importing torch or importlib.metadata
    (which a kernel's first cell would pay ~10 ms for); "" where there is no torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return ""
    try:
        for line in (Path(spec.origin).parent / "version.py").read_text().splitlines():
            if line.startswith("__version__"):
                return line.split("=", 1)[1].strip().strip("'\"")
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version  # a torch laid out otherwise

    try:
        return version("torch")
    except PackageNotFoundError:
        return ""

