"""Mixture of experts and expert parallelism (lesson 09).

    routing   the router: softmax, top-k, capacity and dropped tokens; balancing and z-losses
    layer     experts as small MLPs and the single-process MoE layer (the reference)
    parallel  the experts split over ranks: dispatch and combine by all-to-all; EP x DP
    train     a tiny MoE model trained with EP x DP, and in one process
"""
from parakit.moe.layer import ExpertMLP, MoE, by_expert, check_width, run_by_expert, weigh_and_sum
from parakit.moe.parallel import (AllToAll, ExpertDataParallel, ExpertMesh, ExpertParallelMoE, all_to_all,
                                  check_divisible, combine, dispatch, exchange_counts, run_local_experts)
from parakit.moe.train import TinyMoE, train_ep_dp, train_one_process
from parakit.moe.routing import Router, Routing, check_top_k, expert_capacity, load_balancing_loss, top_k_route, z_loss

__all__ = ["Router", "Routing", "check_top_k", "expert_capacity", "top_k_route", "load_balancing_loss", "z_loss",
           "ExpertMLP", "MoE", "by_expert", "run_by_expert", "weigh_and_sum", "check_width",
           "AllToAll", "all_to_all", "exchange_counts", "dispatch", "run_local_experts", "combine",
           "ExpertParallelMoE", "ExpertMesh", "ExpertDataParallel", "check_divisible",
           "TinyMoE", "train_ep_dp", "train_one_process"]
