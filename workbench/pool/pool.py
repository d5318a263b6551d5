"""The notebook's side of the rank pool: start ranks, run functions on all of them, notice trouble.

`Pool` is the facade a notebook holds. The control plane lives in
`Transport`, which the facade owns but which holds no reference back, so
when a notebook drops its last reference the pool is collected and its ranks
are ended (no orphans), even without close().
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import secrets
import shutil
import sys
import weakref
from typing import Any, Callable, Literal

from workbench.machine import MACHINE_FACTS, threads_per_rank as shared_threads
from workbench.pool import launch, private_dir, protocol, runtime_dir, zygote, zygotes
from workbench.pool.commands import Command, Handle
from workbench.pool.errors import PoolError
from workbench.pool.health import HEARTBEAT_S, Explain, Limits
from workbench.pool.lifecycle import LocalRanks, Standby, StandbyInfo, rank_environment
from workbench.pool.private_dir import DRIVER_PID
from workbench.pool.transport import Transport
from workbench.pool.world import PREPARE_KEYS

log = logging.getLogger("workbench.pool")

Device = Literal["auto", "cpu", "cuda"]


def _default_output(rank: int, stream: str, line: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(f"[rank {rank}] {line}\n")


class Pool:
    """A pool of long-lived ranks that notebook cells drive.

    Local ranks are spawned fresh interpreters (never forked), so the notebook
    never touches CUDA. They form one torch.distributed world (gloo on CPU,
    NCCL on GPUs) that lives as long as the pool. `fn` passed to `run` can be
    any function, lambdas from notebook cells included; state that should
    outlive a call goes in `workbench.pool.rank.state`.

    timeout_s: a rank that runs a command without any sign of progress (a
    result, an event, printed output or `rank.progress()`) for this long is
    declared stuck: `CollectiveTimeout` (a rank waiting in a collective is
    alive: only this tells). frozen_after_s: a local rank whose heartbeats
    stop for this long has its process looked at; stopped (SIGSTOP, a
    debugger) or asleep without using CPU, it is `RankFrozen` at once, while a
    rank busy in C code that holds the GIL is left to `timeout_s` (see
    health.py). explain: given every answering rank's diagnostics
    (`rank.add_diagnostic`), a line that sums them up at the top of those two
    errors (e.g. which rank waits in which collective). check_collectives: ranks compare
    each collective that user code issues on the world group before running
    it, so mismatched ops or shapes fail at once on every rank (a
    `CollectiveMismatch` naming what each rank called) instead of hanging
    or, on gloo, silently succeeding; ~1 ms per collective. False gives that
    protection up (see workbench/pool/collective_check.py for why this is
    not torch's TORCH_DISTRIBUTED_DEBUG=DETAIL, which env= can still set).
    backend_setup: "module:function" run on every rank before the world
    starts; it returns the torch.distributed backend name to use (the
    Workbench passes its recording backend this way). standby: keep the next
    session's local ranks spawned and prepared (torch and `preload`
    imported, idle, using no CPU), so that `restart()` only has to connect
    them (about a second instead of a cold start); they cost the memory of
    one more set of idle ranks (`pool.standby` shows it), so False turns it
    off on tight machines (None: on where ranks are spawned, unless
    $WORKBENCH_STANDBY is 0; off where they are forked from a zygote,
    `workbench.pool.zygote`, since a fork starts as fast as a standby). Where
    ranks are forked, standby also means the user's standby
    (`workbench.pool.user_standby`): the process they are forked from
    outlives this kernel, so the next kernel's first pool forks at once too;
    False keeps them to a zygote of this process's own (None: on unless
    $WORKBENCH_STANDBY is 0). `pool.ranks_from` says which.
    """

    def __init__(self, world_size: int, *, device: Device = "auto", timeout_s: float = 300.0,
                 check_collectives: bool = True, threads_per_rank: int | None = None, bind: str = "127.0.0.1",
                 port: int = 0, external: bool = False, key_file: str | None = None,
                 heartbeat_timeout_s: float = 10.0, start_timeout_s: float = 120.0, preload: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, on_output: Callable[[int, str, str], None] | None = None,
                 backend_setup: str | None = None, frozen_after_s: float = 2.0,
                 explain: Explain | None = None, standby: bool | None = None) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size: must be a positive integer, got {world_size!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: {device!r} is not one of 'auto', 'cpu', 'cuda'")
        for name, value in (("timeout_s", timeout_s), ("frozen_after_s", frozen_after_s),
                            ("heartbeat_timeout_s", heartbeat_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name}: must be positive, got {value}")
        if external and key_file is None:
            key_file = os.path.expanduser("~/.workbench/pool.key")
        self.world_size, self.device_request = world_size, device
        self.external, self.start_timeout_s = external, start_timeout_s
        self._private_dir = private_dir.create()  # mode 0700: socket, store and key live here
        self.key_file = key_file or os.path.join(self._private_dir, "pool.key")
        self._key = launch.write_key_file(self.key_file)
        self._subscribers: list = []
        self._ids = itertools.count(1)
        threads = threads_per_rank or shared_threads(world_size)
        self._settings_base = {
            "device": device, "heartbeat_s": HEARTBEAT_S, "orphan_timeout_s": heartbeat_timeout_s,
            "pg_timeout_s": 2 * timeout_s + 30, "threads": threads_per_rank, "preload": list(preload),
            "check_collectives": check_collectives, "env": dict(env or {}), "backend_setup": backend_setup,
        }
        # Local ranks reach the notebook through a unix socket in the private directory: no TCP port at all.
        endpoint = f"tcp://{bind}:{port}" if external else f"unix://{self._private_dir}/control.sock"
        limits = Limits(timeout_s, heartbeat_timeout_s, frozen_after_s=frozen_after_s)
        self._transport = Transport(self._key, endpoint, limits, on_output or _default_output, self._subscribers,
                                    explain)
        # Local ranks get what to prepare and the environment at spawn (torch reads it when imported), so a
        # standby can prepare before its session exists. Loopback only: gloo and NCCL never listen elsewhere.
        # What the ranks measure about the machine is kept for every later rank of the user (machine.machine_fact).
        self._facts = _facts_folder(self._private_dir)
        rank_env, prepare = _local_rank_setup(self._settings_base, threads, env, self._facts, self._private_dir)
        # CPU ranks fork from a zygote that holds what they import: the user's standby, which outlives this
        # process (the next kernel forks at once too), or one of this process's own (shared by its pools). A
        # restart and the next pool start in a tenth of a second instead of a cold start.
        wanted = os.environ.get("WORKBENCH_STANDBY", "1") != "0" if standby is None else standby
        self._zygote = (zygotes.acquire(rank_env, prepare, standby=wanted)
                        if not external and zygotes.usable(device) else None)
        spawn = functools.partial(LocalRanks, self._transport.address, self.key_file, world_size, rank_env,
                                  self._transport.on_output, zygote=self._zygote, fork_timeout_s=start_timeout_s)
        # Forked ranks start as fast as a standby set's would: none is kept for them unless asked for.
        cohort = standby if standby is not None else wanted and self._zygote is None
        self._standby = Standby(spawn, enabled=cohort and not external)
        self._finalizer = weakref.finalize(self, _cleanup, self._transport, self._standby, self._private_dir,
                                           self._zygote)
        self.last_start: dict[str, float] = {}
        """Seconds each phase of the last start took (the slowest rank's): see `start_phases`."""
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the ranks of a fresh session: the standby's if there is one, else new ones (local pools);
        external pools wait for ranks to connect. Then the standby is refilled in the background."""
        t = self._transport
        settings = dict(self._settings_base, env=dict(self._settings_base["env"]))
        if self.external:
            settings["store"] = "env"
            t.new_session(self.world_size, settings, None)
            return
        settings["store"] = "file:" + os.path.join(self._private_dir, f"store-{secrets.token_hex(4)}")
        ranks = self._standby.take() or self._standby.spawn_now()
        with t.lock:  # a rank that knocks at once must find its session
            t.new_session(self.world_size, settings, ranks)
        ranks.activate()
        self.wait_ready(self.start_timeout_s)
        self.last_start = start_phases(ranks, t.ranks)
        self._standby.refill()

    @property
    def ranks_from(self) -> str:
        """Where local ranks come from: the user's standby (and, if it was started now, why the running one did
        not fit), this process's zygote, or fresh interpreters."""
        if self.external:
            return "ranks started elsewhere (external)"
        if self._zygote is None or not self._zygote.alive:
            return "spawned interpreters"
        return f"forked by {self._zygote.origin}"

    @property
    def standby(self) -> StandbyInfo:
        """The warm standby: ranks spawned and prepared ahead, so that `restart()` takes about a second; what
        they cost in memory. `Pool(..., standby=False)` turns it off for tight machines."""
        return self._standby.info()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every rank has connected and joined the world."""
        t = self._transport
        if not t.all_ready.wait(timeout):
            missing = sorted(set(range(self.world_size)) - {r for r, l in t.ranks.items() if l.ready})
            with t.owner.owning():
                t.break_pool(PoolError(f"ranks {missing} did not start within {timeout} s"))
        if t.startup_failure is not None:
            with t.owner.owning():
                t.break_pool(t.startup_failure)
        if t.broken is not None:
            raise t.broken

    def restart(self) -> None:
        """Stop every rank and start a fresh world; rank state is lost (reload a checkpoint)."""
        self._transport.stop_session("the pool is restarting")
        self.start()

    def close(self) -> None:
        """End every rank (within a few seconds, whatever they are doing) and release the port."""
        self._finalizer()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands ----------------------------------------------------------------------------------
    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list:
        """Run fn(*args, **kwargs) on every rank; the results in rank order."""
        return self.run_async(fn, *args, **kwargs).result()

    def run_async(self, fn: Callable, *args: Any, **kwargs: Any) -> Handle:
        """Start fn on every rank and return at once; commands run on the ranks one after another."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if self.external and not self._transport.all_ready.is_set():
            self.wait_ready(self.start_timeout_s)
        command = Command(next(self._ids), set(range(self.world_size)), getattr(fn, "__qualname__", repr(fn)))
        # The call travels as its own pickle inside the message, so a rank that cannot unpickle it (a module
        # it cannot import) answers with an error for this command instead of dying.
        call = protocol.dumps_code((fn, args, kwargs))
        self._transport.submit(command, {"type": "call", "id": command.id, "call": call})
        return Handle(command, self.world_size, self._transport.wait)

    def set_flag(self, name: str, value: Any) -> None:
        """Set `workbench.pool.rank.flag(name)` on every rank, even while a command is running."""
        self._transport.control({"type": "flag", "name": name, "value": value})

    def subscribe(self, callback: Callable[[int, Any], None]) -> Callable[[], None]:
        """Call callback(rank, event) for each `rank.emit(event)`; returns a function that unsubscribes.

        Callbacks run on the pool's I/O thread: keep them short (store and return).
        """
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    # -- limits ----------------------------------------------------------------------------------------
    @property
    def explain(self) -> Explain | None:
        """The summary of the ranks' diagnostics at the top of a hang's error (see the class docstring)."""
        return self._transport.explain

    @explain.setter
    def explain(self, fn: Explain | None) -> None:
        self._transport.explain = fn

    @property
    def timeout_s(self) -> float:
        """Seconds a rank may run a command without a sign of progress before it is declared stuck."""
        return self._transport.limits.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.set_limits(timeout_s=value)

    def set_limits(self, **limits: float) -> None:
        """Change how soon trouble is declared, for the commands from now on: timeout_s, frozen_after_s,
        heartbeat_timeout_s (the world's own collective timeout, set when it started, stays)."""
        for name, value in limits.items():
            if name not in ("timeout_s", "frozen_after_s", "heartbeat_timeout_s"):
                raise ValueError(f"{name}: not a limit that can change (timeout_s, frozen_after_s, heartbeat_timeout_s)")
            if not value > 0:
                raise ValueError(f"{name}: must be positive, got {value}")
        self._transport.limits = dataclasses.replace(self._transport.limits, **limits)

    # -- introspection -----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self._transport.address

    @property
    def pids(self) -> list[int]:
        ranks = self._transport.ranks
        return [ranks[r].pid for r in sorted(ranks)]

    @property
    def broken(self) -> bool:
        return self._transport.broken is not None

    @property
    def broken_reason(self) -> str | None:
        b = self._transport.broken
        return None if b is None else str(b)

    @property
    def device(self) -> str:
        """"cpu" or "cuda" once ranks are up."""
        ranks = self._transport.ranks
        return ranks[0].device.split(":")[0] if 0 in ranks and ranks[0].ready else self.device_request

    @property
    def backend(self) -> str:
        ranks = self._transport.ranks
        return ranks[0].backend if 0 in ranks else ""

    @property
    def rejected_messages(self) -> int:
        """Control messages dropped because they failed authentication or replay checks."""
        return self._transport.rejected

    def launch_command(self, *, nnodes: int, nproc_per_node: int, host: str | None = None,
                       master_port: int = 29500) -> str:
        """The torchrun command to start this pool's ranks on other machines (external pools)."""
        port = self.address.rsplit(":", 1)[1]
        address = f"{host or self.address.rsplit(':', 1)[0]}:{port}"
        return launch.torchrun_command(address, self.key_file, nnodes=nnodes, nproc_per_node=nproc_per_node,
                                       master_port=master_port)

    def __repr__(self) -> str:
        state = f"broken: {self.broken_reason}" if self.broken else "healthy"
        standby = "" if self.external else f", {self.standby}"
        return f"Pool(world_size={self.world_size}, device={self.device!r}, backend={self.backend!r}, {state}{standby})"


