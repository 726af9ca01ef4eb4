"""Figures the lessons draw (matplotlib) and a widget helper that degrades to a static
figure where no notebook frontend runs (nbval, CI, HTML export).

Every figure is drawn from data the library computes or measures: the ring steps from
`comm.ring_schedule`, bytes from a `CommLog`, never from numbers typed into a lesson.
"""
from __future__ import annotations

import contextlib
import io
import os
from typing import Callable, Sequence

import matplotlib.pyplot as plt

from parakit import comm

PHASE_COLOURS = {"reduce-scatter": "#f4a261", "all-gather": "#2a9d8f"}


def ring_steps(n: int, *, ax=None):
    """Ring all-reduce on n ranks: one row per step, one column per rank; each cell names
    the chunk the rank sends to its right neighbour and the chunk it adds (reduce-scatter)
    or copies (all-gather) from what its left neighbour sends."""
    steps = comm.ring_schedule(n)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.3 * n + 2.5, 0.55 * len(steps) + 1.2))
    for row, (phase, moves) in enumerate(steps):
        for rank, (send, recv) in enumerate(moves):
            ax.add_patch(plt.Rectangle((rank, row), 0.94, 0.9, color=PHASE_COLOURS[phase]))
            verb = "add" if phase == "reduce-scatter" else "copy"
            ax.text(rank + 0.47, row + 0.45, f"send c{send} \u2192\n{verb} c{recv} \u2190", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, n)
    ax.set_ylim(len(steps), 0)
    ax.set_xticks([r + 0.47 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_yticks([s + 0.45 for s in range(len(steps))],
                  [f"{phase} {i % (n - 1) + 1}" for i, (phase, _) in enumerate(steps)])
    ax.set_title(f"ring all-reduce on {n} ranks: {len(steps)} steps, each rank sends 1/{n} of the tensor per step")
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    return ax.figure


def measured_vs_formula(xs: Sequence, measured: Sequence[float], predicted: Sequence[float], *,
                        xlabel: str, ylabel: str, title: str, ax=None):
    """Bars for what was measured, dots for what the formula predicts, at each x."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    positions = range(len(xs))
    ax.bar(positions, measured, width=0.6, color="#264653", label="measured")
    ax.plot(positions, predicted, "o", color="#e76f51", markersize=9, label="formula")
    ax.set_xticks(list(positions), [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return ax.figure


def static_only() -> bool:
    """True where widgets cannot be seen: PARAKIT_STATIC or CI set, or no IPython kernel."""
    if os.environ.get("PARAKIT_STATIC") or os.environ.get("CI"):
        return True
    try:
        from IPython import get_ipython
        import ipywidgets  # noqa: F401
    except ImportError:
        return True
    shell = get_ipython()
    return shell is None or not hasattr(shell, "kernel")


def explore(draw: Callable, **controls) -> None:
    """Sliders for `draw(**values)`: `controls` maps a name to (low, high[, step]) or a list.

    The controls are widgets; the figure `draw` makes (and what it prints) is an ordinary
    output of the cell, shown first at each control's first value (or low end) and replaced
    in place (`display_id`) when a control moves. No `ipywidgets.Output` or `interact` is
    used: a client that runs the notebook with no frontend (nbclient, as in nbconvert,
    papermill and nbgrader) answers an Output widget by sending comm messages to the kernel
    on the shell channel while it waits for the cell's reply there, and under load that reply
    can wait for the cell's timeout. Returns None, so no function's repr lands in the cell.

    Each control is labelled with its name. A value `draw` raises on shows "cannot draw ...:"
    and the error in place of the figure. Where no frontend can show widgets (see
    `static_only`), draws once at the first values; with PARAKIT_SWEEP set as well (the
    course's tests set it), then also at every value each control offers, the others at their
    first, and at all the last values, and raises if any of them raises.
    """
    first = {name: spec[0] for name, spec in controls.items()}
    if static_only():
        draw(**first)
        plt.show()
        if os.environ.get("PARAKIT_SWEEP"):
            _sweep(draw, controls)
        return None
    import ipywidgets
    from IPython.display import display

    widgets = {name: _widget(name, spec) for name, spec in controls.items()}
    display(ipywidgets.HBox(list(widgets.values())))
    figure, text = _drawn(draw, first)
    handles = [display(figure, display_id=True), display(text, raw=True, display_id=True)]

    def redraw(_change=None):
        figure, text = _drawn(draw, {name: w.value for name, w in widgets.items()})
        handles[0].update(figure)
        handles[1].update(text, raw=True)

    for w in widgets.values():
        w.observe(redraw, names="value")
    return None


def _offered(spec) -> list:
    """The values a control offers, for a sweep: a slider's ends and middle, a list's items."""
    if isinstance(spec, tuple):
        low, high = spec[0], spec[1]
        middle = low + (high - low) // 2 if isinstance(low, int) and isinstance(high, int) else (low + high) / 2
        return sorted({low, middle, high})
    return list(spec)


def _sweep(draw: Callable, controls: dict) -> None:
    """draw(**values) at each control's every value (the others at their first) and at all the
    last values, nothing shown; an AssertionError naming the values where one raises."""
    offered = {name: _offered(spec) for name, spec in controls.items()}
    first = {name: values[0] for name, values in offered.items()}
    cases = [{**first, name: v} for name, values in offered.items() for v in values[1:]]
    cases.append({name: values[-1] for name, values in offered.items()})
    with contextlib.redirect_stdout(io.StringIO()):
        for case in cases:
            before = set(plt.get_fignums())
            try:
                draw(**case)
            except Exception as error:
                raise AssertionError(f"explore: {getattr(draw, '__name__', 'draw')}({case}) raised "
                                     f"{type(error).__name__}: {error}") from None
            finally:
                for n in set(plt.get_fignums()) - before:
                    plt.close(n)


def _drawn(draw: Callable, values: dict):
    """(the figures `draw(**values)` made, as one PNG image, and what it printed as a
    text/plain bundle); the figures are closed, so nothing else shows them."""
    from IPython.display import Image

    before, printed = set(plt.get_fignums()), io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            draw(**values)
        except Exception as error:  # shown in place of the figure: a stale one would look like the answer
            for n in set(plt.get_fignums()) - before:
                plt.close(n)
            shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
            print(f"cannot draw {shown}: {type(error).__name__}: {error}")
    figures = [plt.figure(n) for n in plt.get_fignums() if n not in before]
    if len(figures) > 1:  # one image: stack them
        images = [_png(f) for f in figures]
        import matplotlib.image as mpimg
        import numpy as np

        arrays = [mpimg.imread(io.BytesIO(b)) for b in images]
        width = max(a.shape[1] for a in arrays)
        arrays = [np.pad(a, ((0, 0), (0, width - a.shape[1]), (0, 0)), constant_values=1.0) for a in arrays]
        buffer = io.BytesIO()
        plt.imsave(buffer, np.concatenate(arrays), format="png")
        png = buffer.getvalue()
    else:
        png = _png(figures[0]) if figures else b""
    for f in figures:
        plt.close(f)
    image = Image(data=png, format="png") if png else {"text/plain": "(no figure)"}
    return image, {"text/plain": printed.getvalue().rstrip("\n")}


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()


def _widget(name: str, spec):
    """The control for one of explore's `controls`, labelled with its name."""
    import ipywidgets

    label = {"description": name, "style": {"description_width": "initial"}}
    if isinstance(spec, tuple) and all(isinstance(v, int) for v in spec):
        low, high, *step = spec
        return ipywidgets.IntSlider(value=low, min=low, max=high, step=step[0] if step else 1, **label)
    if isinstance(spec, tuple):
        low, high, *step = spec
        return ipywidgets.FloatSlider(value=low, min=low, max=high, step=step[0] if step else (high - low) / 20,
                                      **label)
    return ipywidgets.Dropdown(options=list(spec), value=spec[0], **label)


# ---------------------------------------------------------------- lesson 01: DataParallel

DP_STEPS = [  # (step, what device 0 does, what every other device i does)
    ("scatter inputs", "keeps x[{rows}]", "receives x[{rows}]"),
    ("replicate model", "holds the parameters", "receives a copy of them"),
    ("parallel forward", "replica 0 on x[{rows}]", "replica {i} on x[{rows}]"),
    ("gather outputs", "receives all outputs", "sends its outputs"),
    ("loss", "loss on the whole batch", ""),
    ("backward", "grad of outputs[{rows}]", "receives grad of outputs[{rows}]"),
    ("reduce gradients", "sums every replica's grads", "sends its grads"),
    ("update", "optimizer.step()", ""),
]


def dp_flow(chunk_sizes: Sequence[int]):
    """One nn.DataParallel step on len(chunk_sizes) devices, row by row: what
    each device does with the rows `chunk_sizes` gives it. Device 0's extra work (gather,
    loss, reduce, update) is orange; idle cells are blank."""
    n, starts = len(chunk_sizes), [sum(chunk_sizes[:i]) for i in range(len(chunk_sizes))]
    fig, ax = plt.subplots(figsize=(2.6 * n + 1.8, 0.5 * len(DP_STEPS) + 1.0))
    for row, (step, first, other) in enumerate(DP_STEPS):
        for i in range(n):
            text = (first if i == 0 else other).format(i=i, rows=f"{starts[i]}:{starts[i] + chunk_sizes[i]}")
            if not text or not chunk_sizes[i] and "{rows}" in (first if i == 0 else other):
                continue
            extra = i == 0 and step in ("gather outputs", "loss", "reduce gradients", "update")
            ax.add_patch(plt.Rectangle((i, row), 0.95, 0.88, color="#e76f51" if extra else "#8ab17d"))
            ax.text(i + 0.47, row + 0.44, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, n)
    ax.set_ylim(len(DP_STEPS), 0)
    ax.set_xticks([i + 0.47 for i in range(n)], [f"device {i}\n{chunk_sizes[i]} rows" for i in range(n)])
    ax.set_yticks([r + 0.44 for r in range(len(DP_STEPS))], [s for s, _, _ in DP_STEPS])
    ax.set_title(f"one DataParallel step on {n} devices: one process, one thread per replica")
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def memory_bars(peaks: dict[str, Sequence[int]], *, title: str, ax=None):
    """Measured peak memory per device (KiB), one group of bars per device, one bar per
    variant (e.g. default, balanced, loss in forward); each bar labelled with its value."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    n, width = len(next(iter(peaks.values()))), 0.8 / len(peaks)
    colours = ["#264653", "#2a9d8f", "#e9c46a", "#e76f51"]
    for k, (name, values) in enumerate(peaks.items()):
        xs = [i + (k - (len(peaks) - 1) / 2) * width for i in range(n)]
        bars = ax.bar(xs, [v / 1024 for v in values], width=width, color=colours[k % len(colours)], label=name)
        ax.bar_label(bars, [f"{v / 1024:,.0f}" for v in values], fontsize=7)
    ax.set_xticks(range(n), [f"device {i}" for i in range(n)])
    ax.set_ylabel("peak KiB")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return ax.figure


# ---------------------------------------------------------------- lesson 02: DDP


def ddp_timeline(runs: dict[str, dict], *, title: str = "", ax=None):
    """Measured time lines of DDP steps on one rank, one row group per run: `runs` maps a
    name to {"backward": (start, end), "all_reduce": [(start, end), ...]} in ms from the
    start of backward. Backward is one bar, each bucket's all-reduce a bar on its own lane."""
    rows = sum(1 + len(run["all_reduce"]) for run in runs.values())
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.32 * rows + 1.4))
    labels, row = [], 0
    for name, run in runs.items():
        start, end = run["backward"]
        ax.barh(row, end - start, left=start, height=0.8, color="#264653")
        labels.append(f"{name}: backward")
        for k, (a, b) in enumerate(run["all_reduce"]):
            ax.barh(row + 1 + k, max(b - a, 0.02), left=a, height=0.8, color="#e76f51")
            labels.append(f"all-reduce {k}" if len(run["all_reduce"]) > 1 else "all-reduce")
        row += 1 + len(run["all_reduce"])
        ax.axhline(row - 0.5, color="#cccccc", linewidth=0.8)
    ax.set_yticks(range(rows), labels, fontsize=8)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlabel("ms from the start of backward")
    ax.set_title(title or "backward compute (dark) and all-reduces (orange), rank 0", fontsize=10)
    return ax.figure


def ddp_bucket_sweep(labels: Sequence[str], step_ms: Sequence[float], buckets: Sequence[int], *,
                     reference_ms: float | None = None, title: str = "", ax=None):
    """Measured step time (bars) and number of buckets (dots, right axis) per bucket size;
    a dashed line at `reference_ms` (torch's DDP on the same model) when given."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    positions = range(len(labels))
    ax.bar(positions, step_ms, width=0.6, color="#264653", label="step time")
    if reference_ms is not None:
        ax.axhline(reference_ms, color="#2a9d8f", linestyle="--", label="torch DDP")
    ax.set_xticks(list(positions), list(labels))
    ax.set_xlabel("bucket_size_mb")
    ax.set_ylabel("ms per step (median)")
    counts = ax.twinx()
    counts.plot(positions, buckets, "o", color="#e76f51", markersize=8)
    counts.set_ylabel("buckets = all-reduces per step", color="#e76f51")
    counts.set_ylim(0, max(buckets) * 1.15)
    ax.legend(loc="upper center", fontsize=8)
    ax.set_title(title, fontsize=10)
    return ax.figure


# ---------------------------------------------------------------- lesson 03: ZeRO

ZERO_KINDS = {"parameters": "#264653", "gradients": "#2a9d8f", "optimizer": "#e9c46a"}
ZERO_STAGES = ["baseline (DDP)", "ZeRO-1: optimizer state", "ZeRO-2: + gradients", "ZeRO-3 / FSDP: + parameters"]


def zero_stages(n: int = 4, k: int = 12):
    """What each of n ranks keeps at each stage, per parameter element: parameters (2 bytes),
    gradients (2) and optimizer state (K), as in the ZeRO paper's mixed precision. A sharded
    kind is filled only over the rank's own 1/n; its outline is the whole that DDP keeps."""
    from parakit.zero import zero_bytes

    whole = zero_bytes(1, 1, 0, k)
    fig, axes = plt.subplots(1, 4, figsize=(14, 0.45 * n + 1.6), sharey=True)
    for stage, ax in enumerate(axes):
        held = zero_bytes(1, n, stage, k)
        for rank in range(n):
            x = 0.0
            for kind, colour in ZERO_KINDS.items():
                width = whole[kind]
                ax.add_patch(plt.Rectangle((x, rank + 0.1), width, 0.8, fill=False, edgecolor=colour))
                start = x if held[kind] == width else x + width * rank / n
                ax.add_patch(plt.Rectangle((start, rank + 0.1), held[kind], 0.8, color=colour,
                                           label=kind if rank == 0 and stage == 0 else None))
                x += width
        ax.set_title(f"{ZERO_STAGES[stage]}\n{sum(held.values()):g} bytes per element on each rank", fontsize=9)
        ax.set_xlim(0, sum(whole.values()))
        ax.set_ylim(n, 0)
        ax.set_xlabel("bytes per parameter element")
    axes[0].set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)])
    fig.legend(loc="lower center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(f"N = {n} ranks, K = {k}: each rank fills its own 1/N of what is sharded", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def zero_memory_bars(measured: dict[int, Sequence[dict]], predicted: dict[int, dict], *, title: str, ax=None):
    """Measured bytes per rank (stacked by kind, one bar per rank) for each stage, and the
    formula's total per rank as a black line across the stage's bars."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.6))
    ticks = []
    for s, (stage, ranks) in enumerate(measured.items()):
        left = s * (len(ranks) + 1)
        for rank, held in enumerate(ranks):
            bottom = 0
            for kind, colour in ZERO_KINDS.items():
                ax.bar(left + rank, held[kind], bottom=bottom, color=colour, width=0.8,
                       label=kind if s == 0 and rank == 0 else None)
                bottom += held[kind]
        ax.hlines(sum(predicted[stage].values()), left - 0.45, left + len(ranks) - 0.55, color="black",
                  linewidth=2, label="formula" if s == 0 else None)
        ticks.append((left + (len(ranks) - 1) / 2, f"{ZERO_STAGES[stage]}\nranks 0..{len(ranks) - 1}"))
    ax.set_xticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=8)
    ax.set_ylabel("bytes held per rank")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax.figure


BYTE_UNITS = [(1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "bytes")]


def zero_calculator(params: float = 7.5e9, n: int = 64, k: int = 12, stage: int = 3, param_bytes: int = 2,
                    grad_bytes: int = 2) -> dict[int, float]:
    """Bytes per rank of parameters, gradients and optimizer state for a model of `params`
    parameters on n ranks at each stage (zero.zero_bytes), drawn as bars with `stage`
    outlined; returns each stage's total bytes per rank."""
    from parakit.zero import zero_bytes

    held = {s: zero_bytes(params, n, s, k, param_bytes, grad_bytes) for s in range(4)}
    scale, unit = next((v, u) for v, u in BYTE_UNITS if sum(held[0].values()) >= v or u == "bytes")
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for s in range(4):
        left = 0.0
        for kind, colour in ZERO_KINDS.items():
            ax.barh(s, held[s][kind] / scale, left=left, color=colour, label=kind if s == 0 else None,
                    edgecolor="black" if s == stage else None, linewidth=2 if s == stage else 0)
            left += held[s][kind] / scale
        ax.text(left, s, f"  {left:,.1f} {unit}", va="center", fontsize=9, fontweight="bold" if s == stage else None)
    ax.set_yticks(range(4), ZERO_STAGES, fontsize=8)
    ax.set_ylim(3.6, -0.6)
    ax.set_xlabel(f"{unit} per rank (parameters, gradients, optimizer state; no activations)")
    size = f"{params / 1e9:g} B" if params >= 1e9 else f"{params:,.0f}"
    ax.set_title(f"Ψ = {size} parameters, N = {n}, K = {k}, {param_bytes}+{grad_bytes} bytes "
                 f"per parameter and gradient", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_xlim(0, 1.25 * sum(held[0].values()) / scale)
    fig.tight_layout()
    return {s: sum(h.values()) for s, h in held.items()}


# ---------------------------------------------------------------- lesson 04: pipeline schedules

PIPELINE_COLOURS = {"F": "#2a9d8f", "B": "#e76f51", "W": "#8d99ae"}


def pipeline_gantt(timeline, *, title: str = "", unit: str = "time step", ax=None):
    """Gantt chart of a pipeline time line (`parakit.pipeline.simulate` or the runtime's
    measured events): one row per rank, a bar per forward (F), backward (B) and, in
    zero-bubble schedules, weight-gradient pass (W), labelled with its micro-batch, later
    chunks of interleaved and V schedules hatched; the rank's idle fraction at the right."""
    standalone = ax is None
    if standalone:
        _, ax = plt.subplots(figsize=(10, 0.5 * timeline.num_ranks + 1.3))
    t0, span = timeline.start, float(timeline.makespan)
    for e in timeline.compute:
        chunk = e.action.stage // timeline.num_ranks
        start, width = float(e.start - t0), float(e.end - e.start)
        ax.barh(e.rank, width, left=start, height=0.8, color=PIPELINE_COLOURS[e.action.op], edgecolor="white",
                hatch="//" if chunk % 2 else None)
        if width > span / 60:
            ax.text(start + width / 2, e.rank, str(e.action.microbatch), ha="center", va="center", fontsize=7, color="white")
    for r in range(timeline.num_ranks):
        ax.text(span * 1.01, r, f"idle {float(timeline.idle_fraction(r)):.0%}", va="center", fontsize=8)
    ax.set_yticks(range(timeline.num_ranks), [f"rank {r}" for r in range(timeline.num_ranks)])
    ax.set_ylim(timeline.num_ranks - 0.5, -0.5)
    ax.set_xlim(0, span * 1.1)
    ax.set_xlabel(unit)
    ax.set_title(title or f"bubble {float(timeline.bubble):.1%}, peak stored activations {timeline.peak_activations}",
                 fontsize=10)
    ops = ["F", "B"] + (["W"] if any(e.action.op == "W" for e in timeline.compute) else [])
    handles = [plt.Rectangle((0, 0), 1, 1, color=PIPELINE_COLOURS[op]) for op in ops]
    labels = ["forward", "backward" if len(ops) == 2 else "backward: input gradient (B)", "weight gradient (W)"][:len(ops)]
    if any(e.action.stage >= timeline.num_ranks for e in timeline.compute):
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="grey", hatch="//"))
        labels.append("odd chunk")
    ax.legend(handles=handles, labels=labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if standalone:
        ax.figure.tight_layout()
    return ax.figure


def pipeline_predicted_vs_measured(predicted, measured, *, title: str = ""):
    """The simulator's time line above the runtime's measured one, on the same time axis."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.0 * (predicted.num_ranks + measured.num_ranks) + 2.2),
                                      sharex=True)
    pipeline_gantt(predicted, ax=top, unit="seconds",
                   title=f"simulated with each F and B taking its measured time: bubble {float(predicted.bubble):.1%}")
    pipeline_gantt(measured, ax=bottom, unit="seconds",
                   title=f"measured by the runtime: idle {float(measured.bubble):.1%}")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def pipeline_schedule_figure(schedule: str = "1f1b", p: int = 4, m: int = 8, v: int = 2):
    """One schedule drawn from parakit's own schedule data (F = B = 1 time step per chunk,
    W = 1 where the backward is split), with its bubble next to the formula where there is
    one, and its peak stored activations per rank."""
    from parakit.pipeline import bubble_formula, build_schedule, simulate

    v = v if schedule == "interleaved" else None
    try:
        built = build_schedule(schedule, p, m, v)
        timeline = simulate(built)
    except ValueError as error:  # an impossible choice (1F1B with m < p, ...): say why instead of a chart
        fig, ax = plt.subplots(figsize=(10, 1.2))
        ax.axis("off")
        ax.text(0, 0.5, str(error), wrap=True, fontsize=9)
        return fig
    chunks = built.chunks
    if built.splits_backward:
        inside = max(timeline.idle_in_span(r) for r in range(p))
        formula = f"W fills waits: at most {float(inside):g} steps idle inside a rank's own span"
    else:
        formula = (f"formula (p-1)/({'v' if chunks > 1 else ''}m+p-1) = {float(bubble_formula(p, m, chunks)):.1%}")
    return pipeline_gantt(timeline, title=f"{schedule}, p={p}, m={m}" + (f", v={chunks}" if chunks > 1 else "") +
                          f": bubble {float(timeline.bubble):.1%} ({formula}), peak stored activations per rank "
                          f"{timeline.peak_activations}")


# ---------------------------------------------------------------- lesson 05: activation checkpointing

def checkpoint_plan(n: int = 16, segments: int = 4):
    """n layers in `segments` checkpointed segments (`checkpoint.segment_sizes`). Top: the
    activation after each layer, kept by the forward (segment inputs) or dropped and
    recomputed in the backward. Bottom: activations held at the peak, k + n/k, against k."""
    from parakit import checkpoint

    sizes = checkpoint.segment_sizes(n, segments)
    kept = {sum(sizes[:s]) for s in range(segments)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 4.6), gridspec_kw={"height_ratios": [1, 2.2]})
    for i in range(n + 1):
        colour = "#264653" if i in kept else ("#ffffff" if i < n else "#bbbbbb")
        top.add_patch(plt.Rectangle((i, 0), 0.9, 0.9, facecolor=colour, edgecolor="#264653",
                                    hatch=None if i in kept or i == n else "//"))
    for start in sorted(kept)[1:]:
        top.axvline(start - 0.05, color="#e76f51", linewidth=2)
    top.set_xlim(-0.2, n + 1)
    top.set_ylim(-0.1, 1)
    top.axis("off")
    top.set_title(f"{n} layers, {segments} segments: {segments} activations kept (dark), "
                  f"{n - segments} recomputed (hatched), sizes {sizes}", fontsize=9)
    ks = range(1, n + 1)
    bottom.plot(ks, [k + n / k for k in ks], color="#e76f51", label="k + n/k")
    bottom.plot(ks, [checkpoint.peak_units(n, k) for k in ks], "o", color="#264653", markersize=4,
                label="peak_units(n, k): whole segments")
    bottom.axhline(n + 1, color="#999999", linestyle="--", label=f"no checkpointing: n + 1 = {n + 1}")
    best = checkpoint.best_segments(n)
    bottom.plot([segments], [checkpoint.peak_units(n, segments)], "s", color="#2a9d8f", markersize=10,
                label=f"k = {segments}", zorder=0)
    bottom.set_xlabel(f"segments k (best: {best}, sqrt(n) = {n ** 0.5:.1f})")
    bottom.set_ylabel("activations held at the peak")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    return fig


def checkpoint_curve(segments: Sequence[int], forward: Sequence[float], peak: Sequence[float],
                     step_ms: Sequence[float], *, n: int, plain_ms: float, predicted_ms: float):
    """Measured saved bytes (in activations: forward and peak) and step time against the
    number of segments, with the theory drawn over them: k and k + n/k activations against
    n + 1 unchecked; one extra forward per step."""
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(10, 3.4))
    ks = range(1, max(segments) + 1)
    memory.plot(ks, [k + n / k for k in ks], color="#e76f51", label="theory: peak k + n/k")
    memory.plot(ks, list(ks), color="#f4a261", label="theory: forward keeps k")
    memory.plot(segments, peak, "o", color="#264653", label="measured peak")
    memory.plot(segments, forward, "s", color="#2a9d8f", label="measured after forward")
    memory.axhline(n + 1, color="#999999", linestyle="--", label="no checkpointing")
    memory.set_xlabel("segments k")
    memory.set_ylabel("saved activations [batch, hidden]")
    memory.set_title(f"{n} layers: what autograd saves", fontsize=10)
    memory.legend(fontsize=7)
    speed.plot(segments, step_ms, "o", color="#264653", label="measured")
    speed.axhline(predicted_ms, color="#e76f51", label="theory: plain + one forward")
    speed.axhline(plain_ms, color="#999999", linestyle="--", label="no checkpointing")
    speed.set_ylim(0, max(max(step_ms), predicted_ms) * 1.2)
    speed.set_xlabel("segments k")
    speed.set_ylabel("ms per step (median)")
    speed.set_title("what it costs in time", fontsize=10)
    speed.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- lesson 06: tensor parallelism

def tensor_parallel_splits(t: int = 2):
    """Y = XA on t ranks, split two ways. Left, column parallel: A's columns in t blocks,
    rank i computes Y_i = X A_i, and Y = [Y_1 ... Y_t]. Right, row parallel: A's rows and X's
    columns in t blocks, rank i computes X_i A_i, and Y is their sum (an all-reduce)."""
    colours = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))

    def block(ax, x, y, w, h, colour, text=""):
        ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=colour, edgecolor="white", linewidth=1.5))
        if text:
            ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8, color="white")

    for ax, kind in zip(axes, ("column", "row")):
        grey = "#8d99ae"
        for i in range(t):
            c = colours[i % 10]
            if kind == "column":  # X [2, 3] replicated, A [3, 3] by columns, Y [2, 3] by columns
                block(ax, 0, 0, 2, 2, grey, "X" if i == 0 else "")
                block(ax, 2.6 + 3 * i / t, 0, 3 / t, 3, c, f"A{i + 1}")
                block(ax, 6.2 + 3 * i / t, 0, 3 / t, 2, c, f"XA{i + 1}")
            else:  # X [2, 3] by columns, A [3, 3] by rows, Y [2, 3] the sum
                block(ax, 2 * i / t, 0, 2 / t, 2, c, f"X{i + 1}")
                block(ax, 2.6, 3 - 3 * (i + 1) / t, 3, 3 / t, c, f"A{i + 1}")
                block(ax, 6.2, 0, 3, 2, grey, "Σ XᵢAᵢ" if i == 0 else "")
        ax.text(2.3, 1, "×", ha="center", va="center", fontsize=14)
        ax.text(5.9, 1, "=", ha="center", va="center", fontsize=14)
        words = ("A by columns: rank i holds A_i, computes XA_i; Y = concat (all-gather if needed)" if kind == "column"
                 else "A by rows, X by columns: rank i computes X_i A_i; Y = sum (all-reduce)")
        ax.set_title(f"{kind} parallel on {t} ranks\n{words}", fontsize=9)
        ax.set_xlim(-0.2, 9.4)
        ax.set_ylim(-0.2, 3.2)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- lesson 07: 3D tensor parallelism

def cube_blocks(q: int = 2, *, swapped: bool = False):
    """The q x q x q cube of ranks (i, j, l), and which rank holds which block of the input
    X (q*q x q blocks) and of the weight A (q x q*q blocks), from `parallel3d.block_owners`."""
    from parakit import parallel3d

    owners = parallel3d.block_owners(q, swapped)
    fig = plt.figure(figsize=(12, 3.8))
    ax = fig.add_subplot(1, 3, 1, projection="3d")
    colours = plt.get_cmap("tab10" if q**3 <= 10 else "viridis", q**3)
    for rank in range(q**3):
        i, j, l = parallel3d.cube_coords(rank, q)
        ax.scatter(j, l, i, s=260, color=colours(rank), depthshade=False)
        ax.text(j, l, i, f"  {rank}", fontsize=9)
    ax.set_xlabel("j (input)")
    ax.set_ylabel("l (output)")
    ax.set_zlabel("i (weight)")
    ax.set_xticks(range(q)), ax.set_yticks(range(q)), ax.set_zticks(range(q))
    ax.set_title(f"P = {q}^3 = {q**3} ranks: rank = i*{q * q} + j*{q} + l", fontsize=9)
    for n, (name, grid) in enumerate(owners.items()):
        ax = fig.add_subplot(1, 3, n + 2)
        for r, row in enumerate(grid):
            for c, rank in enumerate(row):
                ax.add_patch(plt.Rectangle((c, r), 0.95, 0.95, color=colours(rank), alpha=0.75))
                i, j, l = parallel3d.cube_coords(rank, q)
                ax.text(c + 0.47, r + 0.47, f"rank {rank}\n({i},{j},{l})", ha="center", va="center", fontsize=8)
        ax.set_xlim(0, len(grid[0]))
        ax.set_ylim(len(grid), 0)
        ax.set_axis_off()
        shape = "[batch/q\u00b2, in/q]" if name == "X" else "[in/q, out/q\u00b2]"
        ax.set_title(f"{name}: block held by rank (i,j,l), each {shape}", fontsize=9)
    return fig


def bytes_1d_vs_3d(ranks: Sequence[int], one_d: Sequence[float], three_d: Sequence[float], *, title: str,
                   measured: tuple[int, float, float] | None = None, ax=None):
    """Bytes per rank of 1D (Megatron) and 3D tensor parallelism against the number of ranks
    (formulas, lines); `measured` = (ranks, 1D bytes, 3D bytes) adds what the meter counted."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(ranks, one_d, "o-", color="#e76f51", label="1D: 2 all-reduces of the activations")
    ax.plot(ranks, three_d, "s-", color="#264653", label="3D: 6 collectives per layer, (q-1)/q^3 each")
    if measured is not None:
        p, got_1d, got_3d = measured
        ax.plot([p, p], [got_1d, got_3d], "o", markersize=13, markerfacecolor="none", color="#2a9d8f",
                label=f"measured on {p} ranks")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("bytes sent per rank")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax.figure


