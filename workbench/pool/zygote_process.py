"""The zygote itself: one process prepared as a local rank prepares, forking the pool's local ranks on request.

Run as `python -m workbench.pool.zygote_process FD` by `workbench.pool.zygote`, with FD its end of a private
socket pair (nothing listens). It prepares once (torch, the recording backend, the pool's preload, the
torch._dynamo warm-up: `world.prepare`), says so, then serves requests: each is a rank's arguments and
environment with three file descriptors that become its stdin, stdout and stderr. The child goes on as
`python -m workbench.pool.worker` would, finding everything already imported; the zygote reaps it and reports
how it ended. It exits when the notebook's end of the socket closes; its ranks then see their parent change
and end too, as they would on their notebook's death.

A fork copies only the thread that calls it, so the zygote forks only while it has one thread (it starts none:
torch's thread pools start with the first parallel op, gloo's with the first process group), and refuses a
request otherwise.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import traceback

from workbench.pool.process_name import name_process

REQUEST_BYTES = 1 << 20
"""The largest request (arguments and environment as JSON): a message the notebook sent, never a peer's."""


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    name_process("wb-zygote")
    try:
        from workbench.pool import world

        settings = json.loads(os.environ["WORKBENCH_PREPARE"])
        world.prepare(settings, 0, 1)
    except BaseException:  # noqa: BLE001 - said to the notebook, which spawns its ranks instead
        _send(sock, {"failed": traceback.format_exc()})
        os._exit(1)
    _send(sock, {"prepared": True})
    # A child's exit wakes the loop (SIGCHLD writes a byte to `wake`): idle, the zygote sleeps in select, as long
    # as its pools live, instead of polling for exits 20 times a second.
    wake = os.pipe()
    for fd in wake:
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake[1])
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock, wake[0]], [], [])
        if wake[0] in readable:
            while drained(wake[0]):
                pass
        reap(children, lambda pid, code: _send(sock, {"exit": pid, "code": code}))
        if sock not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, REQUEST_BYTES, 3)
        except OSError:
            data, fds = b"", []
        if not data:
            os._exit(0)  # the notebook's end closed
        request = json.loads(data)
        if len(fds) != 3 or thread_count() != 1:
            _send(sock, {"id": request["id"], "error": f"cannot fork: {len(fds)} descriptors, {thread_count()} threads"})
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            become_rank([sock, *wake], fds, request)
        for fd in fds:
            os.close(fd)  # the child's now: the notebook must see their ends close when the child exits
        children.add(pid)
        _send(sock, {"id": request["id"], "pid": pid})


def become_rank(own: list, fds: list[int], request: dict) -> None:
    """In the child: close what the zygote holds (`own`: its sockets, as objects, so that none is closed twice;
    its wake pipe and other descriptors, as numbers), its own session and standard streams, the rank's
    environment, then the worker's main. Never returns."""
    try:
        signal.set_wakeup_fd(-1)  # the zygote's way of hearing of exits is not the rank's
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for held in own:
            held.close() if hasattr(held, "close") else os.close(held)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        # Where the notebook is now, as a spawned rank would start: its relative paths and `python -m`'s first
        # import folder (the zygote's own start folder until now).
        if sys.path and sys.path[0] == os.getcwd():
            sys.path[0] = request["cwd"]
        os.chdir(request["cwd"])
        from workbench.pool import worker

        sys.argv = ["workbench.pool.worker", *request["args"]]
        worker.main(request["args"])  # ends the process itself
    except BaseException:  # noqa: BLE001 - the child must never return into the zygote's loop
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def reap(children: set[int], report) -> None:
    """Collect every child that has ended and `report(pid, exit code)` it."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        report(pid, os.waitstatus_to_exitcode(status))


def drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        os._exit(0)  # the notebook is gone


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


if __name__ == "__main__":
    main()
