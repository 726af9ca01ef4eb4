"""viz.explore's controls, and the lessons' explorers swept over the values their controls offer."""
from __future__ import annotations

import ast
import itertools
import json

import matplotlib.pyplot as plt
import pytest

from conftest import REPO
from parakit import viz


class Shown:
    """What explore displays, in place of a frontend: the controls and each update of the outputs."""

    def __init__(self):
        self.controls, self.updates = [], []

    def display(self, obj, raw=False, display_id=False):
        if hasattr(obj, "children"):
            self.controls = list(obj.children)
        return self

    def update(self, obj, raw=False):
        self.updates.append(obj)


def test_explore_labels_each_control_and_shows_what_draw_raised_in_place_of_the_figure(monkeypatch):
    import IPython.display

    shown = Shown()
    monkeypatch.setattr(viz, "static_only", lambda: False)
    monkeypatch.setattr(IPython.display, "display", shown.display)

    def draw(n, kind):
        if n == 3:
            raise ZeroDivisionError("division by zero")
        plt.plot(range(n))
        print(f"{kind} {n}")

    viz.explore(draw, n=(1, 4), kind=["a", "b"])
    assert [(w.description, w.value) for w in shown.controls] == [("n", 1), ("kind", "a")]
    shown.controls[0].value = 3
    assert shown.updates[-2] == {"text/plain": "(no figure)"}
    assert shown.updates[-1] == {"text/plain": "cannot draw n=3, kind='a': ZeroDivisionError: division by zero"}
    shown.controls[1].value = "b"
    shown.controls[0].value = 2
    assert shown.updates[-1] == {"text/plain": "b 2"} and shown.updates[-2].format == "png"
    assert plt.get_fignums() == []  # every figure drawn was closed


def library_explorers() -> list:
    """(lesson, viz function, {control: values}) of every lesson's explore call that draws a viz
    function with literal controls: each slider's ends and middle, every dropdown option."""
    found = []
    for path in sorted((REPO / "solutions").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or "viz.explore(" not in source:
                continue
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "viz.explore":
                    draw = node.args[0]
                    if isinstance(draw, ast.Lambda) and isinstance(draw.body, ast.Call):
                        draw = draw.body.func  # lambda n: viz.ring_steps(n): its arguments in order
                    if not ast.unparse(draw).startswith("viz."):
                        continue  # a function the notebook defines
                    try:
                        controls = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                    except ValueError:
                        continue  # a control built from the notebook's names
                    found.append(pytest.param(getattr(viz, ast.unparse(draw)[4:]), {
                        name: sorted({spec[0], spec[1], spec[0] + (spec[1] - spec[0]) // 2})
                        if isinstance(spec, tuple) else list(spec) for name, spec in controls.items()},
                        id=f"{path.stem[:2]}-{ast.unparse(draw)[4:]}"))
    return found


@pytest.mark.parametrize("draw, values", library_explorers())
def test_every_value_a_lesson_explorer_offers_draws(draw, values):
    """Each control through its values with the others at their first, then every corner."""
    first = {name: options[0] for name, options in values.items()}
    cases = [{**first, name: v} for name, options in values.items() for v in options[1:]]
    cases += [dict(zip(values, corner)) for corner in itertools.product(*([o[0], o[-1]] for o in values.values()))]
    for case in cases:
        try:
            draw(**case)
        except Exception as error:
            raise AssertionError(f"{draw.__name__}({case}) raised {type(error).__name__}: {error}") from None
        finally:
            plt.close("all")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_attention_steps_names_each_steps_block_and_the_pairs_computed(layout):
    """Rank r holds rank (r - step) mod n's K, V at each step; on 4 ranks the zig-zag split
    computes two chunk pairs' worth at every step, the contiguous one masks whole steps."""
    figure = viz.ring_attention_steps(4, layout)
    texts = [t.get_text() for t in figure.axes[0].texts]
    plt.close(figure)
    assert [t.split("\n")[0] for t in texts] == [f"K,V of rank {(r - s) % 4}" for s in range(4) for r in range(4)]
    if layout == "zigzag":
        assert texts[:4] == ["K,V of rank 0\nq0k0/2 q7k0 q7k7/2", "K,V of rank 1\nq1k1/2 q6k1 q6k6/2",
                             "K,V of rank 2\nq2k2/2 q5k2 q5k5/2", "K,V of rank 3\nq3k3/2 q4k3 q4k4/2"]
    else:
        assert texts[4] == "K,V of rank 3\nnothing (masked)" and texts[7] == "K,V of rank 2\nq3k2"


def test_under_the_sweep_explore_draws_every_offered_value_and_names_one_that_raises(monkeypatch):
    monkeypatch.setenv("PARAKIT_STATIC", "1")
    monkeypatch.setenv("PARAKIT_SWEEP", "1")
    drawn = []
    viz.explore(lambda n, kind: drawn.append((n, kind)), n=(2, 8), kind=["a", "b"])
    assert drawn == [(2, "a"), (5, "a"), (8, "a"), (2, "b"), (8, "b")]  # shown, then each value, then the last of all
    with pytest.raises(AssertionError, match=r"\(\{'n': 8, 'kind': 'a'\}\) raised ZeroDivisionError"):
        viz.explore(lambda n, kind: 1 / (n - 8), n=(2, 8), kind=["a", "b"])
