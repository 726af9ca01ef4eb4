"""NCCL's rules for when an operation runs, kept for every rank by one coordinator.

NCCL runs each rank's operations on a communicator in the order they were posted, on one
stream, and an operation runs only when every rank it involves has reached it on its own
stream: a collective when every rank of the group has, a send when its receiver's matching
receive has (NCCL's docs: the operation "is blocking for the GPU"), a batch
(`batch_isend_irecv`, a coalesced block) as one group whose parts match one by one.
Communicators: with `device_id` given to init_process_group, one per group, made with the
group (eager: all p2p ops share the group's stream); without it, the group's is made at its
first collective or batch, and each pair's at its first send or receive between the two,
both ranks taking part (lazy: the set-up itself waits for the other side).

`Streams` is that rule as data. Ranks post entries, set communicators up, wait, and go idle
between launched calls; it answers which items run now, in one global order, and, whenever
a rank blocks, whether the blocked ranks can ever go on, assuming the running ranks may
still post anything (so a slow rank is never taken for a stuck one). `Coordinator` serves it
to every rank of a world over a socket.

A rank whose process ends (its connection closes: `gone`) takes its stream with it, unrun.
NCCL's peers cannot tell a dead rank from a slow one: they wait until the watchdog of each
waiting operation finds it past its group's timeout. So here: a deadlock among the live
ranks, whatever the dead one would have posted, is still reported at once; the ranks left
waiting for the dead one are told nothing until their operations expire (`expired`, asked
by the rank's watchdog, `link`), when the account counts the dead rank as never posting.
"""
from __future__ import annotations

import multiprocessing.connection as mpc
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field

__all__ = ["Item", "Entry", "Streams", "Coordinator", "comm_name"]


@dataclass
class Item:
    """What one operation needs from the other ranks: the same `key` reached by every party."""
    key: tuple  # (comm, "coll", n) or (comm, "p2p", src, dst, n): n counts per comm (and direction)
    parties: tuple  # the global ranks that take part
    what: str  # "send to rank 1", "all_reduce": for messages
    released: bool = False


@dataclass
class Entry:
    """One operation on a rank's stream (a batch: several items), `id` unique per rank."""
    rank: int
    id: int
    comm: tuple  # (group, "all") or (group, low rank, high rank)
    items: list[Item] = field(default_factory=list)

    def label(self) -> str:
        whats = [item.what for item in self.items]
        return whats[0] if len(whats) == 1 else f"batch [{', '.join(whats)}]"


