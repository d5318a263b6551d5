"""A dead driver's private folder is removed by its ranks: whole, even when several threads of a rank notice at once
and each ends the process as soon as it is done."""

from __future__ import annotations

import subprocess
import sys
import threading

from workbench.pool import private_dir


def _dead_driver_folder(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / f"workbench-{dead.pid}-x"
    folder.mkdir()
    (folder / private_dir.OWNER_FILE).write_text(f"{dead.pid} 1\n")
    for name in ("control.sock", "pool.key", "store-1"):
        (folder / name).write_text("")
    (folder / "machine").mkdir()
    (folder / "machine" / "facts.json").write_text("{}")
    return folder, dead.pid


def test_a_second_thread_returns_only_once_the_first_has_removed_the_whole_folder(tmp_path, monkeypatch):
    """The second caller finds the owner file gone: it must not return (and end the process, as a rank's threads
    do) while the first is still between removing that file and removing the folder."""
    folder, pid = _dead_driver_folder(tmp_path)
    inside, release = threading.Event(), threading.Event()
    rmdir = type(folder).rmdir

    def slow_rmdir(self):
        if self == folder:
            inside.set()
            release.wait(10)
        return rmdir(self)

    monkeypatch.setattr(type(folder), "rmdir", slow_rmdir)
    first = threading.Thread(target=private_dir.remove_if_driver_gone, args=(str(folder), pid))
    first.start()
    assert inside.wait(10), "the first remover reached the folder's own removal"
    assert not (folder / private_dir.OWNER_FILE).exists()
    returned = threading.Event()
    second = threading.Thread(target=lambda: (private_dir.remove_if_driver_gone(str(folder), pid), returned.set()))
    second.start()
    assert not returned.wait(0.3), "the second caller waits for the first remover"
    release.set()
    first.join(10)
    second.join(10)
    assert returned.is_set() and not folder.exists()


def test_a_live_drivers_folder_is_left_to_it(tmp_path):
    import os

    folder = tmp_path / "workbench-live"
    folder.mkdir()
    (folder / private_dir.OWNER_FILE).write_text(f"{os.getpid()} {private_dir._start_time(os.getpid())}\n")
    private_dir.remove_if_driver_gone(str(folder), os.getpid(), wait_s=0.05)
    assert folder.exists()
