"""The suite's own hooks (tests/conftest.py), run by pytest in a fresh interpreter."""
from __future__ import annotations

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