# ---------------------------------------------------------------- lesson 08: long sequences

def ring_attention_steps(n: int = 4, layout: str = "zigzag"):
    """Causal ring attention on n ranks, step by step: one row per step, one column per rank;
    each cell names the K, V block the rank holds at that step (its own first, then its left
    neighbour's, ...) and the chunk pairs it computes with it, full or diagonal (half), from
    `context_parallel.chunk_ids` and `pair_kind`; darker cells compute more."""
    from parakit import context_parallel as cp
    work = {"full": 1.0, "diagonal": 0.5, "skip": 0.0}
    fig, ax = plt.subplots(figsize=(2.1 * n + 1.5, 0.75 * n + 1.2))
    for step in range(n):
        for rank in range(n):
            owner = (rank - step) % n
            pairs = [(a, b, cp.pair_kind(a, b, causal=True)) for a in cp.chunk_ids(n, rank, layout)
                     for b in cp.chunk_ids(n, owner, layout)]
            done = [f"q{a}k{b}" + ("/2" if kind == "diagonal" else "") for a, b, kind in pairs if kind != "skip"]
            share = sum(work[kind] for *_, kind in pairs) / len(pairs)
            ax.add_patch(plt.Rectangle((rank, step), 0.94, 0.9, color=plt.get_cmap("Blues")(0.15 + 0.6 * share)))
            ax.text(rank + 0.47, step + 0.45, f"K,V of rank {owner}\n{' '.join(done) or 'nothing (masked)'}",
                    ha="center", va="center", fontsize=7)
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_xticks([r + 0.47 for r in range(n)], [f"rank {r}: q{', q'.join(map(str, cp.chunk_ids(n, r, layout)))}"
                                                 for r in range(n)], fontsize=8)
    ax.set_yticks([s + 0.45 for s in range(n)], [f"step {s}" for s in range(n)])
    ax.set_title(f"causal ring attention, {layout} split, {n} ranks: after each step every rank passes its K, V "
                 f"block to the right", fontsize=9)
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    return fig


