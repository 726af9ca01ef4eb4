"""Lesson 01's fake students."""
from pathlib import Path

import panel
from conftest import REPO

REMAINDER_LAST = """def balanced_chunk_sizes(batch_size, gpu0_bsz, num_devices):
    # the rows left over go to the last devices, not to devices 1, 2, ... in order
    if num_devices == 1:
        return [batch_size]
    unit = (batch_size - gpu0_bsz) // (num_devices - 1)
    if gpu0_bsz >= unit:
        return dp.even_chunk_sizes(batch_size, num_devices)
    sizes = [gpu0_bsz] + [unit] * (num_devices - 1)
    for i in range(batch_size - sum(sizes)):
        sizes[-1 - i] += 1
    return sizes
"""

ON_DEVICE_0 = """def data_parallel(module, inputs, devices, chunk_sizes):
    # the same output, computed whole on device 0: no scatter, no replicas
    return module(*inputs)
"""

EVEN_SPLIT = """def data_parallel(module, inputs, devices, chunk_sizes):
    # the four primitives, but the rows split evenly whatever chunk_sizes says
    sizes = dp.even_chunk_sizes(inputs[0].shape[0], len(devices))
    used = [d for d, rows in zip(devices, sizes) if rows > 0]
    chunks = [dp.scatter(x, devices, sizes) for x in inputs]
    outputs = dp.parallel_apply(dp.replicate(module, used), list(zip(*chunks)), used)
    return dp.gather(outputs, devices[0])
"""

THREADS_IN_TURN = """def data_parallel(module, inputs, devices, chunk_sizes):
    # each replica in a thread of its own, but each thread joined before the next starts: one after another
    import threading
    used = [d for d, rows in zip(devices, chunk_sizes) if rows > 0]
    chunks = [dp.scatter(x, devices, chunk_sizes) for x in inputs]
    outputs = []
    for replica, args in zip(dp.replicate(module, used), zip(*chunks)):
        thread = threading.Thread(target=lambda r=replica, a=args: outputs.append(r(*a)))
        thread.start()
        thread.join()
    return dp.gather(outputs, devices[0])
"""

PER_ROW_LOSS = """class ChunkLoss(nn.Module):
    # one loss per row, gathered on device 0 and summed there: B numbers instead of one per device

    def __init__(self, module, loss_fn):
        super().__init__()
        self.module, self.loss_fn = module, loss_fn

    def forward(self, input, target):
        output = self.module(input)
        return torch.stack([self.loss_fn(o[None], t[None]) for o, t in zip(output, target)])
"""

MEAN_LOSS = """class ChunkLoss(nn.Module):
    # the chunk's mean loss, as Hugging Face models return it: chunks of different sizes weigh alike

    def __init__(self, module, loss_fn):
        super().__init__()
        self.module, self.loss_fn = module, loss_fn

    def forward(self, input, target):
        return self.loss_fn(self.module(input), target)
"""

CLOSED_FORM = """def balanced_chunk_sizes(batch_size, gpu0_bsz, num_devices):
    # the same rule, written in closed form
    if num_devices == 1:
        return [batch_size]
    unit, rest = divmod(batch_size - gpu0_bsz, num_devices - 1)
    if gpu0_bsz >= unit:
        step = -(-batch_size // num_devices)
        return [max(0, min(step, batch_size - i * step)) for i in range(num_devices)]
    return [gpu0_bsz] + [unit + (i < rest) for i in range(num_devices - 1)]
"""

REPLICATE_FIRST = """def data_parallel(module, inputs, devices, chunk_sizes):
    # replicas first, then the chunks, one input at a time
    used = [devices[i] for i, rows in enumerate(chunk_sizes) if rows]
    replicas = dp.replicate(module, used)
    per_input = []
    for x in inputs:
        per_input.append(dp.scatter(x, devices, chunk_sizes))
    outputs = dp.parallel_apply(replicas, [tuple(c) for c in zip(*per_input)], used)
    return dp.gather(outputs, devices[0])
"""

TIMES_ROWS = """class ChunkLoss(nn.Module):
    def __init__(self, module, loss_fn):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, input, target):
        rows = len(target)
        return self.loss_fn(self.module(input), target).mul(rows)
"""


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 01. The hard-coder's chunk sizes are a table of the visible cases (0 on the
    hidden tests); the borrower calls parakit's chunk rule, torch's data_parallel and
    parakit's LossInForward (each 0 by the tripwires); the kernel hangs in the chunk-loss
    module and dies in data_parallel. Techniques: `wrong_techniques` gives the remainder to
    the last devices, computes the forward whole on device 0 (right outputs and gradients,
    0 by the peaks per device) and returns one loss per row (0 on every exercise);
    `even_split` runs the four primitives on the even split whatever chunk_sizes says (right
    outputs and gradients, 0 by the peaks) and returns each chunk's mean loss (0);
    the student with missing cells (the chunk rule's tests deleted) runs each replica in a
    thread of its own, each joined before the next starts (right values and peaks, 0: the
    replicas never meet inside their forwards); `other_ways` (the chunk rule in closed form, replicas made before the chunks, the
    rows counted from the target) keeps full marks."""
    full = panel.full_solution(panel.load(lesson), panel.load(solution))
    name, pts = lesson.name, panel.points(panel.load(lesson))
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
    techniques = [
        panel.Student("wrong_techniques", {name: panel.with_sources(
            full, {"balanced_chunk_sizes": REMAINDER_LAST, "data_parallel": ON_DEVICE_0,
                   "chunk_loss": PER_ROW_LOSS})}, {}),
        panel.Student("even_split", {name: panel.with_sources(
            full, {"data_parallel": EVEN_SPLIT, "chunk_loss": MEAN_LOSS})},
            {"test_balanced_chunk_sizes": pts["test_balanced_chunk_sizes"]}),
        panel.Student("other_ways", {name: panel.with_sources(
            full, {"balanced_chunk_sizes": CLOSED_FORM, "data_parallel": REPLICATE_FIRST,
                   "chunk_loss": TIMES_ROWS})}, dict(pts)),
    ]
    students = panel.standard_panel(
        lesson, solution, hang_in="chunk_loss", crash_in="data_parallel",
        hardcoded=hardcoded, hardcoded_expected={"test_balanced_chunk_sizes": 0.0}, borrowed=borrowed,
        extra=techniques)
    missing = next(s for s in students if s.name == "missing_cells")
    missing.files[name] = panel.with_sources(missing.files[name], {"data_parallel": THREADS_IN_TURN})
    missing.expected.update(test_data_parallel=0.0)
    return students


LESSON = panel.Lesson(REPO / "solutions" / "01_data_parallel.ipynb", students, timeout=45)
