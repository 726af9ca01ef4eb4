"""A rank killed under the emulated NCCL (parakit.emulation): its peers are not told, as NCCL's
cannot be; each waits until its operation passes the group's timeout, when NCCL's watchdog
ends the process (its default) or, with TORCH_NCCL_BLOCKING_WAIT=1, the wait raises. A
deadlock among the live ranks is still reported at once, and operations without the dead
rank go on. parakit.launch reports the death with where the others wait, and torchrun ends
the attempt and restarts it.

The rule is tested as data (`Streams`), the rest on real processes: ranks started here on a
file store (no supervisor, so the watchdog acts), launched pools and torchrun jobs.
"""
from __future__ import annotations

import ast
import json
import re
import signal
import subprocess
import sys

import pytest

from conftest import read_until, script_env, write_script
from parakit.emulation.streams import Entry, Item, Streams
from test_emulation import GROUP, recv, run_emulated, send
from test_run import TINY, torchrun

TIMEOUT = 3  # seconds: the groups' timeout in the watchdog's tests
ALL = (0, 1, 2)


def all_reduce(n=0, parties=ALL):
    return Item((GROUP, "coll", n), parties, "all_reduce")


# ---------------------------------------------------------------- the rule, as data

def test_streams_leave_ranks_waiting_for_a_dead_rank_untold_until_their_operation_expires():
    streams = Streams(3)
    streams.post(1, Entry(1, 0, GROUP, [all_reduce()]))
    assert streams.gone(2) == [(0, ("gone", 2)), (1, ("gone", 2))]  # told for their messages, nothing stops
    streams.post(0, Entry(0, 0, GROUP, [all_reduce()]))
    assert streams.wait(0, 0) == [] and streams.wait(1, 0) == [] and streams.fault is None
    [(rank, (kind, entry_id, text))] = streams.expired(0, 0)
    assert (rank, kind, entry_id) == (0, "account", 0)
    assert text.splitlines() == [
        "emulated NCCL: the process of rank 2 ended, and NCCL cannot tell a dead rank from a slow one: every rank "
        "waiting for it waits until its operation's timeout, as here:",
        "  rank 0 waits for its all_reduce", "  rank 1 waits for its all_reduce",
        "  rank 0's stream on group 0 runs, in order: all_reduce", "  rank 1's stream on group 0 runs, in order: all_reduce"]


def test_streams_drop_what_a_dead_rank_posted_so_its_peers_operations_never_run():
    streams = Streams(2)
    streams.post(1, Entry(1, 0, GROUP, [send(1, 0)]))
    streams.gone(1)
    assert streams.post(0, Entry(0, 0, GROUP, [recv(0, 1)])) == []  # the send died with its stream


def test_streams_count_ranks_waiting_behind_a_waiter_of_the_dead_in_its_account():
    streams, group_02 = Streams(3), ("1", "all")  # a group of ranks 0 and 2
    streams.gone(2)
    streams.post(0, Entry(0, 0, group_02, [Item((group_02, "coll", 0), (0, 2), "all_reduce")]))  # then it sends to rank 1
    streams.post(1, Entry(1, 0, GROUP, [recv(1, 0)]))
    assert streams.wait(0, 0) == [] and streams.wait(1, 0) == []  # rank 2 could have posted: not stuck among the living
    assert streams.expired(1, 0)[0][1][2].splitlines()[1:] == [
        "  rank 0 waits for its all_reduce", "  rank 1 waits for its irecv from rank 0",
        "  rank 0's stream on group 1 runs, in order: all_reduce",
        "  rank 1's stream on group 0 runs, in order: irecv from rank 0"]


def test_streams_still_stop_a_deadlock_among_live_ranks_at_once_after_a_death():
    streams = Streams(3)
    streams.gone(2)
    for rank in (0, 1):
        streams.post(rank, Entry(rank, 0, GROUP, [send(rank, 1 - rank)]))
        streams.post(rank, Entry(rank, 1, GROUP, [recv(rank, 1 - rank)]))
    text = streams.wait(0, 0)[0][1][1]
    assert text.startswith("emulated NCCL: rank 0 waits for operations that can never run (NCCL would hang here):")
    assert "  rank 1's stream on group 0 runs, in order: isend to rank 0, irecv from rank 0" in text


def test_streams_account_for_an_expired_operation_whose_peers_all_live():
    streams = Streams(2)
    streams.post(0, Entry(0, 0, GROUP, [all_reduce(parties=(0, 1))]))
    assert streams.expired(0, 0)[0][1][2] == (
        "emulated NCCL: every rank's process still runs: a rank this operation needs did not reach it within the "
        "timeout (a slow rank, or one waiting elsewhere)")