def causal_chunks(n: int = 4):
    """The causal attention matrix cut in 2n x 2n chunks (queries down, keys across), each
    chunk coloured by the rank that computes it, for the contiguous and the zig-zag split:
    from `context_parallel.chunk_ids` and `pair_kind`; white chunks are masked and skipped,
    pale ones are the diagonal (half computed). The titles give `attention_work` per rank."""
    from parakit import context_parallel as cp
    colours = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    for ax, layout in zip(axes, cp.LAYOUTS):
        per_rank = 2 // len(cp.chunk_ids(n, 0, layout))  # 2n grid chunks in each of the layout's chunks
        owner = {c * per_rank + k: r for r in range(n) for c in cp.chunk_ids(n, r, layout) for k in range(per_rank)}
        for i in range(2 * n):
            for j in range(2 * n):
                kind = cp.pair_kind(i, j, causal=True)
                if kind != "skip":
                    ax.add_patch(plt.Rectangle((j, 2 * n - 1 - i), 1, 1, facecolor=colours[owner[i] % 10],
                                               alpha=0.45 if kind == "diagonal" else 1.0, edgecolor="white"))
        ax.set_yticks([2 * n - 0.5 - i for i in range(2 * n)], [f"q{i} (rank {owner[i]})" for i in range(2 * n)],
                      fontsize=7)
        ax.set_xticks([j + 0.5 for j in range(2 * n)], [f"k{j}" for j in range(2 * n)], fontsize=7)
        ax.set_xlim(0, 2 * n)
        ax.set_ylim(0, 2 * n)
        ax.set_aspect("equal")
        work = cp.attention_work(2 * n * 64, n, layout)
        ax.set_title(f"{layout}: scores per rank (seq {2 * n * 64})\n{', '.join(f'{w:,}' for w in work)}",
                     fontsize=9)
    fig.tight_layout()
    return fig


