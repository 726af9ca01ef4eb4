"""Lesson 08's fake students."""
from pathlib import Path

import panel
from conftest import REPO

NAIVE_MERGE = '''def merge(out_a, lse_a, out_b, lse_b):
    total = torch.exp(lse_a) + torch.exp(lse_b)  # exp of the log-sum-exps themselves: overflows past ~88
    out = (torch.exp(lse_a) / total).unsqueeze(-1) * out_a + (torch.exp(lse_b) / total).unsqueeze(-1) * out_b
    return out, torch.log(total)
'''

NO_HEADS_CHECK = '''def seq_to_heads(x):
    n = dist.get_world_size()
    b, h, s, d = x.shape  # no check that n divides h: reshape fails with torch's own error
    send = x.reshape(b, n, h // n, s, d).movedim(1, 0).contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)
'''

BORROWED_PAIR = '''class GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return tp.gather_from_sequence_region(x)

    @staticmethod
    def backward(ctx, grad):
        return tp.reduce_scatter_to_sequence_region(grad)


class ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return tp.reduce_scatter_to_sequence_region(x)

    @staticmethod
    def backward(ctx, grad):
        return tp.gather_from_sequence_region(grad)
'''

RING_HEAD = '''def ring_forward(q, k, v):
    n, r = dist.get_world_size(), dist.get_rank()
    scale = q.shape[-1] ** -0.5
    kv = torch.stack([k, v])
'''

# Wrong techniques with the right values and a ring's messages: each must score 0 on its exercise.
RING_KEEPS_EVERY_BLOCK = RING_HEAD + '''    blocks = [kv]
    for step in range(n - 1):
        incoming = torch.empty_like(kv)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                           dist.P2POp(dist.irecv, incoming, (r - 1) % n)])
        scores = q @ kv[0].transpose(-1, -2)            # work while the next block moves...
        for request in requests:
            request.wait()
        kv = incoming
        blocks.append(kv)                               # ...but every block is kept
    k_all, v_all = torch.cat([b[0] for b in blocks], 2), torch.cat([b[1] for b in blocks], 2)
    return cp.block_attention(q, k_all, v_all, scale)  # one softmax at the end
'''

RING_BLOCKING = RING_HEAD + '''    out = lse = None
    for step in range(n):
        if step < n - 1:
            incoming = torch.empty_like(kv)
            if r % 2 == 0:                              # blocking: nothing moves while it computes
                dist.send(kv, (r + 1) % n)
                dist.recv(incoming, (r - 1) % n)
            else:
                dist.recv(incoming, (r - 1) % n)
                dist.send(kv, (r + 1) % n)
        part = cp.block_attention(q, kv[0], kv[1], scale)
        out, lse = part if out is None else cp.merge_partials(out, lse, *part)
        if step < n - 1:
            kv = incoming
    return out, lse
'''

RING_WAITS_AT_ONCE = RING_HEAD + '''    out = lse = None
    for step in range(n):
        if step < n - 1:
            incoming = torch.empty_like(kv)
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                                   dist.P2POp(dist.irecv, incoming, (r - 1) % n)]):
                request.wait()                          # posted, then waited before any compute
        part = cp.block_attention(q, kv[0], kv[1], scale)
        out, lse = part if out is None else cp.merge_partials(out, lse, *part)
        if step < n - 1:
            kv = incoming
    return out, lse
'''

BACKWARD_HEAD = '''def ring_backward(do, q, k, v, out, lse):
    n, r = dist.get_world_size(), dist.get_rank()
    scale, delta = q.shape[-1] ** -0.5, (do * out).sum(-1)
    kv = torch.stack([k, v])
'''

