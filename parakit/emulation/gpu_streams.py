"""The emulated GPUs' streams: work the host does not wait for, as on a GPU.

A stream is a worker thread with a queue of jobs run in order: kernels (`fgpu` queues the
matmul family here: `launch`), event records, waits for an event of another stream, and
waits for an emulated NCCL operation (`wait_op`, what `Work.wait()` queues, as NCCL makes
the current stream wait). Each device has its default stream (id 0) and those made with
`torch.fgpu.Stream()`; `with torch.fgpu.stream(s):` makes `s` current for its device in
this thread. The host waits only where it must: `synchronize()`, an event's or stream's
`synchronize()`, and every operator that `fgpu` runs on the host (a read of the data: a
copy to the CPU, `.item()`, an elementwise kernel) first waits for its current stream
(`wait_current`). Before the host blocks on a stream, it waits for the NCCL operations
that stream waits for, telling the coordinator (`link.wait`), so that a hang is found
where the rank blocks, as before.

A host that waits runs the stream's next jobs itself when no thread has started them (no
thread switch: on a busy CPU one costs a millisecond), and a short kernel (`launch`'s
`short`: under about a millisecond of work) does not wake the stream's thread: it runs
when the thread gets to it or where the host next waits. Either way the host has waited
for it, and only there, as on a GPU.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import threading
import time

import torch
from torch.utils import _python_dispatch

__all__ = ["Stream", "Event", "stream", "current", "default", "resolve", "wait_current", "wait_op", "launch", "after",
           "busy", "synchronize"]

_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1, the device type of fgpu's streams
_IDS = itertools.count(1)  # stream ids; 0 is each device's default stream
_STREAMS: dict[tuple[int, int], "Stream"] = {}  # (device index, stream id) -> stream


class _Job:
    """One entry of a stream: `run()`; the memory it reads (data pointers, kept alive by
    `keep`); the NCCL operation or (stream, job number) it waits for, if any."""
    __slots__ = ("run", "reads", "keep", "op", "after")

    def __init__(self, run, reads=frozenset(), keep=(), op=None, after=None):
        self.run, self.reads, self.keep, self.op, self.after = run, reads, keep, op, after


class Stream(torch.Stream):
    """A stream on an emulated GPU (torch.cuda.Stream's methods): its jobs run in order on
    its own thread, started with its first job."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        from parakit.emulation import fgpu
        return cls._make(fgpu._index(device), next(_IDS))

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def _make(cls, index: int, stream_id: int) -> "Stream":
        self = torch.Stream.__new__(cls, stream_id=stream_id, device_index=index, device_type=_PRIVATEUSE1)
        self.jobs: collections.deque[_Job] = collections.deque()  # queued and not finished, the running one first
        lock = threading.RLock()
        self.cond = threading.Condition(lock)  # notified when a job finishes
        self.wake = threading.Condition(lock)  # wakes the stream's thread
        self.queued = self.finished = 0  # jobs ever queued, and ever finished
        self.running = False  # a thread runs the first job
        self.urgent = False  # a job worth waking the thread for is queued
        self.error: BaseException | None = None  # a job's, raised where the host next waits for the stream
        self.thread: threading.Thread | None = None
        _STREAMS[index, stream_id] = self
        return self

    def put(self, job: _Job, wake: bool = True) -> int:
        """Queue `job`; its number (the stream has run it once `finished` reaches it). Without
        `wake` (a short kernel) the stream's thread is not woken for it: the job runs when the
        thread gets to it or where the host next waits (what a thread switch costs on a busy CPU)."""
        with self.cond:
            self.jobs.append(job)
            self.queued += 1
            if wake:
                self.urgent = True
                self.wake.notify()
            if self.thread is None:
                self.thread = threading.Thread(target=self._work, daemon=True,
                                               name=f"fgpu{self.device_index}-stream{self.stream_id}")
                self.thread.start()
            return self.queued

    def _work(self) -> None:
        torch.set_num_threads(torch.get_num_threads())  # MKL's, in a new thread every core: the host's
        while True:
            with self.cond:
                self.wake.wait_for(lambda: self.urgent and self.jobs and not self.running)
                self.running = True
            self._run_first()

    def until(self, number: int) -> None:
        """Block until this stream has run its job `number`, running the jobs no thread has
        started (here, at once: no thread to wake, as a GPU would not need)."""
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.finished >= number or not self.running)
                if self.finished >= number:
                    return
                self.running = True
            self._run_first()

    def _run_first(self) -> None:
        """Run the first job (this thread took it: `running`), then drop it."""
        try:
            with _python_dispatch._disable_current_modes():  # the host's dispatch modes see fgpu's operators, not these
                self.jobs[0].run()
        except BaseException as error:  # raised on the host, as CUDA reports a kernel's error later
            self.error = self.error or error
        with self.cond:
            self.jobs.popleft()  # what it holds (an NCCL operation's tensors) dies now
            self.finished += 1
            self.running = False
            self.urgent = self.urgent and bool(self.jobs)
            self.cond.notify_all()
            if self.urgent:
                self.wake.notify()

    def host_waits(self, number: int | None = None) -> None:
        """The host blocks until this stream has run its job `number` (all queued by default):
        first for the NCCL operations it waits for, told to the coordinator, their errors raised."""
        number = self.queued if number is None else number
        for op in _operations(self, number):
            op.link.wait(op)
        self.until(number)
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    # torch.cuda.Stream's methods
    def synchronize(self) -> None:
        self.host_waits()

    def query(self) -> bool:
        return self.finished >= self.queued

    def wait_event(self, event: "Event") -> None:
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        if resolve(stream) is not self:
            event = Event()
            event.record(stream)
            self.wait_event(event)

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def __enter__(self):
        self.context = stream(self)
        return self.context.__enter__()

    def __exit__(self, *exc):
        return self.context.__exit__(*exc)


