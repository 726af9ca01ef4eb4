"""The suite's own hooks (tests/conftest.py), run by pytest in a fresh interpreter."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

BROKEN_REPORTS = """
from _pytest.python import Function

def test_fails_where_pytest_cannot_report_it():
    def broken(self, excinfo):  # as Python 3.11's ast, once left in that state, fails every parse
        raise SystemError("AST constructor recursion depth mismatch (before=129, after=182)")
    Function.repr_failure = broken
    assert [1] == [2]

def test_fails_after_it():
    assert 3 == 4

def test_passes_after_it():
    pass
"""


def test_a_failure_pytest_cannot_report_is_reported_as_text_and_the_session_goes_on(tmp_path):
    shutil.copyfile(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_broken.py").write_text(BROKEN_REPORTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_broken.py"],
                          cwd=tmp_path, env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True,
                          timeout=120)  # a bound on a hang: it takes 2 s
    assert "INTERNALERROR" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert "2 failed, 1 passed" in done.stdout, done.stdout
    assert "FAILED test_broken.py::test_fails_where_pytest_cannot_report_it - AssertionError: assert [1] == [2]" \
        in done.stdout
    assert "FAILED test_broken.py::test_fails_after_it - AssertionError: assert 3 == 4" in done.stdout
    assert "test_broken.py:8 in test_fails_where_pytest_cannot_report_it\n    assert [1] == [2]" in done.stdout


def test_the_gpu_suite_knows_every_solution_notebook():
    """test_gpu.py's NOTEBOOK_GPUS names every lesson (read from its source: the GPU suite is
    skipped on a CPU machine, so only this test sees a lesson missing there)."""
    tests = Path(__file__).parent
    tree = ast.parse((tests / "test_gpu.py").read_text())
    (table,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "NOTEBOOK_GPUS" for t in node.targets)]
    gpus = ast.literal_eval(table)
    lessons = {path.stem for path in (tests.parent / "solutions").glob("[0-9][0-9]_*.ipynb")}
    assert set(gpus) == lessons, (f"tests/test_gpu.py's NOTEBOOK_GPUS lacks {sorted(lessons - set(gpus))} and names "
                                  f"{sorted(set(gpus) - lessons)}, which are not lessons: give each lesson the "
                                  f"largest world size its cells launch under 'auto'")
    assert all(isinstance(n, int) and 1 <= n <= 8 for n in gpus.values()), gpus