BACKWARD_GATHERS = '''def ring_backward(do, q, k, v, out, lse):
    n, r = dist.get_world_size(), dist.get_rank()
    kv = torch.stack([k, v])
    every = torch.empty(n * 2, *k.shape, dtype=k.dtype, device=k.device)
    dist.all_gather_into_tensor(every, kv)                  # every rank's K and V at once
    k_all, v_all = (torch.cat(list(every[i::2]), 2) for i in (0, 1))
    dq, dk, dv = cp.block_attention_backward(do, q, k_all, v_all, lse, (do * out).sum(-1), q.shape[-1] ** -0.5)
    dkv = torch.cat([torch.stack(pair) for pair in zip(dk.chunk(n, 2), dv.chunk(n, 2))])
    mine = torch.empty_like(kv)
    dist.reduce_scatter_tensor(mine, dkv)                   # each block's dK, dV summed on its owner
    return dq, mine[0], mine[1]
'''

BACKWARD_STRAIGHT_HOME = BACKWARD_HEAD + '''    dq, dkv = torch.zeros_like(q), torch.zeros_like(kv)
    for step in range(n):
        if step < n - 1:
            nxt = torch.empty_like(kv)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                               dist.P2POp(dist.irecv, nxt, (r - 1) % n)])
        dq_part, dk, dv = cp.block_attention_backward(do, q, kv[0], kv[1], lse, delta, scale)
        dq += dq_part
        share = torch.stack([dk, dv])
        if step == 0:
            dkv += share                                    # my own block's part stays
        else:                                               # straight home to the block's owner, r - step,
            got = torch.empty_like(share)                   # and my block's part from r + step
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, share, (r - step) % n),
                                                   dist.P2POp(dist.irecv, got, (r + step) % n)]):
                request.wait()
            dkv += got
        if step < n - 1:
            for request in requests:
                request.wait()
            kv = nxt
    return dq, dkv[0], dkv[1]
'''

BACKWARD_KEEPS_EVERY_BLOCK = BACKWARD_HEAD + '''    blocks, incoming, in_flight = [], None, []
    for step in range(n):
        requests = []
        if step < n - 1:
            nxt = torch.empty_like(kv)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                               dist.P2POp(dist.irecv, nxt, (r - 1) % n)])
        _, dk, dv = cp.block_attention_backward(do, q, kv[0], kv[1], lse, delta, scale)
        blocks.append(kv)                                   # every block kept, for dq at the end
        share = torch.stack([dk, dv])
        for request in in_flight + requests:
            request.wait()
        if incoming is not None:
            share += incoming
        if n > 1:
            incoming = torch.empty_like(share)
            in_flight = dist.batch_isend_irecv([dist.P2POp(dist.isend, share, (r + 1) % n),
                                                dist.P2POp(dist.irecv, incoming, (r - 1) % n)])
        if step < n - 1:
            kv = nxt
    for request in in_flight:
        request.wait()
    k_all, v_all = torch.cat([b[0] for b in blocks], 2), torch.cat([b[1] for b in blocks], 2)
    dq = cp.block_attention_backward(do, q, k_all, v_all, lse, delta, scale)[0]   # over every key at once
    dkv = incoming if n > 1 else share
    return dq, dkv[0], dkv[1]
'''

BACKWARD_WAITS_AT_ONCE = BACKWARD_HEAD + '''    dq, incoming = torch.zeros_like(q), None
    for step in range(n):
        if step < n - 1:
            nxt = torch.empty_like(kv)
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                                   dist.P2POp(dist.irecv, nxt, (r - 1) % n)]):
                request.wait()                              # posted, then waited before any compute
        dq_part, dk, dv = cp.block_attention_backward(do, q, kv[0], kv[1], lse, delta, scale)
        dq += dq_part
        share = torch.stack([dk, dv]) + (incoming if incoming is not None else 0)
        if n > 1:
            incoming = torch.empty_like(share)
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, share, (r + 1) % n),
                                                   dist.P2POp(dist.irecv, incoming, (r - 1) % n)]):
                request.wait()                              # the accumulator too
        if step < n - 1:
            kv = nxt
    dkv = incoming if n > 1 else share
    return dq, dkv[0], dkv[1]
'''

