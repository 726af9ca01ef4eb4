"""parakit.run, lesson 11's trainer, on real processes (gloo): under torchrun with restarts, a
rank killed after a step and a rank killed in the middle of a save, and the job resumed from the
last complete checkpoint to losses equal to the unbroken run's, bit for bit, at the same mesh; a
checkpoint saved on one mesh (dp2, ZeRO-3, pp2) resumed on another with the same parameters;
bad arguments and bad checkpoints refused with what to change."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import parakit
from parakit import run as prun
from parakit import state
from parakit.launcher import LaunchError

TINY = ["--hidden", "16", "--heads", "2", "--seq", "16", "--batch", "4", "--layers", "1"]


def torchrun(*args: str, timeout: float = 480) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 --max-restarts 2 -m parakit.run ARGS`, each attempt with a store of
    its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a shared store can hand a restarted gloo group the dead attempt's
    addresses, PyTorch issue #135712). `timeout` bounds a hang only: the killed-rank job takes 13 s idle and took
    over 3 minutes beside two busy loops (its 3 attempts each start 2 fresh processes that import torch)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "2", "-m", "parakit.run", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def test_a_killed_rank_and_a_killed_save_resume_to_the_unbroken_losses_bit_for_bit(tmp_path):
    args = TINY + ["--tp", "2", "--steps", "8", "--log-every", "0"]
    job = torchrun(*args, "--save-every", "3", "--ckpt-dir", str(tmp_path), "--losses-to",
                   str(tmp_path / "losses.jsonl"), "--fault", "kill:1:4", "--fault", "save:1:6")
    assert job.returncode == 0, job.stdout + job.stderr
    logged = [json.loads(line) for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["step"]) for r in logged] == \
        [(0, s) for s in range(1, 5)] + [(1, s) for s in (4, 5, 6)] + [(2, s) for s in range(4, 9)]
    assert "[fault] rank 1 killed after step 4" in job.stdout
    assert "[fault] rank 1 killed in the middle of step 6's checkpoint" in job.stdout
    assert "skipped step6: no index.json, a save that did not finish" in job.stdout  # rank 1 died before its shards
    assert job.stdout.count("resumed from step3: step 3") == 2  # the previous checkpoint, both times
    unbroken = parakit.launch(prun.main, args, world_size=2)[0]
    assert all(r["loss"] == unbroken["loss"][r["step"] - 1] for r in logged)  # ==: bit for bit
    assert sorted(p.name for p in tmp_path.iterdir() if state.is_complete(p)) == ["step3", "step6"]


def run_and_keep(argv: list[str]) -> list[torch.Tensor]:
    """Every parameter and moment this rank holds after parakit.run with `argv` (built anew, loaded from
    --ckpt-dir's latest checkpoint), named, as tensors on the CPU."""
    args = prun.parse_args(argv)
    run = prun.build(args)
    prun.load_checkpoint(run, state.latest(args.ckpt_dir))
    return {s.name: s.tensor.detach().cpu().clone() for s in prun.checkpoint_shards(run)}


def resave_on(argv: list[str], folder_out):
    """Load the latest checkpoint of --ckpt-dir on this mesh, save it again into `folder_out` (step 2)."""
    args = prun.parse_args(argv)
    run = prun.build(args)
    step = prun.load_checkpoint(run, state.latest(args.ckpt_dir))
    args.ckpt_dir = folder_out
    prun.save_checkpoint(run, step)
    return step


def test_a_checkpoint_moves_between_meshes_exactly_dp2_zero3_to_tp2_to_pp2_and_back(tmp_path):
    zero3 = TINY + ["--dp", "2", "--zero3", "--steps", "2", "--save-every", "2", "--ckpt-dir", str(tmp_path / "zero3")]
    trained = parakit.launch(prun.main, zero3 + ["--sample-bytes", "3"], world_size=2)
    assert [len(r["samples"]["after"].encode(errors="replace")) >= 3 for r in trained] == [True, True]  # every dp rank
    before = parakit.launch(run_and_keep, TINY + ["--dp", "2", "--zero3", "--ckpt-dir", str(tmp_path / "zero3")],
                            world_size=2)
    assert parakit.launch(resave_on, TINY + ["--tp", "2", "--ckpt-dir", str(tmp_path / "zero3")], tmp_path / "tp",
                          world_size=2) == [2, 2]
    assert parakit.launch(resave_on, TINY + ["--pp", "2", "--ckpt-dir", str(tmp_path / "tp")], tmp_path / "pp",
                          world_size=2) == [2, 2]
    after = parakit.launch(run_and_keep, TINY + ["--dp", "2", "--zero3", "--ckpt-dir", str(tmp_path / "pp")],
                           world_size=2)
    for mine, theirs in zip(after, before):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_run_resumed_on_another_mesh_goes_on_from_the_saved_step_and_says_it_is_not_bit_exact(tmp_path, capfd):
    first = TINY + ["--steps", "2", "--save-every", "2", "--ckpt-dir", str(tmp_path)]
    parakit.launch(prun.main, first + ["--dp", "2"], world_size=2)
    resumed = parakit.launch(prun.main, TINY + ["--tp", "2", "--steps", "4", "--ckpt-dir", str(tmp_path)], world_size=2)
    assert [r["start"] for r in resumed] == [2, 2] and resumed[0]["steps"] == [3, 4]
    said = capfd.readouterr().out
    assert "the generators are per rank and not restored, so the run goes on, but not bit for bit" in said


@pytest.mark.parametrize("argv, world_size, message", [
    (["--dp", "2", "--tp", "2"], 2,
     "--dp 2 x --pp 1 x --tp 2 = 4 ranks, but the job has 2: choose sizes whose product is 2"),
    (["--dp", "2", "--batch", "6", "--microbatches", "2"], 2,
     "--batch 6 does not split into --dp 2 x --microbatches 2"),
    (["--tp", "2", "--zero3"], 2, "--zero3 shards the whole model over dp: use it with --pp 1 --tp 1"),
    (["--tp", "2", "--heads", "3", "--hidden", "24"], 2, "tp must divide heads"),
    (["--pp", "4", "--layers", "1"], 4, "3 layers cannot fill --pp 4 stages: use --layers >= 2"),
    (["--save-every", "5"], 1, "--save-every 5 needs --ckpt-dir"),
    (["--dp", "2", "--fault", "kill:1"], 2, "--fault 'kill:1': write kill:RANK:STEP"),
    (["--dp", "2", "--fault", "save:0:4", "--save-every", "3", "--ckpt-dir", "x"], 2,
     "step 4 saves no checkpoint (--save-every 3)"),
    (["--dp", "2", "--fault", "kill:2:4"], 2, "--fault kill:2:4: the rank must be in 0..1 and the step in 1..30"),
    (["--dropout", "1.0"], 1, "--dropout in [0, 1)"),
])
def test_bad_arguments_are_refused_with_what_to_change(argv, world_size, message):
    with pytest.raises(ValueError) as error:
        prun.check_args(prun.parse_args(argv), world_size)
    assert message in str(error.value)


def test_bad_checkpoints_and_folders_are_refused_naming_the_file_tensor_and_difference(tmp_path):
    saved = TINY + ["--dp", "2", "--steps", "2", "--save-every", "2", "--ckpt-dir", str(tmp_path / "ckpt")]
    parakit.launch(prun.main, saved, world_size=2)
    step2 = tmp_path / "ckpt" / "step2"
    cases = {"another model": (TINY[:1] + ["24"] + TINY[2:] + saved[len(TINY):],
                               f"tensor '0.token.weight': global shape (256, 24) here, (256, 16) in checkpoint "
                               f"{step2}: build the model with the sizes it was saved with"),
             "another seed": (saved + ["--seed", "3"],
                              f"{step2} is a checkpoint of a run with --seed 0, this run has --seed 3: pass --seed 0"),
             "not a folder": (TINY + ["--dp", "2", "--ckpt-dir", str(step2 / "index.json" / "runs")],
                              "cannot write there (Not a directory): pick a folder this process can create and write")}
    for case, (argv, message) in cases.items():
        with pytest.raises(LaunchError) as error:
            parakit.launch(prun.main, argv, world_size=2)
        assert message in str(error.value), case
    os.truncate(step2 / "rank0.bin", 10)
    with pytest.raises(LaunchError) as error:
        parakit.launch(prun.main, saved, world_size=2)
    assert f"shard file {step2}/rank0.bin is truncated" in str(error.value)
    assert parakit.launch(lambda: 1, world_size=2) == [1, 1]  # the pool goes on
