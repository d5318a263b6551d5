"""What the dashboard's buttons share: one action at a time on a background thread, and a question before a
destructive one.

`ActionRunner` runs a button's work on a thread so the kernel stays free while the ranks apply a layout,
train, save or restart, and keeps what is running and how the last action ended for the status line. An
action's end is shown only if no newer action started since (a hung run that Restart interrupted must not
overwrite the restart's outcome). `Confirm` is the one-line question asked before discarding trained weights.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable

import ipywidgets as widgets


class ActionRunner:
    """Runs one action at a time on a thread; `changed()` is called whenever what is running changes."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self._changed = changed
        self.activity: str | None = None
        """What an action started and is still running, e.g. "applying dp2 …"."""
        self.outcome: tuple[bool, str] | None = None
        """(succeeded, message) of the last finished action."""
        self._token = 0  # identifies the latest action, so an older one's late end cannot overwrite it
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def begin(self, activity: str, force: bool = False) -> int | None:
        """Claim the runner for an action; None if another is running (unless `force`). Returns its token."""
        with self._lock:
            if self.activity is not None and not force:
                return None
            self._token += 1
            self.activity, self.outcome = activity, None
            token = self._token
        self._changed()
        return token

    def set_activity(self, token: int, activity: str) -> None:
        with self._lock:
            if token == self._token:
                self.activity = activity
        self._changed()

    def end(self, token: int, failure: str | None = None, done: str | None = None) -> None:
        with self._lock:
            if token != self._token:
                return
            self.activity = None
            self.outcome = (False, failure) if failure is not None else (True, done or "done")
        self._changed()

    def spawn(self, token: int, work: Callable[[], str]) -> threading.Thread:
        """Run `work` (which returns what to say when it is done) on a thread; its exception is said inline."""

        def run() -> None:
            try:
                done = work()
            except Exception as e:  # noqa: BLE001 - shown inline; the kernel stays free
                self.end(token, failure=f"{type(e).__name__}: {e}")
            else:
                self.end(token, done=done)

        thread = threading.Thread(target=run, daemon=True, name="workbench-ui-action")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return thread

    def wait(self, timeout: float | None = None) -> None:
        """Block until the actions started so far are done (for tests and scripts)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)


class Confirm:
    """A question with a red "yes" and a "cancel", hidden until asked; one question at a time."""

    def __init__(self) -> None:
        self.question = widgets.HTML()
        self.yes = widgets.Button(button_style="danger", layout=widgets.Layout(width="auto"))
        self.cancel = widgets.Button(description="Cancel", layout=widgets.Layout(width="auto"))
        self.widget = widgets.HBox([self.question, self.yes, self.cancel],
                                   layout=widgets.Layout(display="none", align_items="center", grid_gap="8px"))
        self.widget.add_class("workbench-confirm")
        self._then: Callable[[], object] | None = None
        self.yes.on_click(lambda _: self._answer(True))
        self.cancel.on_click(lambda _: self._answer(False))

    @property
    def asking(self) -> bool:
        return self._then is not None

    def ask(self, question: str, yes: str, then: Callable[[], object]) -> None:
        """Show `question`; `then()` runs if the user presses the button labelled `yes`."""
        self._then = then
        self.question.value = f"<span style='color:#b00020'>⚠ {html.escape(question)}</span>"
        self.yes.description = yes
        self.widget.layout.display = "flex"

    def _answer(self, yes: bool) -> None:
        then, self._then = self._then, None
        self.widget.layout.display = "none"
        if yes and then is not None:
            then()