def start_phases(ranks: LocalRanks, states: dict) -> dict[str, float]:
    """Seconds in each phase of a start, from the ranks' own timelines (the slowest rank's figure per phase).

    spawn: to the worker's first line (interpreter, the workbench package); torch: importing it; backend:
    the backend set-up (the recording backend's extension); preload: the modules the pool preloads; warm:
    torch._dynamo, imported by a first optimizer; standby: prepared, waiting for its session (0 when cold);
    connect: the handshake; join: the process group and the collective check; report: until the notebook knew.
    """
    phases: dict[str, list[float]] = {}
    for state in states.values():
        tl = state.timeline
        if not {"main", "warm", "connected", "joined"} <= tl.keys() or state.ready_at is None:
            continue
        go = max(tl.get("go", tl["warm"]), ranks.activated_at or 0.0, tl["warm"])
        points = [("spawn", ranks.spawned_at, tl["main"]), ("torch", tl["main"], tl["torch"]),
                  ("backend", tl["torch"], tl["backend"]), ("preload", tl["backend"], tl["preload"]),
                  ("warm", tl["preload"], tl["warm"]), ("standby", tl["warm"], go), ("connect", go, tl["connected"]),
                  ("join", tl["connected"], tl["joined"]), ("report", tl["joined"], state.ready_at)]
        for name, t0, t1 in points:
            phases.setdefault(name, []).append(max(0.0, t1 - t0))
    return {name: max(values) for name, values in phases.items()}


