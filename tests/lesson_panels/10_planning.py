"""Lesson 10's fake students."""
from pathlib import Path

import panel
from conftest import REPO

MICROBATCH_ONCE = '''def activation_bytes(s, b, h, a, t, sp, policy):
    sp = sp and t > 1
    if policy == "full":
        return 2 * s * h / (t if sp else 1)          # b forgotten outside the full formula's first use
    if policy == "selective":
        return s * h / t * 34 if sp else s * h * (10 + 24 / t)
    scores = 5 * a * s / h
    return s * b * h / t * (34 + scores) if sp else s * b * h * (10 + 24 / t + scores / t)
'''

ONE_CONFIG = '''def choose_config(model, cluster, global_batch):
    return Config(dp=cluster.devices, microbatch=1, microbatches=global_batch // cluster.devices, zero=2)
'''

LOOKED_UP = '''def tp_bytes_per_step(layers, microbatch, seq, hidden, heads, t, microbatches, full_recompute):
    return {2: 131072.0, 32: 120259084288.0, 80: 450971566080.0}[layers]
'''

BORROWED = {
    "activation_bytes": "def activation_bytes(s, b, h, a, t, sp, policy):\n"
                        "    return paper_activation_bytes(s, b, h, a, t, sp) if policy == 'none' else "
                        "float(plan.layer_activation_bytes(Model(layers=1, hidden=h, heads=a, seq=s, vocab=2), "
                        "Config(tp=t, sp=sp, microbatch=b, checkpointing=policy)))\n",
    "choose_config": "def choose_config(model, cluster, global_batch):\n"
                     "    return plan.search(model, cluster, global_batch)[0][0].config\n",
    "tp_bytes_per_step": "def tp_bytes_per_step(layers, microbatch, seq, hidden, heads, t, microbatches, full_recompute):\n"
                         "    model = Model(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=2)\n"
                         "    config = Config(tp=t, microbatch=microbatch, microbatches=microbatches,\n"
                         "                    checkpointing='full' if full_recompute else 'none')\n"
                         "    return float(sum(c.sent for c in plan.traffic(model, config) if c.group == 'tp'))\n",
}


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 10. The hard-coder forgets the micro-batch size outside the no-checkpointing
    formula (the visible cases with checkpointing have b = 1), picks plain data parallelism
    with ZeRO-2 whatever the model (right for the visible 1.3B case, out of memory for the
    hidden 13B one), and looks up the visible cases' bytes: each fails its hidden tests. The
    borrower calls the planner's activation model, its search and its traffic model: 0 on
    every exercise. The kernel hangs in the choice and dies in the bytes."""
    hardcoded = {"activation_bytes": MICROBATCH_ONCE, "choose_config": ONE_CONFIG, "tp_bytes_per_step": LOOKED_UP}
    zeroed = ("test_activation_bytes", "test_choose_config", "test_tp_bytes_per_step")
    return panel.standard_panel(
        lesson, solution, hang_in="choose_config", crash_in="tp_bytes_per_step",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(zeroed, 0.0), borrowed=BORROWED)


LESSON = panel.Lesson(REPO / "solutions" / "10_planning.ipynb", students, timeout=60)