def _operations(stream: Stream, number: int):
    """The unfinished NCCL operations `stream`'s jobs up to `number` wait for, directly or
    through an event of another stream."""
    with stream.cond:
        jobs = list(itertools.islice(stream.jobs, max(0, number - stream.finished)))
    for job in jobs:
        if job.op is not None and not job.op.done.is_set():
            yield job.op
        elif job.after is not None:
            yield from _operations(*job.after)


class Event(torch.Event):
    """torch.cuda.Event on an emulated GPU: `record` queues a mark on a stream (its time
    taken when the stream gets there), `wait` makes a stream wait for the mark, `synchronize`
    makes the host wait; `elapsed_time` needs both marks reached, as CUDA's does."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        from parakit.emulation import fgpu
        self = torch.Event.__new__(cls, device=torch.device(fgpu.NAME, fgpu.current_device()),
                                   enable_timing=enable_timing)
        self.at: tuple[Stream, int] | None = None  # its last record: the stream and the job's number
        self.time: list[float] = []  # [perf_counter seconds] once the stream got there
        return self

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream: Stream | None = None) -> None:
        stream = resolve(stream) if stream is not None else current()
        when: list[float] = []
        self.time = when
        self.at = stream, stream.put(_Job(lambda: when.append(time.perf_counter())))

    def wait(self, stream: Stream | None = None) -> None:
        stream = resolve(stream) if stream is not None else current()
        if self.at is not None and self.at[0] is not stream:
            other, number = self.at
            stream.put(_Job(lambda: other.until(number), after=self.at))

    def query(self) -> bool:
        return self.at is None or self.at[0].finished >= self.at[1]

    def synchronize(self) -> None:
        if self.at is not None:
            self.at[0].host_waits(self.at[1])

    def elapsed_time(self, end: "Event") -> float:
        """Milliseconds from this event to `end`."""
        for event in (self, end):
            if event.at is None or not event.query():
                raise RuntimeError("CUDA error: device not ready (the emulated GPU has not reached an event given "
                                   "to elapsed_time: call end.synchronize() first)")
        return (end.time[0] - self.time[0]) * 1e3


class _Current(threading.local):
    def __init__(self):
        self.streams: dict[int, Stream] = {}  # device index -> this thread's current stream there


_CURRENT = _Current()


def default(index: int) -> Stream:
    """Device `index`'s default stream."""
    found = _STREAMS.get((index, 0))
    return found if found is not None else Stream._make(index, 0)


def current(index: int | None = None) -> Stream:
    """This thread's current stream on device `index` (the current device by default)."""
    if index is None:
        from parakit.emulation import fgpu
        index = fgpu.current_device()
    found = _CURRENT.streams.get(index)
    return found if found is not None else default(index)


def resolve(stream: torch.Stream) -> Stream:
    """An fgpu stream as this module's (PyTorch hands kernels a torch.Stream of the same id)."""
    return stream if isinstance(stream, Stream) else _STREAMS.get((stream.device_index, stream.stream_id)) or \
        Stream._make(stream.device_index, stream.stream_id)


@contextlib.contextmanager
def stream(s: torch.Stream | None):
    """`with torch.fgpu.stream(s):` makes `s` current on its device in this thread (None: no change)."""
    if s is None:
        yield
        return
    s = resolve(s)
    saved = _CURRENT.streams.get(s.device_index)
    _CURRENT.streams[s.device_index] = s
    try:
        yield s
    finally:
        if saved is None:
            del _CURRENT.streams[s.device_index]
        else:
            _CURRENT.streams[s.device_index] = saved


def wait_current(index: int) -> None:
    """The host waits for its current stream on device `index` (before running work there itself)."""
    s = current(index)
    if s.finished != s.queued:
        s.host_waits()


def wait_op(op, settle) -> None:
    """NCCL's Work.wait(): the current stream waits for emulated NCCL operation `op` (`settle()`
    blocks until it has run and raises its error); the host goes on."""
    current().put(_Job(settle, op=op))


def launch(index: int, run, reads: frozenset, keep: tuple, short: bool) -> None:
    """Queue a kernel on the current stream of device `index`: `run` reads the memory at data
    pointers `reads`, kept alive by `keep` (not by the tensors: the host may free those);
    a `short` one does not wake the stream's thread (`Stream.put`)."""
    current(index).put(_Job(run, reads, keep), wake=not short)


def after(streams: list[Stream], run) -> None:
    """Call `run` once each of `streams` has run what is queued on it now (at once if none)."""
    left = [len(streams)]
    lock = threading.Lock()

    def count():
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            run()
    for s in streams:
        s.put(_Job(count))
    if not streams:
        run()


def busy(index: int):
    """Device `index`'s streams that have jobs left."""
    return [s for (i, _), s in list(_STREAMS.items()) if i == index and s.finished != s.queued]


def synchronize(index: int) -> None:
    """The host waits for every stream of device `index`."""
    for s in busy(index):
        s.host_waits()


@atexit.register
def _finish() -> None:
    """At exit: let each stream finish its kernels (one left in torch's C++ code when the
    interpreter ends aborts the process, see link._Link.close); a stream that waits for an
    NCCL operation that never ran is left waiting."""
    for s in list(_STREAMS.values()):
        if s.finished != s.queued and not any(True for _ in _operations(s, s.queued)):
            s.until(s.queued)