CAUSAL_NO_SKIP = '''def ring_forward_causal(q, k, v):
    n, r = dist.get_world_size(), dist.get_rank()
    scale, mine = q.shape[-1] ** -0.5, (r, 2 * n - 1 - r)
    kv = torch.stack([k, v])
    acc = [None, None]
    for step in range(n):
        if step < n - 1:
            incoming = torch.empty_like(kv)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                               dist.P2POp(dist.irecv, incoming, (r - 1) % n)])
        owner = (r - step) % n
        theirs = (owner, 2 * n - 1 - owner)
        for a, (i, qc) in enumerate(zip(mine, q.chunk(2, dim=2))):
            for j, kc, vc in zip(theirs, kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)):
                s = (qc @ kc.transpose(-1, -2)) * scale   # every pair computed, the masked ones thrown away
                if j > i:
                    s = torch.full_like(s, float("-inf"))
                elif j == i:
                    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
                lse = torch.logsumexp(s, -1)
                part = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1))) @ vc, lse
                acc[a] = part if acc[a] is None else cp.merge_partials(*acc[a], *part)
        if step < n - 1:
            for request in requests:
                request.wait()
            kv = incoming
    return torch.cat([acc[0][0], acc[1][0]], dim=2), torch.cat([acc[0][1], acc[1][1]], dim=2)
'''

PAIR_ALL_REDUCE = BORROWED_PAIR.replace("tp.gather_from_sequence_region(x)", "gather(x)").replace(
    "tp.reduce_scatter_to_sequence_region(grad)", "reduce_scatter(grad)").replace(
    "tp.reduce_scatter_to_sequence_region(x)", "reduce_scatter(x)").replace(
    "tp.gather_from_sequence_region(grad)", "gather(grad)") + '''

def gather(x):                                          # all-reduce of my slice in a zero tensor
    t, r = dist.get_world_size(), dist.get_rank()
    full = torch.zeros(x.shape[0], t * x.shape[1], *x.shape[2:], dtype=x.dtype, device=x.device)
    full[:, r * x.shape[1]:(r + 1) * x.shape[1]] = x
    dist.all_reduce(full)
    return full


def reduce_scatter(x):                                  # all-reduce, then keep my slice
    x = x.clone()
    dist.all_reduce(x)
    return x.chunk(dist.get_world_size(), 1)[dist.get_rank()].contiguous()
'''

ULYSSES_ALL_GATHER = '''def seq_to_heads(x):
    n, r = dist.get_world_size(), dist.get_rank()
    b, h, s, d = x.shape
    if h % n:
        raise ValueError(f"{h} heads are not divisible by the Ulysses degree {n}")
    every = torch.empty(n * b, h, s, d, dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(every, x.contiguous())   # every rank's every head: n times the bytes
    mine = every.view(n, b, h, s, d)[:, :, r * (h // n):(r + 1) * (h // n)]
    return mine.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)
'''

# Right, written another way: each keeps full marks.
RING_OWN_MATH = '''def ring_forward(q, k, v):
    n, r = dist.get_world_size(), dist.get_rank()
    b = k.shape[0]
    kv = torch.cat([k, v]).contiguous()                 # [2b, h, c, d]: the same bytes as a stack
    out = lse = None
    for step in range(n):
        requests = []
        if step < n - 1:
            nxt = torch.empty_like(kv)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                               dist.P2POp(dist.irecv, nxt, (r - 1) % n)])
        s = torch.einsum("bhqd,bhkd->bhqk", q, kv[:b]) * q.shape[-1] ** -0.5
        l = torch.logsumexp(s, -1)
        o = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), kv[b:])
        if out is None:
            out, lse = o, l
        else:
            new = torch.logaddexp(lse, l)
            out, lse = out * (lse - new).exp()[..., None] + o * (l - new).exp()[..., None], new
        for request in reversed(requests):              # waited in the other order
            request.wait()
        if requests:
            kv = nxt
    return out, lse
'''

