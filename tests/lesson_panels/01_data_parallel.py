"""Lesson 01's fake students."""
from pathlib import Path

import panel
from conftest import REPO


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 01. The hard-coder's chunk sizes are a table of the visible cases (0 on the
    hidden tests); the borrower calls parakit's chunk rule, torch's data_parallel and
    parakit's LossInForward (each 0 by the tripwires); the kernel hangs in the chunk-loss
    module and dies in data_parallel."""
    hardcoded = {
        "balanced_chunk_sizes": "def balanced_chunk_sizes(batch_size, gpu0_bsz, num_devices):\n"
                                "    return {(52, 16): [16, 18, 18], (53, 16): [16, 19, 18], (52, 0): [0, 26, 26],\n"
                                "            (52, 18): [18, 18, 16]}[(batch_size, gpu0_bsz)]\n",
    }
    borrowed = {
        "balanced_chunk_sizes": "def balanced_chunk_sizes(batch_size, gpu0_bsz, num_devices):\n"
                                "    return dp.balanced_chunk_sizes(batch_size, gpu0_bsz, num_devices)\n",
        "data_parallel": "def data_parallel(module, inputs, devices, chunk_sizes):\n"
                         "    return nn.parallel.data_parallel(module, tuple(inputs))\n",
        "chunk_loss": "class ChunkLoss(dp.LossInForward):\n    pass\n",
    }
    return panel.standard_panel(
        lesson, solution, hang_in="chunk_loss", crash_in="data_parallel",
        hardcoded=hardcoded, hardcoded_expected={"test_balanced_chunk_sizes": 0.0}, borrowed=borrowed)


LESSON = panel.Lesson(REPO / "solutions" / "01_data_parallel.ipynb", students, timeout=45)