def _facts_folder(private: str) -> str:
    """The user's folder of machine facts (`runtime_dir`), or this pool's own where that one is unusable."""
    try:
        return str(runtime_dir.ensure("machine"))
    except (OSError, runtime_dir.RuntimeDirError) as e:
        log.warning("workbench pool: machine facts kept for this pool only (%s)", e)
        facts = os.path.join(private, "machine")
        os.mkdir(facts, 0o700)
        return facts


def _local_rank_setup(settings: dict[str, Any], threads: int, env: dict[str, str] | None, facts: str,
                      folder: str) -> tuple[dict[str, str], dict[str, Any]]:
    """A local rank's environment and what it prepares (`world.prepare`), for a pool with these settings."""
    prepare = {**{k: settings[k] for k in PREPARE_KEYS}, "threads": threads, "private_dir": folder}
    rank_env = rank_environment(threads, {**(env or {}), "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
                                          MACHINE_FACTS: facts, DRIVER_PID: str(os.getpid())}, prepare)
    return rank_env, prepare


def prepare_ahead(*, device: Device = "auto", preload: tuple[str, ...] = (), backend_setup: str | None = None,
                  env: dict[str, str] | None = None, standby: bool | None = None, wait_s: float = 0.0) -> bool:
    """Start preparing local ranks before a pool asks for them, as `Pool(n, device=, preload=, backend_setup=,
    env=, standby=)` prepares them: a zygote that later forks them at once (`workbench.pool.zygote`); with the
    standby (as Pool's), the user's standby, taken over if one runs. This process lets go of it
    `zygotes.LINGER_S` after this call unless a pool takes it. False where ranks are not forked (CUDA, or
    $WORKBENCH_ZYGOTE=0), or where `wait_s` > 0 and it was not prepared within `wait_s` seconds."""
    if not zygotes.usable(device):
        return False
    wanted = os.environ.get("WORKBENCH_STANDBY", "1") != "0" if standby is None else standby
    settings = {"device": device, "threads": None, "preload": list(preload), "backend_setup": backend_setup}
    zygote = zygotes.acquire(*_local_rank_setup(settings, 1, env, "", ""), standby=wanted)
    try:
        return zygote.wait_prepared(wait_s) if wait_s > 0 else True
    finally:
        zygotes.release(zygote)


def _cleanup(transport: Transport, standby: Standby, folder: str, forks: "zygote.Zygote | None") -> None:
    standby.close()
    transport.close()
    shutil.rmtree(folder, ignore_errors=True)
    if forks is not None:
        zygotes.release(forks)