class Streams:
    """Every rank's streams, communicators and state; each event returns the messages to
    send: (rank, ("run", entry id, item index)), (rank, ("ready", comm)), (rank, ("fault", text)),
    (rank, ("gone", dead rank)), (rank, ("account", entry id, text))."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.queues: dict[tuple, deque[Entry]] = defaultdict(deque)  # (rank, comm) -> entries not all released
        self.blocked: dict[int, tuple] = {}  # rank -> ("wait", Entry) | ("setup", comm) | ("idle",)
        self.setting_up: dict[tuple, dict[int, str]] = defaultdict(dict)  # comm -> {rank: its device}
        self.members: dict[tuple, tuple] = {}  # comm -> the ranks that must set it up
        self.newest = 0  # the newest launched call any rank has started
        self.dead: set[int] = set()  # the ranks whose processes ended
        self.fault: str | None = None

    # -------------------------------------------------------------------------- events

    def setup(self, rank: int, comm: tuple, members: tuple, device: str) -> list:
        """`rank` makes communicator `comm` with `members` (NCCL's init: every member must)."""
        self.members[comm] = members
        self.setting_up[comm][rank] = device
        if set(self.setting_up[comm]) < set(members):
            self.blocked[rank] = ("setup", comm)
            return self._check()
        devices = self.setting_up.pop(comm)
        for member in members:
            if self.blocked.get(member) == ("setup", comm):
                del self.blocked[member]
        twins = _duplicate(devices)
        if twins:
            return self._fail(f"Duplicate GPU detected: ranks {twins[0]} and {twins[1]} are both on "
                              f"{devices[twins[0]]} (NCCL needs one device per rank: set each rank's device before "
                              f"it makes its process group, as parakit.devices does)")
        return [(member, ("ready", comm)) for member in members]

    def post(self, rank: int, entry: Entry) -> list:
        self.queues[rank, entry.comm].append(entry)
        return self._release()

    def wait(self, rank: int, entry_id: int) -> list:
        """`rank` blocks until its entry `entry_id` has run (nothing to do if it has been released)."""
        entry = self._entry(rank, entry_id)
        if entry is None:
            return []
        self.blocked[rank] = ("wait", entry)
        return self._check()

    def gone(self, rank: int) -> list:
        """`rank`'s process ended: its stream goes, unrun, and the others are told, for their
        watchdogs' messages only (they go on waiting, as NCCL's peers do). Nothing else to
        report: the dead rank counts as able to post anything in `stuck`, as it did alive."""
        self.dead.add(rank)
        self.blocked.pop(rank, None)
        for key in [key for key in self.queues if key[0] == rank]:
            del self.queues[key]
        return [(other, ("gone", rank)) for other in range(self.world_size) if other not in self.dead]

    def expired(self, rank: int, entry_id: int) -> list:
        """`rank`'s entry `entry_id` passed its group's timeout (its watchdog caught it): the
        account for its message, the dead ranks counted as never posting again and `rank` as
        waiting for that entry, so it names every rank left waiting for them, in order."""
        blocked = {r: state for r, state in self.blocked.items() if not self._about_to_start(state)}
        blocked.update({r: ("gone",) for r in self.dead})
        entry = self._entry(rank, entry_id)
        if entry is not None:
            blocked[rank] = ("wait", entry)
        ranks, streams = self._stuck(blocked)
        if not self.dead:
            lines = ["emulated NCCL: every rank's process still runs: a rank this operation needs did not reach it "
                     "within the timeout (a slow rank, or one waiting elsewhere)"]
        else:
            many = len(self.dead) > 1
            lines = [f"emulated NCCL: the process{'es' * many} of rank{'s' * many} {', '.join(map(str, sorted(self.dead)))} "
                     f"ended, and NCCL cannot tell a dead rank from a slow one: every rank waiting for "
                     f"{'them' if many else 'it'} waits until its operation's timeout, as here:"]
        lines += [f"  rank {r} {self._waits(r, blocked[r])}" for r in sorted(ranks)]
        lines += self._stream_lines(streams)
        return [(rank, ("account", entry_id, "\n".join(lines)))]

    def idle(self, rank: int, idle: bool, task: int) -> list:
        """`rank` returned from launched call number `task` (it posts nothing more until the
        next), or starts it. Idle after an older call than another rank has started, a rank
        counts as running: it is about to start that call too."""
        if idle:
            self.blocked[rank] = ("idle", task)
            return self._check()
        self.newest = max(self.newest, task)
        self.blocked.pop(rank, None)
        return []

    # -------------------------------------------------------------------------- running

    def _release(self) -> list:
        """Release every item whose parties all have it at the head of their streams."""
        out, progress = [], True
        while progress and not self.fault:
            progress = False
            for (rank, comm), queue in list(self.queues.items()):
                for item in [i for i in queue[0].items if not i.released] if queue else []:
                    heads = [_head_item(self.queues, party, comm, item.key) for party in item.parties]
                    if all(heads):
                        out += self._run(item, heads)
                        progress = True
                while queue and all(i.released for i in queue[0].items):
                    done = queue.popleft()
                    if _waits_on(self.blocked.get(rank), done):
                        del self.blocked[rank]
        return out

    def _run(self, item: Item, heads: list) -> list:
        whats = {entry.items[index].what for entry, index in heads}
        if item.key[1] == "coll" and len(whats) > 1:
            return self._fail(f"collective mismatch on {comm_name(item.key[0])}: its call #{item.key[-1] + 1} is "
                              + ", ".join(f"{entry.items[index].what} on rank {entry.rank}" for entry, index in heads)
                              + ". Every rank of a group must call the same collectives in the same order.")
        out = []
        for entry, index in heads:
            entry.items[index].released = True
            out.append((entry.rank, ("run", entry.id, index)))
        return out

    # -------------------------------------------------------------------------- deadlocks

    def _check(self) -> list:
        ranks, streams = self.stuck()
        return self._fail(self.describe(ranks, streams)) if ranks else []

    def stuck(self) -> tuple[set[int], list[tuple]]:
        """The ranks that wait (for an entry or a set-up) and can never go on, whatever the
        running ranks (the dead ones too) post next, and the streams (rank, comm) that can never
        move: they wait for each other, in a cycle or on idle ranks."""
        return self._stuck({rank: state for rank, state in self.blocked.items() if not self._about_to_start(state)})

    def _stuck(self, blocked: dict[int, tuple]) -> tuple[set[int], list[tuple]]:
        """`stuck`, each rank of `blocked` in the state given there ("idle" and "gone": it posts nothing more)."""
        queues = {key: [(e, {i.key: i.parties for i in e.items if not i.released}) for e in q]
                  for key, q in self.queues.items() if q}
        blocked = dict(blocked)
        setting_up = {comm: set(ranks) for comm, ranks in self.setting_up.items()}
        while _simulate_step(queues, blocked, setting_up, self.members):
            pass
        return ({rank for rank, state in blocked.items() if state[0] not in ("idle", "gone")},
                sorted((key for key, queue in queues.items() if queue), key=repr))

    def describe(self, ranks: set[int], streams: list[tuple]) -> str:
        """What each stuck rank waits for, the stuck streams in order, then what NCCL does and what to change."""
        many = len(ranks) > 1
        lines = [f"emulated NCCL: rank{'s' * many} {', '.join(map(str, sorted(ranks)))} wait{'' if many else 's'} "
                 f"for operations that can never run (NCCL would hang here):"]
        lines += [f"  rank {rank} {self._waits(rank, self.blocked[rank])}" for rank in sorted(ranks)]
        lines += [f"  rank {r} has left the launched function (returned or raised)" for r, s in sorted(self.blocked.items())
                  if s[0] == "idle" and not self._about_to_start(s)]
        lines += self._stream_lines(streams)
        lines.append(_advice({self.blocked[rank][0] for rank in ranks} | {s[0] for s in self.blocked.values()}))
        return "\n".join(lines)

    def _about_to_start(self, state: tuple) -> bool:
        return state[0] == "idle" and state[1] < self.newest

    def _stream_lines(self, streams: list[tuple]) -> list[str]:
        return [f"  rank {rank}'s stream on {comm_name(comm)} runs, in order: "
                + ", ".join(entry.label() for entry in self.queues[rank, comm]) for rank, comm in streams]

    def _entry(self, rank: int, entry_id: int) -> Entry | None:
        """`rank`'s entry `entry_id`, if it has not all been released."""
        for (owner, _), queue in self.queues.items():
            for entry in queue if owner == rank else ():
                if entry.id == entry_id:
                    return entry
        return None

    def _waits(self, rank: int, state: tuple) -> str:
        if state[0] == "wait":
            return f"waits for its {state[1].label()}"
        comm = state[1]
        missing = sorted(set(self.members[comm]) - set(self.setting_up.get(comm, {})))
        return (f"waits to set up the communicator of {comm_name(comm)} (NCCL makes it at the first operation there, "
                f"every member taking part), which rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} "
                f"{'have' if len(missing) > 1 else 'has'} not begun")

    def _fail(self, text: str) -> list:
        self.fault = self.fault or text
        return [(rank, ("fault", self.fault)) for rank in range(self.world_size)]


def _head_item(queues, party: int, comm: tuple, key: tuple):
    """(entry, index) of the unreleased item `key` at the head of `party`'s stream on `comm`."""
    queue = queues.get((party, comm))
    for index, item in enumerate(queue[0].items if queue else ()):
        if item.key == key and not item.released:
            return queue[0], index
    return None


def _waits_on(state, entry) -> bool:
    return state is not None and state[0] == "wait" and state[1] is entry


def _simulate_step(queues, blocked, setting_up, members) -> bool:
    """One move of `Streams.stuck`'s simulation: a set-up completes or an item runs, where
    a running rank counts as able to post whatever is missing once its stream is empty."""
    def could(party, comm, key):
        queue = queues.get((party, comm))
        return key in queue[0][1] if queue else party not in blocked

    for comm, ranks in list(setting_up.items()):
        if all(member in ranks or member not in blocked for member in members[comm]):
            del setting_up[comm]
            for rank in [r for r, state in blocked.items() if state == ("setup", comm)]:
                del blocked[rank]
            return True
    for (rank, comm), queue in queues.items():
        for key, parties in queue[0][1].items() if queue else ():
            if all(could(party, comm, key) for party in parties):
                for party in parties:
                    head = queues.get((party, comm))
                    if head and key in head[0][1]:
                        del head[0][1][key]
                        if not head[0][1] and _waits_on(blocked.get(party), head.pop(0)[0]):
                            del blocked[party]
                return True
    return False


def _duplicate(devices: dict[int, str]):
    """The first two ranks on the same device, or None."""
    seen = {}
    for rank, device in sorted(devices.items()):
        if device in seen:
            return seen[device], rank
        seen[device] = rank
    return None


def comm_name(comm: tuple) -> str:
    return f"group {comm[0]}" if comm[1] == "all" else f"group {comm[0]}'s pair {comm[1]}-{comm[2]}"


def _advice(states: set[str]) -> str:
    """What NCCL does here and what to change, for ranks blocked in these states."""
    if "setup" in states:
        return ("Without device_id in init_process_group, NCCL connects two ranks at their first send or receive, "
                "and both must take part: a ring whose ranks all send first waits in a cycle. Pass device_id (as "
                "parakit does), or post each step's sends and receives together with dist.batch_isend_irecv.")
    return ("NCCL runs a rank's operations in the order they were posted on one stream (one per group when device_id "
            "was given, else one per pair of ranks), and an operation runs only when every rank it involves has "
            "reached it: a send waits for its receive. Post sends and receives that must meet together with "
            "dist.batch_isend_irecv, or in an order where one side sends while the other receives."
            + (" Each operation also needs its counterpart on the ranks that returned." if "idle" in states else ""))


# ------------------------------------------------------------------------------ serving

class Coordinator:
    """`Streams` for the `world_size` ranks of one world, served from a thread: each rank's
    process connects once (`address`, `authkey`) and says ("hello", rank), then sends its
    events and gets its messages, in one global order; its connection's end is its "gone"."""

    def __init__(self, world_size: int, authkey: bytes):
        self.streams = Streams(world_size)
        self.listener = mpc.Listener(("127.0.0.1", 0), authkey=authkey)
        self.address = self.listener.address
        threading.Thread(target=self._serve, daemon=True, name="fnccl-coordinator").start()

    def _serve(self) -> None:
        conns = {}
        for _ in range(self.streams.world_size):
            conn = self.listener.accept()
            conns[conn.recv()[1]] = conn
        self.listener.close()
        while conns:
            for conn in mpc.wait(list(conns.values())):
                rank = next(r for r, c in conns.items() if c is conn)
                try:
                    event = conn.recv()
                except (EOFError, OSError):
                    del conns[rank]
                    event = ("gone",)
                for target, message in self._handle(rank, event):
                    if target not in conns:
                        continue
                    try:
                        conns[target].send(message)
                    except OSError:  # that rank's process ended too: its "gone" comes next
                        pass

    def _handle(self, rank: int, event: tuple) -> list:
        kind, *args = event
        if self.streams.fault is not None and kind != "idle":
            return [(rank, ("fault", self.streams.fault))]
        try:
            return getattr(self.streams, kind)(rank, *args)
        except Exception as error:  # a fault of the emulation itself: every rank is told, none waits forever
            return self.streams._fail(f"the emulated NCCL's coordinator failed on rank {rank}'s {kind}: "
                                      f"{type(error).__name__}: {error}")
