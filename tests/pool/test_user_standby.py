"""The user's standby (workbench/pool/user_standby.py, standby_process.py): the next kernel forks from it and
finds nothing of the last; a kernel prepared differently gets its own and is told why; a stranger on its socket
gets nowhere; and killing the kernel or the standby at any stage leaves no process behind once the standby's
idle timeout has passed. Every bound below is a hang bound: no test depends on a speed."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pickle
import queue
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from workbench.pool import protocol, runtime_dir, standby_wire as wire, user_standby

pytestmark = [pytest.mark.processes, pytest.mark.mostly_waits, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def folder(monkeypatch):
    """A runtime folder of the test's own (short: a Unix socket's path is at most 107 bytes), emptied after."""
    path = tempfile.mkdtemp(prefix="wbsb-")
    monkeypatch.setenv(runtime_dir.ENV, path)
    yield path
    for pid in user_standby.stop():
        _wait(lambda: not _alive(pid), 10)
    leftover = _ours(path)
    for proc in leftover:  # a failed test must not leave processes for the next ones
        proc.kill()
    shutil.rmtree(path, ignore_errors=True)
    assert not leftover, f"left running: {leftover}"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ours(folder: str) -> list[psutil.Process]:
    """Every live process started for this runtime folder: drivers, the standby, ranks (they carry it in their
    environment)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.status() != psutil.STATUS_ZOMBIE and \
                    proc.environ().get(runtime_dir.ENV) == folder:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


SECRET_VARIABLE = "WB_TEST_A_KERNELS_OWN_TOKEN"


def _driver(folder: str, hold: str, *preload: str, idle_s: float = 60) -> subprocess.Popen:
    env = {**os.environ, runtime_dir.ENV: folder, "WORKBENCH_STANDBY_IDLE_S": str(idle_s), SECRET_VARIABLE: "x"}
    driver = subprocess.Popen([sys.executable, "-m", "tests.pool.standby_driver", hold, *preload], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    driver.lines = queue.Queue()  # read by a thread: a buffered readline may hold a second line select cannot see
    threading.Thread(target=lambda: [driver.lines.put(line) for line in driver.stdout] + [driver.lines.put("")],
                     daemon=True).start()
    return driver


def _said(driver: subprocess.Popen, timeout_s: float = 120) -> dict:
    try:
        line = driver.lines.get(timeout=timeout_s)
    except queue.Empty:
        driver.kill()
        pytest.fail(f"the driver said nothing within {timeout_s} s")
    if not line:
        pytest.fail(f"the driver ended (code {driver.wait()}):\n{driver.stderr.read()[-3000:]}")
    return json.loads(line)


def _finish(driver: subprocess.Popen) -> str:
    driver.wait(60)
    err = driver.stderr.read()
    assert driver.returncode == 0, err[-3000:]
    return err


def _standby_pid(folder: str) -> int | None:
    found = list(Path(folder).glob("standby-*.json"))
    return json.loads(found[0].read_text())["pid"] if found else None


def test_the_next_kernel_forks_from_the_standby_and_finds_nothing_of_the_last(folder):
    first_driver = _driver(folder, "close")
    first = _said(first_driver)
    _finish(first_driver)
    standby = first["standby"]
    assert first["from"].startswith("forked by the user's standby")
    assert {r["ppid"] for r in first["ranks"]} == {standby}
    assert _alive(standby), "the standby outlives the kernel that started it"
    # Its socket is the user's alone, in a folder that is too; it listens on nothing beyond the machine.
    sock = next(Path(folder).glob("standby-*.sock"))
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600 and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    process = psutil.Process(standby)
    inet = getattr(process, "net_connections", getattr(process, "connections", None))("inet")
    assert inet == []
    # It keeps nothing of the kernel that started it beyond what preparing depends on: not its other variables.
    assert SECRET_VARIABLE not in process.environ() and "PATH" in process.environ()
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in Path(folder).glob("standby-*.*"))

    second_driver = _driver(folder, "close")
    second = _said(second_driver)
    _finish(second_driver)
    assert second["standby"] == standby and {r["ppid"] for r in second["ranks"]} == {standby}
    assert not {r["pid"] for r in first["ranks"]} & {r["pid"] for r in second["ranks"]}
    # The first kernel's ranks kept a secret in their state and in a module: the next kernel's ranks, forked from
    # the standby's prepared state, find neither.
    assert [r["found"] for r in second["ranks"]] == [{"state": None, "module": None}] * 2

    assert user_standby.stop() == [standby]
    assert _wait(lambda: not _ours(folder), 10), _ours(folder)


