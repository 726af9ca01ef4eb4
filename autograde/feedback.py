"""The page a student gets back for one notebook: feedback/<student>/<lesson>.html.

Each test with its points and, when it failed, the judge's own message (the first element
that differs, the traffic that differs, what the answer raised), grouped by the exercise it
tests; the notes a student can act on (a missing definition, a test cell restored, an answer
that timed out). Nothing empty: a message that says nothing is said in words. What is for the
instructor only (a copy flag, a tamper flag, an unsealed run) is in `Result.private`, which
this page never shows. One self-contained HTML file, styled inline, readable offline.
"""
from __future__ import annotations

import html
import re

__all__ = ["page", "explain"]

STYLE = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; max-width: 920px;
       margin: 2em auto; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: .2em; }
.total { font-size: 1.2em; margin: .3em 0 1em; }
.meter { height: 10px; background: #eaeef2; border-radius: 5px; overflow: hidden; max-width: 420px; }
.meter > div { height: 100%; background: #1a7f37; }
h2 { font-size: 1.15em; margin: 1.6em 0 .5em; border-bottom: 1px solid #d0d7de; padding-bottom: .2em; }
table { border-collapse: collapse; width: 100%; }
td { border-top: 1px solid #d0d7de; padding: .45em .6em; vertical-align: top; }
td.test { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; white-space: nowrap; width: 1%; }
td.points { white-space: nowrap; width: 1%; }
.badge { display: inline-block; min-width: 3.2em; text-align: center; border-radius: 1em; padding: 0 .6em;
         font-weight: 600; }
.pass .badge { background: #dafbe1; color: #1a7f37; }
.fail .badge { background: #ffebe9; color: #cf222e; }
pre { margin: 0; white-space: pre-wrap; word-break: break-word; font: 13px/1.45 ui-monospace, SFMono-Regular,
      Menlo, monospace; }
.pass pre { color: #57606a; }
.notes { background: #fff8c5; border: 1px solid #d4a72c66; border-radius: 6px; padding: .6em 1em .6em 2em; }
.status { background: #ffebe9; border: 1px solid #cf222e55; border-radius: 6px; padding: .8em 1em; }
footer { color: #57606a; font-size: .9em; margin-top: 2.5em; }
"""

STUB = re.compile(r"raised NotImplementedError:?\s*$")
BARE = re.compile(r"raised (\w+):\s*$")


def explain(message: str, passed: bool) -> str:
    """The judge's message as a student reads it: never empty, the stub's bare error explained."""
    message = message.strip()
    if passed:
        return "passed"
    if not message:
        return "failed, and the check gave no reason: ask your instructor"
    if STUB.search(message):
        return STUB.sub("raised NotImplementedError: the answer cell still holds the stub; replace "
                        "`raise NotImplementedError()` with your answer", message)
    return BARE.sub(lambda m: f"raised {m.group(1)} (with no message)", message)


def groups(tests, released) -> list[tuple[str | None, list[str]]]:
    """(answer cell, its tests) in notebook order; tests without an answer before them first."""
    if released is None:
        return [(None, list(tests))]
    order, current = [], None
    for cell in released.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("solution"):
            current = meta.get("grade_id")
        elif meta.get("grade") and meta.get("grade_id") in tests:
            if not order or order[-1][0] != current:
                order.append((current, []))
            order[-1][1].append(meta["grade_id"])
    seen = {t for _, ts in order for t in ts}
    rest = [t for t in tests if t not in seen]
    return ([(None, rest)] if rest else []) + order


def page(r, released=None) -> str:
    """The feedback page of Result `r`; `released` (the lesson as handed out) groups the tests
    by exercise."""
    e = html.escape
    share = 100 * r.score / r.max_score if r.max_score else 0
    parts = [f"<h1>{e(r.assignment)}</h1>",
             f'<div class="total"><b>{r.score:g}</b> of {r.max_score:g} points</div>',
             f'<div class="meter"><div style="width:{share:.0f}%"></div></div>']
    if r.status == "missing":
        parts.append(f'<p class="status">Nothing was graded: no <code>{e(r.assignment)}.ipynb</code> was handed in. '
                     f'Hand it in under that name, saved from Jupyter, and ask for a regrade.</p>')
    elif r.status != "graded":
        parts.append(f'<p class="status">Nothing was graded: the file handed in as <code>{e(r.assignment)}.ipynb'
                     f'</code> could not be read ({e(r.status)}). Save the notebook from Jupyter (File, Save) '
                     f'and hand it in again.</p>')
    if r.notes:
        parts.append("<h2>Notes</h2><ul class=\"notes\">" + "".join(f"<li>{e(n)}</li>" for n in r.notes) + "</ul>")
    if r.status == "graded":
        for answer, tests in groups(r.tests, released):
            parts.append(f"<h2>Exercise <code>{e(answer)}</code></h2>" if answer else "<h2>Tests</h2>")
            rows = []
            for gid in tests:
                score, most = r.tests[gid]
                passed = score >= most
                text = explain(r.messages.get(gid, ""), passed)
                rows.append(f'<tr class="{"pass" if passed else "fail"}"><td class="test">{e(gid)}</td>'
                            f'<td class="points"><span class="badge">{score:g}/{most:g}</span></td>'
                            f"<td><pre>{e(text)}</pre></td></tr>")
            parts.append("<table>" + "".join(rows) + "</table>")
    parts.append("<footer>Each test ran your functions in fresh processes, against the reference run on the same "
                 "inputs, drawn for grading (hidden tests included). A message names the first thing that "
                 "differed.</footer>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(r.assignment)}: '
            f"{r.score:g}/{r.max_score:g}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")