CAUSAL_KEYS_FIRST = '''def ring_forward_causal(q, k, v):
    n, r = dist.get_world_size(), dist.get_rank()
    scale, mine = q.shape[-1] ** -0.5, (r, 2 * n - 1 - r)
    kv = torch.stack([k, v])
    out = [None, None]
    for step in range(n):
        if step < n - 1:
            incoming = torch.empty_like(kv)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                               dist.P2POp(dist.irecv, incoming, (r - 1) % n)])
        owner = (r - step) % n
        for j, kc, vc in zip((owner, 2 * n - 1 - owner), kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)):
            for a, (i, qc) in enumerate(zip(mine, q.chunk(2, dim=2))):   # key chunks outside, queries inside
                if j <= i:
                    part = cp.block_attention(qc, kc, vc, scale, diagonal=(i == j))
                    out[a] = part if out[a] is None else cp.merge_partials(*out[a], *part)
        if step < n - 1:
            for request in requests:
                request.wait()
            kv = incoming
    return torch.cat([out[0][0], out[1][0]], dim=2), torch.cat([out[0][1], out[1][1]], dim=2)
'''

# The causal ring above with its send and its receive posted apart, not as one batch: under NCCL's
# rules every rank's send waits for a receive posted after the next rank's own send, and the ring hangs.
CAUSAL_POSTED_APART = CAUSAL_KEYS_FIRST.replace(
    """dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                               dist.P2POp(dist.irecv, incoming, (r - 1) % n)])""",
    "[dist.isend(kv, (r + 1) % n), dist.irecv(incoming, (r - 1) % n)]")
assert CAUSAL_POSTED_APART != CAUSAL_KEYS_FIRST

BACKWARD_ACCUMULATOR_FIRST = '''def ring_backward(do, q, k, v, out, lse):
    n, r = dist.get_world_size(), dist.get_rank()
    scale, delta = q.shape[-1] ** -0.5, (do * out).sum(-1, keepdim=True)
    kv, done, dq = torch.stack([k, v]), None, torch.zeros_like(q)
    for step in range(n):
        requests = []
        if done is not None:                                # last step's accumulator first, then K and V
            incoming = torch.empty_like(done)
            requests += dist.batch_isend_irecv([dist.P2POp(dist.isend, done, (r + 1) % n),
                                                dist.P2POp(dist.irecv, incoming, (r - 1) % n)])
        if step < n - 1:
            nxt = torch.empty_like(kv)
            requests += dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                                dist.P2POp(dist.irecv, nxt, (r - 1) % n)])
        p = torch.exp(torch.einsum("bhqd,bhkd->bhqk", q, kv[0]) * scale - lse[..., None])
        ds = p * (torch.einsum("bhqd,bhkd->bhqk", do, kv[1]) - delta)
        dq += torch.einsum("bhqk,bhkd->bhqd", ds, kv[0]) * scale
        mine = torch.stack([torch.einsum("bhqk,bhqd->bhkd", ds, q) * scale, torch.einsum("bhqk,bhqd->bhkd", p, do)])
        for request in reversed(requests):                  # waited in the other order
            request.wait()
        done = mine if step == 0 else mine + incoming
        if step < n - 1:
            kv = nxt
    if n > 1:                                               # the last one goes home
        home = torch.empty_like(done)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, done, (r + 1) % n),
                                               dist.P2POp(dist.irecv, home, (r - 1) % n)]):
            request.wait()
        done = home
    return dq, done[0], done[1]
'''

PAIR_OTHER_CALLS = '''class GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return all_gather_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad)


class ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad)


def all_gather_seq(x):                                  # a list of slices, concatenated along the sequence
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces, dim=1)


def reduce_scatter_seq(x):
    t = dist.get_world_size()
    x = torch.cat(x.chunk(t, dim=1))                    # [t * b, s/t, h]: rank i's piece i-th along dim 0
    out = torch.empty(x.shape[0] // t, *x.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, x)
    return out
'''

