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


# ---- wrong techniques: each 0 on its exercise

SCORES_FORGOTTEN = '''def activation_bytes(s, b, h, a, t, sp, policy):
    sp = sp and t > 1
    if policy == "full":
        return 2 * s * b * h / (t if sp else 1)
    return s * b * h / t * 34 if sp else s * b * h * (10 + 24 / t)   # the 5as/h attention scores never stored
'''

SP_NOT_SPLITTING = '''def activation_bytes(s, b, h, a, t, sp, policy):
    if policy == "full":
        return 2.0 * s * b * h                  # the checkpointed input kept whole under sp
    scores = 5 * a * s / h if policy == "none" else 0
    return s * b * h * (10 + 24 / t + scores / t)   # sp's split of the layer norms' and dropouts' 10 forgotten
'''

TOO_FEW_CONFIGS = '''def choose_config(model, cluster, global_batch):
    best = None
    for tp in (1, 2, 4, 8):   # data and tensor parallelism only: never a pipeline
        if cluster.devices % tp or tp > cluster.devices_per_node:
            continue
        dp = cluster.devices // tp
        if global_batch % dp:
            continue
        for policy in ("none", "selective", "full"):
            config = Config(dp=dp, tp=tp, sp=tp > 1, microbatch=1, microbatches=global_batch // dp, zero=1,
                            checkpointing=policy)
            if plan.problems(model, cluster, config) or not plan.memory(model, cluster, config).fits:
                continue
            seconds = plan.step_time(model, cluster, config).total
            if best is None or seconds < best[0]:
                best = (seconds, config)
    return best[1] if best else Config(dp=cluster.devices, microbatch=1, microbatches=global_batch // cluster.devices,
                                       zero=3, checkpointing="full")
'''

MEMORY_UNCHECKED = '''def choose_config(model, cluster, global_batch):
    best = None
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            if cluster.devices % (tp * pp) or tp > cluster.devices_per_node:
                continue
            dp = cluster.devices // (tp * pp)
            if global_batch % dp:
                continue
            for policy in ("none", "selective", "full"):
                config = Config(dp=dp, tp=tp, pp=pp, sp=tp > 1, microbatch=1, microbatches=global_batch // dp,
                                zero=1, checkpointing=policy)
                if plan.problems(model, cluster, config):   # the fastest, whether it fits or not
                    continue
                seconds = plan.step_time(model, cluster, config).total
                if best is None or seconds < best[0]:
                    best = (seconds, config)
    return best[1]
'''

ONE_ALL_REDUCE_PER_BLOCK = '''def tp_bytes_per_step(layers, microbatch, seq, hidden, heads, t, microbatches, full_recompute):
    calls = layers * microbatches * (3 if full_recompute else 2)   # one all-reduce forward, one backward, per layer
    return float(calls * 2 * (t - 1) / t * microbatch * seq * hidden * 2)
'''

RECOMPUTE_FORGOTTEN = '''def tp_bytes_per_step(layers, microbatch, seq, hidden, heads, t, microbatches, full_recompute):
    calls = layers * microbatches * 4   # the recomputed forward's two all-reduces forgotten
    return float(calls * 2 * (t - 1) / t * microbatch * seq * hidden * 2)
'''

# ---- right, written another way: full marks

ACTIVATIONS_BY_TERMS = '''def activation_bytes(s, b, h, a, t, sp, policy):
    sbh = s * b * h
    if policy == "full":
        return 2.0 * sbh / t if sp else 2.0 * sbh     # with t = 1, sp changes nothing: no guard needed
    scores = 5.0 * a * s / h if policy == "none" else 0.0
    if sp:                                            # every term split by t
        return sbh * (34.0 + scores) / t
    return sbh * 10.0 + sbh * (24.0 + scores) / t     # layer norms and dropouts whole, the rest split
'''

