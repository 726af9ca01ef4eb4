"""Mutation operators: rewrites of an answer cell that change its technique and keep its values.

Each operator finds its sites in the cell's syntax tree, inside the cell's `### BEGIN SOLUTION`
regions when it has them, and rewrites all of them or one (`mutate`). What a rewrite calls is a
helper defined below, whose source is prepended to the mutated cell: it is the student's code
there, so it calls torch and torch.distributed, never parakit. `autograde.mutants` grades the
mutants; the operators:

    blocking                    an async call (async_op=True, isend, irecv, batch_isend_irecv) waited for at once
    separate_posts              batch_isend_irecv(ops): each P2POp posted by itself, in list order
    all_reduce_and_slice        a reduce-scatter made as an all-reduce of the whole input, then this rank's slice
    broadcast_removed           dist.broadcast and broadcast_object_list send nothing
    rng_not_restored            fork_rng is a null context; set_rng_state, setstate and set_state do nothing
    sends_and_receives_swapped  a list of P2POps reversed; adjacent send and receive statements swapped
    finally_removed             try/finally: the finally block no longer runs when the try statement raises
    buffer_kept                 `del`, `.resize_(0)` and `x.attr = None` (what frees a buffer) removed
    whole_reads                 f.read(n) and os.pread: the whole rest of the file read, then sliced
    replicas_in_a_loop          parallel_apply and threading.Thread: the replicas run one after another, here
"""
from __future__ import annotations

import ast
import inspect

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
COMM = {"dist", "distributed"}  # what torch.distributed is called by: `dist.isend`, `torch.distributed.isend`


# ---------------------------------------------------------------------------- helpers (prepended to a mutant)