# ---------------------------------------------------------------- the watchdog, on ranks without a supervisor

RANK = f"""
import datetime, os, sys, time, torch, torch.distributed as dist, parakit
from parakit import devices

rank, size, victim = map(int, sys.argv[1:])
devices.join("fnccl", rank, size, init_method="file://" + os.path.abspath("store"), rank=rank, world_size=size,
             timeout=datetime.timedelta(seconds={TIMEOUT}))
pair = dist.new_group([0, 1]) if size > 2 else None
x = torch.ones(2, device=parakit.device())
dist.all_reduce(x)
print("ready", x.tolist(), flush=True)
if rank == victim:
    time.sleep(600)  # killed here
while not os.path.exists("dead"):
    time.sleep(0.05)
if pair is not None and rank in (0, 1):  # a group without the victim (rank 3)
    y = torch.ones(2, device=parakit.device())
    dist.all_reduce(y, group=pair)
    print("pair", y.tolist(), flush=True)
try:
    dist.all_reduce(x)
    print("world", x.tolist(), flush=True)
except RuntimeError as error:
    print("raised", type(error).__name__, repr(str(error)), flush=True)
"""


def run_ranks(tmp_path, size: int, victim: int, env: dict) -> list[tuple[int, list[str]]]:
    """Start `size` ranks of RANK, kill `victim` (SIGKILL) once every rank is ready, then let the
    others go on; each survivor's exit code and output lines."""
    write_script(tmp_path, RANK, "rank.py")
    env = {**script_env(), "PARAKIT_EMULATE_GPUS": str(size), "OMP_NUM_THREADS": "1", **env}
    ranks = [subprocess.Popen([sys.executable, "rank.py", str(rank), str(size), str(victim)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(size)]
    seen = [[] for _ in ranks]
    try:
        for rank, process in enumerate(ranks):
            assert read_until(process, "ready", seen[rank], timeout=120), "".join(seen[rank])
        ranks[victim].kill()
        ranks[victim].wait()
        (tmp_path / "dead").touch()
        done = []
        for rank, process in enumerate(ranks):
            if rank != victim:
                output, _ = process.communicate(timeout=120)  # bounds a hang only: each waits its 3 s timeout
                done.append((process.returncode, "".join(seen[rank][1:]).splitlines() + output.splitlines()))
        return done
    finally:
        for process in ranks:
            process.kill()
            process.wait()


def watchdog_line(rank: int, seq: int, lines: list[str]) -> str:
    """The survivor's watchdog line, checked for its shape: the time it ran at least the timeout."""
    [line] = [line for line in lines if "Watchdog caught" in line]
    found = re.fullmatch(rf"(.*)\[Rank {rank}\] Watchdog caught collective operation timeout: WorkNCCL\(SeqNum={seq}, "
                         rf"OpType=ALLREDUCE, Timeout\(ms\)={TIMEOUT * 1000}\) ran for (\d+) milliseconds before timing "
                         rf"out\. It is this rank's all_reduce on group 0\.", line)
    assert found, line
    assert int(found[2]) >= TIMEOUT * 1000  # not told at once: it waited out the timeout
    return found[1]


@pytest.mark.parametrize("victim", [1, 0])  # rank 0's process also holds the coordinator
def test_a_killed_ranks_peer_waits_out_the_timeout_then_its_watchdog_takes_the_process_down(tmp_path, victim):
    [(code, lines)] = run_ranks(tmp_path, 2, victim, {})
    survivor = 1 - victim
    assert code == -signal.SIGABRT, lines  # NCCL's default, TORCH_NCCL_ASYNC_ERROR_HANDLING=3
    assert not any(line.startswith(("world", "raised")) for line in lines)
    start = lines.index(next(line for line in lines if "Watchdog caught" in line))
    watchdog_line(survivor, 2, lines)
    said = lines[start + 1:]
    if victim == 1:
        assert said[:2] == ["emulated NCCL: the process of rank 1 ended, and NCCL cannot tell a dead rank from a slow "
                            "one: every rank waiting for it waits until its operation's timeout, as here:",
                            "  rank 0 waits for its all_reduce"]
    else:
        assert said[0] == ("emulated NCCL: rank 0's process ended, and with it the coordinator: no operation of this "
                           "world runs any more, and each waits until its timeout")
    assert said[-1] == "To avoid data inconsistency, we are taking the entire process down."


def test_with_blocking_wait_the_survivors_raise_at_the_timeout_and_groups_without_the_dead_rank_go_on(tmp_path):
    done = run_ranks(tmp_path, 4, 3, {"TORCH_NCCL_BLOCKING_WAIT": "1"})
    assert [code for code, _ in done] == [0, 0, 0]
    for rank, (_, lines) in enumerate(done):
        pairs = [line for line in lines if line.startswith("pair")]
        assert pairs == (["pair [2.0, 2.0]"] if rank < 2 else [])  # the pair's group never needed rank 3
        [raised] = [line for line in lines if line.startswith("raised")]
        kind, text = raised.split(" ", 2)[1:]
        text = ast.literal_eval(text)  # the repr of its message
        assert kind == "EmulatedNCCLError"
        said = text.splitlines()
        assert watchdog_line(rank, int(re.search(r"SeqNum=(\d+)", said[0])[1]), said[:1]) == ""
        assert said[1].startswith("emulated NCCL: the process of rank 3 ended")
        assert f"  rank {rank} waits for its all_reduce" in said


# ---------------------------------------------------------------- parakit.launch and torchrun

LAUNCHED = """
import json, os, signal, time, torch, torch.distributed as dist, parakit
from parakit import launcher

def killed_mid_collective(victim):
    x = torch.ones(2, device=parakit.device())
    if dist.get_rank() == victim:
        time.sleep(0.5)  # the others sit in the all_reduce, then it dies
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(x)
    return x

def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False

found = {}
for size, victim in [(4, 2), (2, 0)]:
    pids = parakit.launch(os.getpid, world_size=size)
    try:
        parakit.launch(killed_mid_collective, victim, world_size=size, timeout=60)  # a LaunchTimeout past that
    except parakit.RankDied as error:
        found[size] = {"error": str(error), "failed": sorted(error.failures),
                       "generation": launcher.pool_generation(size, "fnccl"), "alive": [p for p in pids if alive(p)]}
    found[size]["next"] = parakit.launch(dist.get_rank, world_size=size)
print(json.dumps(found))
"""


def test_launch_reports_a_rank_killed_mid_collective_with_where_the_others_wait_and_starts_afresh(tmp_path):
    found = run_emulated(tmp_path, LAUNCHED)
    for size, victim in [(4, 2), (2, 0)]:
        call = found[str(size)]
        assert call["error"].startswith(f"rank {victim} died:\n--- rank {victim} died: killed by SIGKILL")
        waiting = call["error"].split("while the other ranks waited:\n", 1)[1]
        for rank in set(range(size)) - {victim}:
            assert f"  rank {rank} waits in all_reduce #1 for " in waiting
        # its line, the last, with its source (the function's code keeps its file on the way to the ranks)
        assert len(re.findall(r":\d+ in killed_mid_collective: dist\.all_reduce\(x\)$", waiting, re.M)) == size - 1
        assert "parakit/emulation" not in waiting  # the emulated NCCL's frames left out, as torch's are
        assert call["failed"] == [victim] and call["generation"] is None and call["alive"] == []  # the pool stopped
        assert call["next"] == list(range(size))  # and the next call starts a new one


JOB = """
import os, signal, torch, torch.distributed as dist, parakit
from parakit.torchrun import process_group

with process_group():
    x = torch.ones(2, device=parakit.device())
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(x)
    print("finished", x.tolist(), flush=True)
"""


def test_torchrun_ends_the_job_when_a_rank_is_killed_mid_collective(tmp_path):
    write_script(tmp_path, JOB, "job.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "job.py"],
                          cwd=tmp_path, env={**script_env(), "PARAKIT_EMULATE_GPUS": "2", "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)  # bounds a hang only
    assert done.returncode == 1 and "finished" not in done.stdout
    root_cause = done.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "exitcode  : -9" in root_cause
    assert "Watchdog" not in done.stderr  # torchrun stopped rank 0 (SIGTERM) before its timeout


def test_lesson_11s_killed_rank_resumes_under_torchrun_on_the_emulated_box(tmp_path, monkeypatch):
    monkeypatch.setenv("PARAKIT_EMULATE_GPUS", "2")
    losses = tmp_path / "losses.jsonl"
    job = torchrun(*TINY, "--tp", "2", "--steps", "5", "--log-every", "0", "--save-every", "3", "--ckpt-dir",
                   str(tmp_path), "--losses-to", str(losses), "--fault", "kill:1:4")
    assert job.returncode == 0, job.stdout + job.stderr
    assert "[fault] rank 1 killed after step 4" in job.stdout and "resumed from step3: step 3" in job.stdout
    assert "failed (exitcode: -9) local_rank: 1" in job.stderr  # torchrun saw the death and restarted the ranks
    logged = {(r["attempt"], r["step"]): r["loss"] for r in map(json.loads, losses.read_text().splitlines())}
    assert sorted(logged) == [(0, s) for s in range(1, 5)] + [(1, s) for s in (4, 5)]
    assert logged[1, 4] == logged[0, 4]  # the resumed step, bit for bit
