"""Pipeline parallelism: stages, micro-batches, and GPipe, 1F1B, interleaved 1F1B and the
zero-bubble schedules (ZB-H1, ZB-H2, ZB-V) as schedules (data) that can be printed, checked
for deadlocks, simulated, drawn and run.

    split.py      cut an nn.Sequential into stages by `balance`
    actions.py    the typed actions (Op: F, B, W, SEND_F, RECV_F, SEND_B, RECV_B) schedules are made of
    schedules.py  the schedules: per-rank lists of F, B, W, send and receive actions
    simulate.py   time line, bubble and peak activations of a schedule on paper; deadlock checks, on
                  paper and as NCCL runs each rank's batches of sends and receives
    runtime.py    run a schedule on real ranks: `pipeline_step`, `dp_pp_step`
"""
from parakit.pipeline.actions import Action, Op
from parakit.pipeline.runtime import (RankRun, activation_shapes, dp_pp_step, pipeline_run, pipeline_step, run_schedule,
                                      split_microbatches, timeline_of)
from parakit.pipeline.schedules import (SCHEDULES, Schedule, build_schedule, delayed_weight_passes, gpipe,
                                        interleaved_1f1b, one_f_one_b, rank_of, with_communication, zero_bubble_h1,
                                        zero_bubble_h2, zero_bubble_v)
from parakit.pipeline.simulate import (Event, ScheduleError, Timeline, batches, bubble_formula, check_batches,
                                      check_schedule, format_grid, simulate)
from parakit.pipeline.split import balance_from_split_points, split_stages

__all__ = ["Op", "Action", "Schedule", "SCHEDULES", "build_schedule", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zero_bubble_h1", "zero_bubble_h2", "zero_bubble_v", "delayed_weight_passes", "rank_of", "with_communication",
           "Event", "Timeline", "ScheduleError", "simulate", "check_schedule", "check_batches", "batches", "format_grid",
           "bubble_formula",
           "split_stages", "balance_from_split_points", "pipeline_step", "pipeline_run", "timeline_of", "dp_pp_step",
           "run_schedule", "split_microbatches", "activation_shapes", "RankRun"]