def test_a_kernel_prepared_differently_starts_its_own_standby_and_says_why(folder):
    first_driver = _driver(folder, "close")
    first = _said(first_driver)
    _finish(first_driver)
    other_driver = _driver(folder, "close", "json")  # its ranks preload a module: another prepared state
    other = _said(other_driver)
    err = _finish(other_driver)
    assert other["standby"] != first["standby"] and {r["ppid"] for r in other["ranks"]} == {other["standby"]}
    assert f"the standby pid {first['standby']} was prepared for other ranks: preload=[] (this kernel: ['json'])" \
        in err
    assert "(new: the standby pid" in other["from"]
    assert sorted(s["pid"] for s in user_standby.running()) == sorted([first["standby"], other["standby"]])


def test_the_standby_make_lab_prepares_is_the_one_a_kernels_first_workbench_forks_from(folder):
    """`make lab` runs `python -m workbench --prepare-ahead` while JupyterLab starts: it returns once the standby is
    prepared, and the standby is the one a Workbench in a Jupyter kernel of the same environment takes."""
    env = {**os.environ, runtime_dir.ENV: folder, "WORKBENCH_STANDBY": "1"}
    done = subprocess.run([sys.executable, "-m", "workbench", "--prepare-ahead"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "ranks prepared for the first Workbench" in done.stdout, done.stdout + done.stderr
    standby = _standby_pid(folder)
    assert standby and _alive(standby), "it outlives the command"
    assert json.loads(next(Path(folder).glob("standby-*.json")).read_text()).get("preparation"), "prepared"

    import nbformat
    from nbclient import NotebookClient

    cell = ("import workbench as wb\nbench = wb.Workbench(2)\nbench.apply(wb.Config(dp=2))\n"
            "print(bench.pool.ranks_from)\nbench.close()")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    NotebookClient(nb, timeout=180, kernel_name="python3").execute(env=env)
    printed = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.output_type == "stream")
    assert printed.strip() == f"forked by the user's standby, pid {standby}", nb.cells[0].outputs

    off = subprocess.run([sys.executable, "-m", "workbench", "--prepare-ahead"], cwd=ROOT,
                         env={**env, "WORKBENCH_STANDBY": "0"}, capture_output=True, text=True, timeout=60)
    assert off.returncode == 0 and "no ranks prepared ahead ($WORKBENCH_STANDBY=0)" in off.stdout
    assert subprocess.run([sys.executable, "-m", "workbench"], cwd=ROOT, env=env, capture_output=True,
                          timeout=60).returncode == 2

    def cli(flag: str) -> str:
        done = subprocess.run([sys.executable, "-m", "workbench", flag], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
        # Nothing on stderr: no runpy warning, as `python -m` of a module the package itself imports gave one.
        assert done.returncode == 0 and not done.stderr, done.stderr
        return done.stdout

    assert f"pid {standby}, up" in cli("--standbys")
    assert cli("--stop-standbys").startswith(f"ended: [{standby}]")
    assert not _alive(standby) and cli("--standbys") == ""


@pytest.mark.parametrize("victim", ["kernel", "standby"])
@pytest.mark.parametrize("stage", ["preparing", "idle", "busy"])
def test_killing_the_kernel_or_the_standby_at_any_stage_leaves_nothing_running(folder, victim, stage):
    driver = _driver(folder, "idle" if stage == "preparing" else stage, idle_s=3)
    if stage == "preparing":  # the standby has started (it says who it is first) and is importing torch
        assert _wait(lambda: _standby_pid(folder) is not None, 60)
        os.kill(driver.pid if victim == "kernel" else _standby_pid(folder), signal.SIGKILL)
        if victim == "standby":  # the kernel's ranks come from elsewhere, and work
            said = _said(driver)
            assert not said["from"].startswith("forked by the user's standby"), said
            assert _said(driver) == {"holding": "idle"}
    else:
        said = _said(driver)
        assert _said(driver) == {"holding": stage}
        ranks = [r["pid"] for r in said["ranks"]]
        os.kill(driver.pid if victim == "kernel" else said["standby"], signal.SIGKILL)
        # A rank ends with its kernel (its stdin and connection close) and with the standby (its parent changes).
        assert _wait(lambda: not any(_alive(p) for p in ranks), 30), "a rank outlived its kernel or its standby"
    if victim == "standby":
        driver.kill()
    driver.wait(30)
    # The standby that outlives a killed kernel ends at its idle timeout (3 s here): then nothing is left.
    assert _wait(lambda: not _ours(folder), 60), _ours(folder)


HANDSHAKE_S = 3.0
"""The stranger drill's standby closes silent connections after this (10 s by default): what it shows is that
they are closed at the bound, whatever the bound."""


def test_a_stranger_on_the_socket_gets_nowhere_and_costs_bounded_memory_and_time(folder, tmp_path, monkeypatch):
    monkeypatch.setenv(wire.HANDSHAKE_ENV, str(HANDSHAKE_S))
    driver = _driver(folder, "close")
    standby = _said(driver)["standby"]
    _finish(driver)
    path = str(next(Path(folder).glob("standby-*.sock")))
    descriptors = len(os.listdir(f"/proc/{standby}/fd"))

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        return sock

    def closed_by_standby(sock: socket.socket, within_s: float = 15) -> bool:
        ready = select.select([sock], [], [], within_s)[0]
        return bool(ready) and sock.recv(1 << 16) == b""

    big = connect()
    big.send(b"x" * (wire.UNAUTHENTICATED_BYTES + 1))  # more than a stranger may send
    assert closed_by_standby(big)
    noise = connect()
    noise.send(b"GET / HTTP/1.1\r\n\r\n")
    assert closed_by_standby(noise)
    passing = connect()
    r, w = os.pipe()
    socket.send_fds(passing, [wire.knock("0" * 32)], [r, w])  # descriptors before proving anything
    assert closed_by_standby(passing)
    os.close(r)
    os.close(w)
    # A knock is answered; a hello signed with another key, carrying a pickle that would write a file when
    # unpickled, is refused unread.
    forger = connect()
    forger.send(wire.knock("1" * 32))
    assert select.select([forger], [], [], 15)[0] and forger.recv(1 << 16)
    planted = tmp_path / "planted"

    class Plant:
        def __reduce__(self):
            return (open, (str(planted), "w"))

    forged = protocol.Signer(protocol.new_key(), "kernel", "guess").seal_payload(pickle.dumps({"x": Plant()}))
    forger.send(forged)
    assert closed_by_standby(forger)
    assert not planted.exists()
    # Strangers that crowd in: beyond MAX_STRANGERS each is closed as it comes; the silent ones at HANDSHAKE_S.
    crowd = [connect() for _ in range(wire.MAX_STRANGERS + 4)]
    t0 = time.monotonic()
    assert all(closed_by_standby(s, HANDSHAKE_S + 20) for s in crowd)
    print(f"the crowd of {len(crowd)} closed within {time.monotonic() - t0:.1f} s")
    for sock in (big, noise, passing, forger, *crowd):
        sock.close()
    assert _wait(lambda: len(os.listdir(f"/proc/{standby}/fd")) <= descriptors, 10), "descriptors kept"
    # The standby was not disturbed: the next kernel still forks from it.
    after = _driver(folder, "close")
    assert _said(after)["standby"] == standby
    _finish(after)


# -- pure ------------------------------------------------------------------------------------------------
def test_the_runtime_folder_must_be_the_users_alone(monkeypatch, tmp_path):
    monkeypatch.setenv(runtime_dir.ENV, str(tmp_path / "rt"))
    assert stat.S_IMODE(runtime_dir.ensure("machine").stat().st_mode) == 0o700
    os.chmod(tmp_path / "rt", 0o755)
    with pytest.raises(runtime_dir.RuntimeDirError, match="open to other users .* chmod 700"):
        runtime_dir.ensure()
    (tmp_path / "link").symlink_to(tmp_path / "rt")
    monkeypatch.setenv(runtime_dir.ENV, str(tmp_path / "link"))
    with pytest.raises(runtime_dir.RuntimeDirError, match="not a folder"):
        runtime_dir.ensure()


def test_a_fingerprint_holds_what_the_prepared_state_depends_on_and_says_what_differs():
    prepare = {"device": "cpu", "preload": [], "backend_setup": None, "threads": 1, "private_dir": "/x"}
    base = user_standby.fingerprint({"HOME": "/a", "TERM": "xterm"}, prepare)
    # What a rank gets after the fork (its threads, its pool's folder, unrelated variables) makes no difference.
    assert user_standby.fingerprint({"HOME": "/a", "JPY_SESSION_NAME": "x.ipynb"},
                                    {**prepare, "threads": 4, "private_dir": "/y"}) == base
    assert user_standby.fingerprint({"HOME": "/b"}, prepare) != base  # caches live under it
    tuned = user_standby.fingerprint({"HOME": "/a", "OMP_SCHEDULE": "static", "TORCH_LOGS": "+dynamo"}, prepare)
    assert tuned != base
    other = {**base, "torch": "2.0.0", "prepare": {**base["prepare"], "device": "auto"}}
    said = user_standby._differences(other, base)
    assert f"torch 2.0.0 (this kernel: {base['torch']})" in said and "device='auto' (this kernel: 'cpu')" in said
    assert "another environment (OMP_SCHEDULE, TORCH_LOGS)" in user_standby._differences(tuned, base)
    # torch's version, read from its files without importing it: what its package metadata says.
    assert base["torch"] == importlib.metadata.version("torch") != ""


def test_an_edit_to_the_source_makes_another_standby(monkeypatch, tmp_path):
    (tmp_path / "workbench").mkdir()
    source = tmp_path / "workbench" / "a.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(user_standby.launch, "package_root", lambda: str(tmp_path))
    before = user_standby.source_stamp()
    os.utime(source, ns=(1, 1))
    assert user_standby.source_stamp() != before
