"""What a pipeline schedule is made of: typed actions, one per compute or message.

    F       forward of micro-batch i on stage s
    B       backward of micro-batch i on stage s: the whole backward, or, in a schedule that
            also has W actions (zero bubble), only the gradient of the stage's input, which
            the previous stage waits for
    W       the gradient of stage s's weights for micro-batch i, which nobody waits for
    SEND_F  send stage s's activation of micro-batch i to the rank of stage s+1
    RECV_F  receive stage s's input activation of micro-batch i from the rank of stage s-1
    SEND_B  send stage s's input gradient of micro-batch i to the rank of stage s-1
    RECV_B  receive stage s's output gradient of micro-batch i from the rank of stage s+1

No communication here: these are the data the builders (schedules.py) make, the simulator
(simulate.py) times and the runtime (runtime.py) executes.
"""
from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["Op", "Action"]


class Op(enum.StrEnum):
    """The kind of an action. A StrEnum: Op.F == "F", and it prints as "F"."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    # Each op's attributes (set below, plain attributes: the simulator reads them millions of
    # times, and a property is a call each time, which a sealed rank's watch sees):
    #   is_compute  whether it is an F, B or W
    #   compute     the F, B or W it runs, or the F or B whose result it carries
    #   send, recv  the send that carries this compute's result on (SEND_F for F, SEND_B for B),
    #               the receive that takes it in (RECV_F for F, RECV_B for B)
    #   step        which way the result travels along the stages: +1 for F, -1 for B, 0 for W
    #               (it stays: weight gradients go to nobody)
    is_compute: bool
    compute: Op
    send: Op
    recv: Op
    step: int


for _op in Op:
    _op.compute = Op.W if _op is Op.W else Op.F if _op in (Op.F, Op.SEND_F, Op.RECV_F) else Op.B
    _op.is_compute = _op in (Op.F, Op.B, Op.W)
    _op.send = Op.SEND_F if _op.compute is Op.F else Op.SEND_B
    _op.recv = Op.RECV_F if _op.compute is Op.F else Op.RECV_B
    _op.step = {Op.F: 1, Op.B: -1, Op.W: 0}[_op.compute]
del _op


class _Fields(NamedTuple):
    op: Op
    stage: int  # the stage that computes, sends, or receives
    microbatch: int
    peer: int | None = None  # the other rank (in the pipeline group) of a send or receive


class Action(_Fields):
    """One step of one rank: Action(op, stage, microbatch, peer=None); `op` may be given as
    its name ("F", "SEND_B", ...). Prints as the grid does: 0F1, 0SEND_F1→1, 1RECV_F1←0."""

    __slots__ = ()

    def __new__(cls, op: Op | str, stage: int, microbatch: int, peer: int | None = None):
        return super().__new__(cls, Op(op), stage, microbatch, peer)

    def __str__(self) -> str:
        arrow = "" if self.peer is None else (f"\u2192{self.peer}" if self.op in (Op.SEND_F, Op.SEND_B)
                                              else f"\u2190{self.peer}")
        return f"{self.stage}{self.op}{self.microbatch}{arrow}"
