"""The lessons' widget cells run headless (nbclient, no frontend, no PARAKIT_STATIC, as
nbgrader, nbconvert and papermill run a notebook), and the client never talks back mid-cell.

The cause this guards against: nbclient answers an `ipywidgets.Output` widget (what
`interact` draws into) by sending comm messages to the kernel on the shell channel while it
waits on that channel for the cell's reply; on a busy machine the reply then waited for the
cell's timeout. `viz.explore` uses no Output widget, so the client has nothing to send. The
verdict is those messages, which an Output widget's client sends at any load (checked), so
the test runs on the machine as it is, without busy loops of its own.
"""
from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO

CELLS = [  # the shapes of the lessons' explore calls: int sliders, a list, a printing draw
    "import matplotlib.pyplot as plt\nfrom parakit import viz",
    "viz.explore(lambda n: viz.ring_steps(n), n=(3, 8))",
    "viz.explore(viz.pipeline_schedule_figure, schedule=['interleaved', '1f1b', 'gpipe', 'zbh1', 'zbh2', 'zbv'], p=(2, 8), m=(8, 32), v=(2, 4))",
    "def bars(k):\n    print('k =', k)\n    plt.subplots(figsize=(3, 2))[1].bar(range(k + 1), range(k + 1))\n"
    "viz.explore(bars, k=(0, 16))",
    "viz.explore(viz.checkpoint_plan, n=(16, 64), segments=(4, 16))",
]
# Only a bound on a real hang: the verdict is the messages below, not the time. Cells take
# 0.1-3 s at idle and up to ~20 s beside two busy loops (the first, importing matplotlib); the
# kernel starts in 2-3 s idle, and took minutes beside the suite and four busy loops.
CELL_TIMEOUT = 300


def run_headless(nb) -> tuple[list[str], NotebookClient]:
    """Execute `nb`; return the types of the messages the client sent the kernel on the shell
    channel (a client that answers an Output widget sends comm messages there mid-cell)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PARAKIT_STATIC", "CI", "MPLBACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, startup_timeout=CELL_TIMEOUT, kernel_name="python3")
    sent = []
    with client.setup_kernel(env=env):
        send = client.kc.shell_channel.send
        client.kc.shell_channel.send = lambda msg: (sent.append(msg["header"]["msg_type"]), send(msg))[1]
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
    return sent, client


def test_widget_cells_run_headless_and_the_client_never_talks_back_mid_cell():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    sent, client = run_headless(nb)
    assert client.comm_objects == {}, "the client emulated an Output widget (it talks back on the shell channel)"
    assert sent == ["execute_request"] * len(CELLS), f"the client answered the kernel mid-cell: {sent}"
    for cell in nb.cells[1:]:
        kinds = [sorted(o.get("data", {})) for o in cell.outputs]
        assert kinds[0] == ["application/vnd.jupyter.widget-view+json", "text/plain"]  # the controls
        assert kinds[1] == ["image/png", "text/plain"]  # the figure, an ordinary output
        assert not any("<function" in str(o.get("data", {}).get("text/plain", "")) for o in cell.outputs)
    assert nb.cells[3].outputs[2]["data"]["text/plain"] == "k = 0"  # what draw printed