def long_sequences(seq: int = 8192, n: int = 4, heads: int = 32, head_dim: int = 128, element_size: int = 2):
    """Models (not measurements) for one attention layer, batch 1: left, causal scores per rank
    (contiguous vs zig-zag, `context_parallel.attention_work`); middle, bytes each rank sends
    forward (ring, all-gather of K and V, Ulysses); right, the paper's activation bytes per
    layer on one rank, with n-way tensor parallelism, and with sequence parallelism too."""
    from parakit import context_parallel as cp
    from parakit import sequence_parallel as sp
    from parakit import ulysses
    seq = max(2 * n, seq - seq % (2 * n))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    ranks = list(range(n))
    for offset, layout, colour in ((-0.2, "contiguous", "#e76f51"), (0.2, "zigzag", "#2a9d8f")):
        axes[0].bar([r + offset for r in ranks], cp.attention_work(seq, n, layout), width=0.4, color=colour,
                    label=layout)
    axes[0].set_xlabel("rank")
    axes[0].set_ylabel("query-key scores")
    axes[0].set_title(f"causal work per rank, seq {seq:,}", fontsize=9)
    axes[0].legend(fontsize=8)
    local = (1, heads, seq // n, head_dim)
    sent = {"ring": cp.ring_bytes_per_rank(local, n, element_size),
            "all-gather K, V": 2 * (n - 1) * element_size * heads * head_dim * (seq // n),
            "Ulysses": ulysses.ulysses_bytes_per_rank(local, n, element_size) if heads % n == 0 else 0}
    axes[1].bar(list(sent), [b / 2**20 for b in sent.values()], color=["#264653", "#8d99ae", "#f4a261"])
    axes[1].set_ylabel("MiB sent per rank (forward)")
    axes[1].set_title(f"model: {n} ranks, {heads} heads x {head_dim}, {8 * element_size}-bit", fontsize=9)
    hidden = heads * head_dim
    memory = {"one rank": sp.paper_activation_bytes(seq, 1, hidden, heads),
              f"TP {n}": sp.paper_activation_bytes(seq, 1, hidden, heads, t=n),
              f"TP+SP {n}": sp.paper_activation_bytes(seq, 1, hidden, heads, t=n, sequence_parallel=True)}
    axes[2].bar(list(memory), [b / 2**30 for b in memory.values()], color=["#8d99ae", "#e76f51", "#2a9d8f"])
    axes[2].set_ylabel("GiB per layer")
    axes[2].set_title("Korthikanti et al.'s model: sbh(34 + 5as/h), divided", fontsize=9)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- lesson 09: mixture of experts

def moe_routing(experts: int = 4, k: int = 1, capacity_factor: float = 1.25, tokens: int = 32, skew: float = 1.0,
                seed: int = 0, ax=None):
    """A random router (parakit.moe.Router, seeded) routing `tokens` tokens of width 16 (drawn
    with `skew` along one direction, as moe.train.batch does): the choices each expert keeps
    and drops, and its capacity, all computed by the router itself."""
    import torch
    from parakit import moe

    torch.manual_seed(seed)
    router = moe.Router(16, experts, k, capacity_factor)
    with torch.no_grad():
        routing = router.route(moe.train.batch(0, tokens, 16, seed, skew)[0])
    kept = routing.tokens_per_expert()
    chosen = torch.bincount(routing.experts.reshape(-1), minlength=experts)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(range(experts), kept.tolist(), color="#264653", label="kept")
    ax.bar(range(experts), (chosen - kept).tolist(), bottom=kept.tolist(), color="#e76f51", label="dropped")
    ax.axhline(routing.capacity, color="#2a9d8f", linestyle="--", label=f"capacity {routing.capacity}")
    ax.set_xticks(range(experts))
    ax.set_xlabel("expert")
    ax.set_ylabel("choices routed")
    ax.set_title(f"{tokens} tokens, top-{k} of {experts}, capacity factor {capacity_factor}: "
                 f"{routing.dropped()} of {tokens * k} choices dropped", fontsize=9)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def load_over_steps(runs: dict[str, Sequence[Sequence[int]]], *, what: str, even: float, title: str):
    """One panel per run: `runs[name][step][i]` tokens handled by expert (or rank) i at each
    step, a line each, with `even` dotted: the even share, every choice made spread evenly
    (kept or dropped, so not the mean of what was kept)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.2), sharey=True, squeeze=False)
    for ax, (name, rows) in zip(axes[0], runs.items()):
        columns = list(zip(*rows))
        for i, column in enumerate(columns):
            ax.plot(range(len(rows)), column, lw=1.2, label=f"{what} {i}")
        ax.axhline(even, color="black", linestyle=":", label=f"even share ({even:g})")
        ax.set_xlabel("step")
        ax.set_title(name, fontsize=9)
    axes[0][0].set_ylabel(f"tokens per {what}")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def dropped_vs_capacity(factors: Sequence[float], dropped: dict[str, Sequence[float]], *, title: str, ax=None):
    """Fraction of choices dropped against the capacity factor, one line per router, with the
    model for perfectly even routing, max(0, 1 - factor), dotted."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    for name, fractions in dropped.items():
        ax.plot(factors, fractions, "o-", label=f"{name} (measured)")
    ax.plot(factors, [max(0.0, 1 - f) for f in factors], ":", color="black", label="even routing (model): max(0, 1 - c)")
    ax.set_xlabel("capacity factor c")
    ax.set_ylabel("fraction of choices dropped")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return ax.figure