class _Done:
    """The handle of a call that has finished: wait() returns at once."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _waited(work):
    """`work` (a request, or a list of them) waited for at once; in its place handles that are done, whose wait()
    returns at once (gloo's point-to-point requests never return from a second wait)."""
    if isinstance(work, list):
        return [_waited(request) for request in work]
    if work is None:
        return None
    work.wait()
    return _Done()


def _posted_one_by_one(ops):
    """Each P2POp of `ops` posted by itself, in list order, instead of as one batch."""
    return [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]


def _all_reduced_and_sliced(output, input, op=None, group=None, async_op=False):
    """A reduce-scatter made as an all-reduce of a copy of the whole input (a tensor or a list of them), then this
    rank's slice copied into `output`."""
    import torch
    import torch.distributed as dist
    whole = torch.stack(list(input)) if isinstance(input, (list, tuple)) else input.clone()
    dist.all_reduce(whole, op=dist.ReduceOp.SUM if op is None else op, group=group)
    output.copy_(whole.reshape(dist.get_world_size(group), -1)[dist.get_rank(group)].view_as(output))
    return _Done() if async_op else None


def _not_sent(*args, async_op=False, **kwargs):
    """A broadcast that sends nothing: every rank keeps what it had."""
    return _Done() if async_op else None


def _not_forked(*args, **kwargs):
    """What fork_rng would have been: a context that saves and restores nothing."""
    import contextlib
    return contextlib.nullcontext()


def _not_restored(*args, **kwargs):
    """A generator's state left as it is instead of set."""


def _exception_now():
    """The exception being handled or propagated here (None: none)."""
    import sys
    return sys.exc_info()[1]


def _read_rest_and_sliced(f, n=-1):
    """f.read(n) made by reading the whole rest of `f` and keeping its first n bytes; `f` is left after them."""
    start, data = f.tell(), f.read()
    data = data if n is None or n < 0 else data[:n]
    f.seek(start + len(data))
    return data


def _pread_rest_and_sliced(fd, n, offset):
    """os.pread(fd, n, offset) made by reading from `offset` to the end of the file and keeping n bytes."""
    import os
    return os.pread(fd, max(os.fstat(fd).st_size - offset, 0), offset)[:n]


def _one_after_another(replicas, inputs, *args, **kwargs):
    """What parallel_apply computes in a thread per replica: each replica on its inputs in turn, in this thread."""
    return [replica(*(x if isinstance(x, (list, tuple)) else (x,))) for replica, x in zip(replicas, inputs)]


class _InlineThread:
    """A thread whose target runs when it is started, in the caller's thread."""

    def __init__(self, group=None, target=None, name=None, args=(), kwargs=None, *, daemon=None):
        self._call = target, args, kwargs or {}

    def start(self):
        target, args, kwargs = self._call
        if target is not None:
            target(*args, **kwargs)

    def join(self, timeout=None):
        pass

    def is_alive(self):
        return False


# ---------------------------------------------------------------------------- operators

def call_name(node) -> str | None:
    """The name a call calls: `f(...)` and `a.b.f(...)` give "f"; None for any other node."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def comm_call(node) -> str | None:
    """The name of a torch.distributed function the node calls (`dist.isend(...)`), else None."""
    func = getattr(node, "func", None)
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value
    named = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
    return call_name(node) if named in COMM else None


def calling(helper, args, keywords=()) -> ast.Call:
    return ast.Call(ast.Name(helper.__name__, ast.Load()), list(args), list(keywords))


class Operator:
    """A mutation operator: the nodes it rewrites (`matches`), what each becomes (`rewrite`: a node, or statements
    for a statement), and the helpers those call."""
    name = ""
    helpers: tuple = ()

    def prepare(self, tree) -> None:
        """Look at the whole tree before any node is matched (each node knows its parent as `_parent`)."""

    def matches(self, node) -> bool:
        raise NotImplementedError

    def rewrite(self, node):
        raise NotImplementedError


class Redirect(Operator):
    """A call of one of `names` (through torch.distributed when `comm`) made to `helper` with the same arguments."""
    names: set = set()
    comm = True

    def matches(self, node) -> bool:
        return (comm_call(node) if self.comm else call_name(node)) in self.names

    def rewrite(self, node):
        return calling(self.helpers[-1], node.args, node.keywords)


class Blocking(Operator):
    name, helpers = "blocking", (_Done, _waited)
    ASYNC = {"isend", "irecv", "batch_isend_irecv"}

    def matches(self, node) -> bool:
        asynchronous = comm_call(node) in self.ASYNC or any(
            k.arg == "async_op" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in getattr(node, "keywords", ()))
        waited = isinstance(node._parent, ast.Attribute) and node._parent.attr == "wait"
        return isinstance(node, ast.Call) and asynchronous and not waited

    def rewrite(self, node):
        return calling(_waited, [node])


class SeparatePosts(Redirect):
    name, helpers, names = "separate_posts", (_posted_one_by_one,), {"batch_isend_irecv"}


class AllReduceAndSlice(Redirect):
    name, helpers = "all_reduce_and_slice", (_Done, _all_reduced_and_sliced)
    names = {"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"}


class BroadcastRemoved(Redirect):
    name, helpers, names = "broadcast_removed", (_Done, _not_sent), {"broadcast", "broadcast_object_list"}


class RngNotRestored(Operator):
    name, helpers = "rng_not_restored", (_not_forked, _not_restored)
    TO = {"fork_rng": _not_forked, **dict.fromkeys(("set_rng_state", "set_rng_state_all", "setstate", "set_state"),
                                                   _not_restored)}

    def matches(self, node) -> bool:
        return call_name(node) in self.TO

    def rewrite(self, node):
        return calling(self.TO[call_name(node)], node.args, node.keywords)


def p2p_direction(statement) -> str | None:
    """"send" or "recv" for a statement that is (or assigns) one dist.send/isend/recv/irecv call, else None."""
    value = getattr(statement, "value", None) if isinstance(statement, (ast.Expr, ast.Assign)) else None
    return {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}.get(comm_call(value))


class SendsAndReceivesSwapped(Operator):
    name = "sends_and_receives_swapped"

    def prepare(self, tree) -> None:
        """The first statement of each adjacent send-receive pair, pairs taken left to right, none overlapping."""
        self.firsts, self.dropped = {}, set()
        for node in ast.walk(tree):
            for body in (v for v in vars(node).values() if isinstance(v, list)):
                i = 0
                while i + 1 < len(body):
                    a, b = p2p_direction(body[i]), p2p_direction(body[i + 1])
                    if a and b and a != b:
                        self.firsts[id(body[i])] = body[i + 1]
                        i += 1
                    i += 1

    def matches(self, node) -> bool:
        p2p_list = isinstance(node, ast.List) and len(node.elts) > 1 and all(call_name(e) == "P2POp" for e in node.elts)
        return p2p_list or id(node) in self.firsts

    def rewrite(self, node):
        if isinstance(node, ast.List):
            return ast.List(node.elts[::-1], node.ctx)
        second = self.firsts[id(node)]
        self.dropped.add(id(second))
        return [second, node]


class FinallyRemoved(Operator):
    name, helpers = "finally_removed", (_exception_now,)

    def matches(self, node) -> bool:
        return isinstance(node, (ast.Try, ast.TryStar)) and bool(node.finalbody)

    def rewrite(self, node):
        """`try: A finally: B` -> `_before = _exception_now(); try: A finally: if _exception_now() is _before: B`:
        B runs as before, except when the try statement raises."""
        before = f"_before_{node.lineno}"
        guard = ast.parse(f"if _exception_now() is {before}:\n    pass").body[0]
        guard.body = node.finalbody
        kept = type(node)(node.body, node.handlers, node.orelse, [guard])
        return [ast.parse(f"{before} = _exception_now()").body[0], kept]


class BufferKept(Operator):
    name = "buffer_kept"

    def matches(self, node) -> bool:
        """`del ...`, `x.resize_(0)` and `x.attr = None`, each a statement."""
        resized = isinstance(node, ast.Expr) and call_name(node.value) == "resize_" and \
            [ast.dump(a) for a in node.value.args] == [ast.dump(ast.Constant(0))]
        dropped = isinstance(node, ast.Assign) and [type(t) for t in node.targets] == [ast.Attribute] and \
            isinstance(node.value, ast.Constant) and node.value.value is None
        return isinstance(node, ast.Delete) or resized or dropped

    def rewrite(self, node):
        return ast.Pass()


class WholeReads(Operator):
    name, helpers = "whole_reads", (_read_rest_and_sliced, _pread_rest_and_sliced)

    def matches(self, node) -> bool:
        read = call_name(node) == "read" and isinstance(node.func, ast.Attribute) and len(node.args) == 1 \
            and not node.keywords
        return read or (call_name(node) == "pread" and len(getattr(node, "args", ())) == 3)

    def rewrite(self, node):
        if call_name(node) == "pread":
            return calling(_pread_rest_and_sliced, node.args)
        return calling(_read_rest_and_sliced, [node.func.value, *node.args])


class ReplicasInALoop(Operator):
    name, helpers = "replicas_in_a_loop", (_one_after_another, _InlineThread)
    TO = {"parallel_apply": _one_after_another, "Thread": _InlineThread}

    def matches(self, node) -> bool:
        return call_name(node) in self.TO

    def rewrite(self, node):
        return calling(self.TO[call_name(node)], node.args, node.keywords)


OPERATORS = {op.name: op for op in (Blocking, SeparatePosts, AllReduceAndSlice, BroadcastRemoved, RngNotRestored,
                                     SendsAndReceivesSwapped, FinallyRemoved, BufferKept, WholeReads, ReplicasInALoop)}


# ---------------------------------------------------------------------------- applying one

def solution_lines(source: str) -> set[int]:
    """The line numbers inside the source's `### BEGIN SOLUTION` regions; every line when it has none."""
    lines, inside = set(), False
    for number, line in enumerate(source.splitlines(), 1):
        if line.strip().startswith(BEGIN) or line.strip().startswith(END):
            inside = line.strip().startswith(BEGIN)
        elif inside:
            lines.add(number)
    return lines or set(range(1, len(source.splitlines()) + 1))


class _Rewriter(ast.NodeTransformer):
    """Visits a tree children first, numbering the operator's sites in that order; rewrites those `chosen`."""

    def __init__(self, operator: Operator, lines: set[int], chosen: set[int]):
        self.operator, self.lines, self.chosen, self.sites = operator, lines, chosen, []

    def visit(self, node):
        if id(node) in getattr(self.operator, "dropped", ()):
            return None
        node = self.generic_visit(node)
        if getattr(node, "lineno", None) in self.lines and self.operator.matches(node):
            self.sites.append(node)
            if len(self.sites) - 1 in self.chosen:
                return self.operator.rewrite(node)
        return node


def _parsed(source: str, operator: Operator) -> ast.Module:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child._parent = node
    tree._parent = None
    operator.prepare(tree)
    return tree


def sites(source: str, name: str) -> list[str]:
    """Where operator `name` applies in `source`: one line per site (its line number and code)."""
    operator = OPERATORS[name]()
    rewriter = _Rewriter(operator, solution_lines(source), set())
    rewriter.visit(_parsed(source, operator))
    return [f"line {n.lineno}: {ast.get_source_segment(source, n).splitlines()[0].strip()}" for n in rewriter.sites]


def mutate(source: str, name: str, site: int | None = None) -> str:
    """`source` with operator `name`'s sites rewritten (only site number `site`, from 0, when given), its helpers
    prepended. Raises SyntaxError when `source` does not parse."""
    count = len(sites(source, name))
    operator = OPERATORS[name]()
    tree = _parsed(source, operator)
    rewriter = _Rewriter(operator, solution_lines(source), set(range(count)) if site is None else {site})
    tree = ast.fix_missing_locations(rewriter.visit(tree))
    helpers = [inspect.getsource(h) for h in dict.fromkeys(operator.helpers)]
    return "\n\n".join([*helpers, ast.unparse(tree)]) + "\n"
