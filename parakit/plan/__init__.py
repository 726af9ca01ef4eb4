"""Plan a training run: for a transformer, a cluster and a parallel configuration, the
bytes each device holds (parameters, gradients, optimizer state, activations, buffers) and
the time of a step (compute, exposed communication, bubble), itemised; a search over
configurations; and the same model checked on real ranks (`parakit.plan.measure`).
Every figure here is a model; `measure.compare` prints its error against measurement.

    model = Model(layers=32, hidden=4096, heads=32, seq=2048, vocab=50304)
    cluster = Cluster(devices_per_node=8, nodes=4, memory=80e9, flops=989e12)
    memory(model, cluster, Config(dp=4, tp=8, sp=True, microbatches=8)).items
    fits, rejected = search(model, cluster, global_batch=256)
"""
from parakit.plan.memory import (Memory, PlanError, ZeroLayout, in_flight, layer_activation_bytes, layer_params, layer_tensors,
                                 memory, recompute_bytes, stage_params, stage_tensors, zero_layout)
from parakit.plan.search import Candidate, search
from parakit.plan.spec import CHECKPOINTING, DTYPES, SCHEDULES, Cluster, Config, Model, problems
from parakit.plan.time import StepTime, Traffic, link, step_flops, step_time, traffic

__all__ = ["Model", "Cluster", "Config", "DTYPES", "SCHEDULES", "CHECKPOINTING", "problems", "Memory", "PlanError",
           "memory", "layer_tensors", "layer_params", "stage_tensors", "stage_params", "ZeroLayout", "zero_layout",
           "layer_activation_bytes", "recompute_bytes", "in_flight", "StepTime", "Traffic", "traffic", "step_flops",
           "step_time", "link", "Candidate", "search"]