WIDER_SEARCH = '''def choose_config(model, cluster, global_batch):
    fitting = []
    n = cluster.devices
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if n % (tp * pp) or tp > cluster.devices_per_node:
                continue
            dp = n // (tp * pp)
            for microbatch in (1, 2):
                if global_batch % (dp * microbatch):
                    continue
                for zero in (1, 2, 3):
                    for policy in ("none", "selective", "full"):
                        config = Config(dp=dp, tp=tp, pp=pp, sp=tp > 1, microbatch=microbatch,
                                        microbatches=global_batch // (dp * microbatch), zero=zero, checkpointing=policy)
                        if not plan.problems(model, cluster, config) and plan.memory(model, cluster, config).fits:
                            fitting.append((plan.step_time(model, cluster, config).total, str(config), config))
    return min(fitting)[2]
'''

TP_BYTES_BY_CALL = '''def tp_bytes_per_step(layers, microbatch, seq, hidden, heads, t, microbatches, full_recompute):
    message = microbatch * seq * hidden * 2                 # [microbatch, seq, hidden] in 16 bits
    per_call = 2 * (t - 1) * message / t                    # a ring all-reduce: reduce-scatter + all-gather
    forward = 2 + (2 if full_recompute else 0)              # attention's and the MLP's, again when recomputed
    total = 0.0
    for _ in range(layers * microbatches):
        total += (forward + 2) * per_call
    return total
'''


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 10. The hard-coder forgets the micro-batch size outside the no-checkpointing
    formula (the visible cases with checkpointing have b = 1), picks plain data parallelism
    with ZeRO-2 whatever the model (right for the visible 1.3B case, out of memory for the
    hidden 13B one), and looks up the visible cases' bytes: each fails its hidden tests. The
    borrower calls the planner's activation model, its search and its traffic model: 0 on
    every exercise. The kernel hangs in the choice and dies in the bytes.

    Wrong techniques, each 0 on its exercise. `wrong_techniques`: the activations without the
    attention scores' 5as/h term; a search over data and tensor parallelism only (the 13B model
    needs a pipeline to be fast); one all-reduce per layer forward and one backward instead of two
    each. `wrong_techniques_2`: sequence parallelism that splits nothing more (the 10 of the layer
    norms and dropouts, and the checkpointed input, kept whole); the fastest configuration
    whether it fits or not (the hidden 40 GB cluster); full recomputation's forward all-reduces
    forgotten. Right, written another way (`right_another_way`, full marks): the activations as
    a sum of terms without the t > 1 guard (at t = 1 sp changes nothing); a wider search (pp 8,
    micro-batches of 2, ZeRO-3); the bytes summed call by call."""
    hardcoded = {"activation_bytes": MICROBATCH_ONCE, "choose_config": ONE_CONFIG, "tp_bytes_per_step": LOOKED_UP}
    zeroed = ("test_activation_bytes", "test_choose_config", "test_tp_bytes_per_step")
    full = panel.full_solution(panel.load(lesson), panel.load(solution))
    pts = panel.points(panel.load(lesson))

    def student(who, sources, zeroed=()):
        return panel.Student(who, {lesson.name: panel.with_sources(full, sources)}, {**pts, **dict.fromkeys(zeroed, 0.0)})

    return panel.standard_panel(
        lesson, solution, hang_in="choose_config", crash_in="tp_bytes_per_step",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(zeroed, 0.0), borrowed=BORROWED,
        extra=[student("wrong_techniques", {"activation_bytes": SCORES_FORGOTTEN, "choose_config": TOO_FEW_CONFIGS,
                                            "tp_bytes_per_step": ONE_ALL_REDUCE_PER_BLOCK}, zeroed),
               student("wrong_techniques_2", {"activation_bytes": SP_NOT_SPLITTING, "choose_config": MEMORY_UNCHECKED,
                                              "tp_bytes_per_step": RECOMPUTE_FORGOTTEN}, zeroed),
               student("right_another_way", {"activation_bytes": ACTIVATIONS_BY_TERMS, "choose_config": WIDER_SEARCH,
                                             "tp_bytes_per_step": TP_BYTES_BY_CALL})])


LESSON = panel.Lesson(REPO / "solutions" / "10_planning.ipynb", students, timeout=60)
