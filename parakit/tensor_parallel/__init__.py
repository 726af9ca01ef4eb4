"""Tensor parallelism (Megatron-LM): the f/g conjugate operators, column- and row-parallel
linear layers, a parallel MLP, self-attention and transformer block, the vocabulary split
across ranks (embedding and cross-entropy), and an RNG tracker for dropout inside the
tensor-parallel regions, and sequence parallelism (the regions between them split by
sequence). Every layer takes `group`, the tensor-parallel process group
(default: the world)."""
from parakit.tensor_parallel.layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention,
                                            ParallelTransformerBlock, RowParallelLinear, tp_size_rank)
from parakit.tensor_parallel.mappings import (CopyToRegion, GatherFromRegion, ReduceFromRegion, ScatterToRegion,
                                              copy_to_region, gather_from_region, gather_from_sequence_region,
                                              reduce_from_region, reduce_scatter_to_sequence_region, scatter_to_region)
from parakit.tensor_parallel.random import RNGTracker
from parakit.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["CopyToRegion", "ReduceFromRegion", "ScatterToRegion", "GatherFromRegion",
           "copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region",
           "gather_from_sequence_region", "reduce_scatter_to_sequence_region",
           "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention",
           "ParallelTransformerBlock", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "RNGTracker", "tp_size_rank"]
