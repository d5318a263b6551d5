"""What tests that start processes of their own share: a free loopback port, and collecting what those processes
printed without ever leaving one running."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outputs_of(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each process's output once it ends; one still running after `timeout` s is killed (and its output kept), so a
    hung launch fails its test instead of outliving it. Return codes are the caller's to check."""
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
    return outputs