BORROWED = {
    "merge": "def merge(out_a, lse_a, out_b, lse_b):\n    return cp.merge_partials(out_a, lse_a, out_b, lse_b)\n",
    "ring_forward": "def ring_forward(q, k, v):\n    return cp.ring_attention_forward(q, k, v)\n",
    "ring_forward_causal": "def ring_forward_causal(q, k, v):\n"
                           "    return cp.ring_attention_forward(q, k, v, causal=True, layout='zigzag')\n",
    "sequence_pair": BORROWED_PAIR,
    "seq_to_heads": "def seq_to_heads(x):\n    return ulysses.seq_to_heads(x)\n",
    "ring_backward": "def ring_backward(do, q, k, v, out, lse):\n"
                     "    return cp.ring_attention_backward(do, q, k, v, out, lse)\n",
}


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 08. The hard-coder merges with exp of the log-sum-exps themselves (overflows on
    the hidden large ones) and re-shards without checking that the ranks divide the heads:
    each fails its hidden tests. The borrower calls parakit's merge, ring, sequence pair,
    re-shard and ring backward: 0 on every exercise. The kernel hangs in the causal ring and
    dies in the re-shard. Wrong techniques with right values, 0 on their exercises: rings that
    keep every block, forward (one softmax at the end) and backward (dq over every key at the
    end; the bytes held grow), a forward with blocking send/recv and a causal ring whose send
    and receive are posted apart (it hangs under NCCL's rules), a forward and a backward that
    wait on each transfer before computing (nothing in flight while they compute), a causal ring
    that computes the masked chunk pairs and throws them away (more multiply-adds), a sequence
    pair made of all-reduces, a re-shard by all-gather with a backward that all-gathers K and V
    and reduce-scatters dK, dV (`gathers_instead`), and a backward that passes K and V round the
    ring but sends each block's dK, dV straight home to its owner (other peers, fewer bytes).
    Right ones written another way keep full marks: a ring with K and V concatenated, einsum,
    logaddexp and its waits reversed, with a backward in einsum that posts the accumulator at
    the top of the next step, before K and V; a causal ring looping over key chunks first; a
    sequence pair with a list all-gather and the pieces laid out by hand."""
    hardcoded = {"merge": NAIVE_MERGE, "seq_to_heads": NO_HEADS_CHECK}
    full, pts = panel.full_solution(panel.load(lesson), panel.load(solution)), panel.points(panel.load(lesson))

    def student(name, sources, zero=()):
        return panel.Student(name, {Path(lesson).name: panel.with_sources(full, sources)},
                             {t: 0.0 if t in zero else p for t, p in pts.items()})

    extra = [
        student("ring_keeps_every_block", {"ring_forward": RING_KEEPS_EVERY_BLOCK,
                                           "ring_backward": BACKWARD_KEEPS_EVERY_BLOCK},
                ("test_ring_forward", "test_ring_backward")),
        student("ring_blocking", {"ring_forward": RING_BLOCKING, "ring_forward_causal": CAUSAL_POSTED_APART},
                ("test_ring_forward", "test_ring_forward_causal")),
        student("ring_waits_at_once", {"ring_forward": RING_WAITS_AT_ONCE, "ring_backward": BACKWARD_WAITS_AT_ONCE},
                ("test_ring_forward", "test_ring_backward")),
        student("causal_no_skip", {"ring_forward_causal": CAUSAL_NO_SKIP}, ("test_ring_forward_causal",)),
        student("pair_all_reduce", {"sequence_pair": PAIR_ALL_REDUCE}, ("test_sequence_pair",)),
        student("gathers_instead", {"seq_to_heads": ULYSSES_ALL_GATHER, "ring_backward": BACKWARD_GATHERS},
                ("test_seq_to_heads", "test_ring_backward")),
        student("backward_straight_home", {"ring_backward": BACKWARD_STRAIGHT_HOME}, ("test_ring_backward",)),
        student("ring_own_math", {"ring_forward": RING_OWN_MATH, "ring_backward": BACKWARD_ACCUMULATOR_FIRST}),
        student("causal_keys_first", {"ring_forward_causal": CAUSAL_KEYS_FIRST}),
        student("pair_other_calls", {"sequence_pair": PAIR_OTHER_CALLS}),
    ]
    return panel.standard_panel(
        lesson, solution, hang_in="ring_forward_causal", crash_in="seq_to_heads", hardcoded=hardcoded,
        hardcoded_expected={"test_merge": 0.0, "test_seq_to_heads": 0.0}, borrowed=BORROWED, extra=extra)


LESSON = panel.Lesson(REPO / "solutions" / "08_long_sequences.ipynb", students, timeout=60)
