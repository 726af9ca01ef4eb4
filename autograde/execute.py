"""Autograding execution that survives a student's kernel dying or ignoring interrupts.

nbgrader's `Execute` lets one cell fail by timeout (it interrupts the kernel), but a kernel
that dies (`os._exit`, a segfault, running out of memory) raises `DeadKernelError` out of
the whole notebook: nbgrader then drops the submission and every test scores 0. Here the
cell that killed the kernel is marked failed, a fresh kernel is started, the code cells
that had already run are run again silently (so the student's definitions exist again),
and execution goes on with the next cell. A kernel that still does not answer some
seconds after a timeout's interrupt is restarted the same way.
"""
from __future__ import annotations

import time
from queue import Empty

from jupyter_core.utils import ensure_async, run_sync
from nbclient.client import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from nbgrader.preprocessors import Execute
from traitlets import Integer

DIED = ("the kernel died while running this cell (os._exit, a crash, or out of memory). "
        "It was restarted, the cells above were run again, and grading went on from the next cell.")
STUCK = ("the kernel did not answer {grace} s after the timeout's interrupt. "
         "It was restarted, the cells above were run again, and grading went on from the next cell.")


class ResilientExecute(Execute):
    """nbgrader's Execute, plus: a dead or stuck kernel fails only the cell it was running."""

    interrupt_grace = Integer(
        30, help="Seconds a kernel may take to answer after a timeout's interrupt before it "
                 "is restarted (parakit needs a few to stop its worker ranks).").tag(config=True)
    max_restarts = Integer(
        5, help="Kernel restarts allowed per notebook; after that the cells left are "
                "marked failed without running.").tag(config=True)

    def preprocess(self, nb: NotebookNode, resources=None, km=None):
        NotebookClient.__init__(self, nb, km)
        self.reset_execution_trackers()
        self._check_assign_resources(resources)
        ran: list[int] = []      # code cells that completed, replayed after a restart
        index, restarts = 0, 0
        cells = self.nb.cells
        while index < len(cells):
            if restarts > self.max_restarts:
                for cell in cells[index:]:
                    if cell.cell_type == "code":
                        _fail(cell, "KernelRestartLimit",
                              f"not run: the kernel died or hung {restarts} times in this notebook")
                break
            with self.setup_kernel():
                info = self.wait_for_reply(self.kc.kernel_info())
                self.nb.metadata["language_info"] = info["content"]["language_info"]
                if restarts and not self._replay(ran):
                    restarts += 1
                    continue
                while index < len(cells):
                    cell, self._timed_out = cells[index], False
                    try:
                        self.preprocess_cell(cell, resources, index)
                    except DeadKernelError:
                        _fail(cell, "DeadKernelError", DIED)
                        index, restarts = index + 1, restarts + 1
                        break
                    except CellTimeoutError:  # the reply came, its outputs never finished
                        _fail(cell, "CellTimeoutError", f"no reply from the kernel within {self.timeout} s")
                        self._timed_out = True
                    index += 1
                    if self._timed_out and not self._answers_within(self.interrupt_grace):
                        _fail(cell, "UnresponsiveKernel", STUCK.format(grace=self.interrupt_grace))
                        self.shutdown_kernel = "immediate"
                        restarts += 1
                        break
                    if cell.cell_type == "code" and not self._timed_out:
                        ran.append(index - 1)
        self.set_widgets_metadata()
        return self.nb, self.resources

    def on_cell_executed(self, **kwargs):
        super().on_cell_executed(**kwargs)
        content = kwargs["execute_reply"]["content"]
        if content.get("status") == "error" and content.get("ename") == self.error_on_timeout.get("ename"):
            self._timed_out = True

    def _answers_within(self, seconds: float) -> bool:
        """True when the kernel replies to a kernel_info request on its shell channel in time."""
        try:
            return run_sync(self._async_reply)(self.kc.kernel_info(), seconds) is not None
        except DeadKernelError:
            return False

    def _replay(self, indices: list[int]) -> bool:
        """Run these cells again silently on a fresh kernel. A cell that kills or hangs the
        kernel again is dropped from `indices` and False returned (the caller restarts)."""
        for i in list(indices):
            msg_id = self.kc.execute(self.nb.cells[i].source, silent=True, store_history=False,
                                     stop_on_error=False)
            try:
                reply = run_sync(self._async_reply)(msg_id, self.timeout)
            except DeadKernelError:
                reply = None
            if reply is None:
                self.log.warning("Replaying cell %d after a kernel restart failed; skipping it", i)
                indices.remove(i)
                self.shutdown_kernel = "immediate"
                return False
        self.shutdown_kernel = "graceful"
        return True

    async def _async_reply(self, msg_id: str, seconds: float | None):
        """The shell reply to `msg_id`, or None after `seconds`. Raises DeadKernelError."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while deadline is None or time.monotonic() < deadline:
            try:
                msg = await ensure_async(self.kc.shell_channel.get_msg(timeout=1))
            except Empty:
                await self._async_check_alive()
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg
        return None


def _fail(cell: NotebookNode, ename: str, message: str) -> None:
    """Record an error output on `cell`, so nbgrader scores it as failed."""
    cell.setdefault("outputs", []).append(NotebookNode(
        output_type="error", ename=ename, evalue=message,
        traceback=[f"\x1b[0;31m{ename}\x1b[0m: {message}"]))
