"""Lesson 11's fake students."""
from pathlib import Path

import panel
from conftest import REPO

# ---- global-norm clipping

CLIP_HEAD = '''def clip_grad_norm(model, max_norm, mesh):
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    split, _ = clip.split_places(model)
    squares, grads = torch.zeros(1, device=parakit.device()), []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.grad is not None:
                grads.append(p.grad)
'''
CLIP_TAIL = '''    norm = squares.sqrt()[0]
    for grad in grads:
        grad.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm
'''
COUNTED_ONCE = '''                if (id(module), name) in split or mesh.tp_rank == 0:
                    squares += p.grad.square().sum()
'''
CLIP_FORGETS_PP = CLIP_HEAD + COUNTED_ONCE + '''    dist.all_reduce(squares, group=mesh.tp_group)     # the other stages' layers are left out
''' + CLIP_TAIL
CLIP_TP_TIMES = CLIP_HEAD + '''                squares += p.grad.square().sum()          # replicated gradients too, on every tp rank
    dist.all_reduce(squares, group=mesh.tp_group)
    dist.all_reduce(squares, group=mesh.pp_group)
''' + CLIP_TAIL
CLIP_OVER_DP = CLIP_HEAD + COUNTED_ONCE + '''    for group in (mesh.tp_group, mesh.pp_group, mesh.dp_group):   # the dp replicas summed too
        dist.all_reduce(squares, group=group)
''' + CLIP_TAIL

# ---- the sharded save and load

WRITE_FILE = '''def write_mine(folder, shards, every=False):
    """This rank's file (its writing shards, or with `every` all of them); returns (name, piece) for each."""
    rank, pieces = dist.get_rank(), []
    mine = [s for s in shards if (s.writes or every) and s.tensor.numel()]
    Path(folder).mkdir(parents=True, exist_ok=True)
    if mine:
        with open(Path(folder) / f"rank{rank}.bin", "wb") as f:
            for s in mine:
                pieces.append((s.name, {"file": f"rank{rank}.bin", "byte_offset": f.tell(), "offsets": list(s.offsets),
                                        "lengths": list(s.lengths), "flat": s.flat}))
                f.write(s.tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return pieces


def index_of(reports):
    tensors = {}
    for described, pieces in reports:
        for name, shape, dtype in described:
            tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
        for name, piece in pieces:
            tensors[name]["pieces"].append(piece)
    return {"format": "parakit.state/1", "tensors": tensors}


def gathered(shards, pieces):
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, ([(s.name, list(s.global_shape), str(s.dtype)) for s in shards], pieces))
    return reports
'''

SAVE_RIGHT = WRITE_FILE + '''

def save_sharded(folder, shards):
    try:
        pieces, problem = write_mine(folder, shards), None
    except OSError as error:
        pieces, problem = [], str(error)
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise state.CheckpointError(f"save failed: {problems}")
    reports = gathered(shards, pieces)
    if dist.get_rank() == 0:
        (Path(folder) / "index.tmp").write_text(json.dumps(index_of(reports)))
        os.replace(Path(folder) / "index.tmp", Path(folder) / "index.json")
    dist.barrier()
'''

SAVE_IGNORES_FLAT = SAVE_RIGHT.replace('"flat": s.flat}', '"flat": False}')   # ZeRO-3's ranges described as boxes

SAVE_EVERYTHING = SAVE_RIGHT.replace("write_mine(folder, shards)", "write_mine(folder, shards, every=True)")

SAVE_INDEX_FIRST = WRITE_FILE + '''

def save_sharded(folder, shards):
    rank, pieces, at = dist.get_rank(), [], 0
    for s in shards:                                     # the pieces, known before anything is written
        if s.writes and s.tensor.numel():
            pieces.append((s.name, {"file": f"rank{rank}.bin", "byte_offset": at, "offsets": list(s.offsets),
                                    "lengths": list(s.lengths), "flat": s.flat}))
            at += s.tensor.numel() * s.tensor.element_size()
    reports = gathered(shards, pieces)
    Path(folder).mkdir(parents=True, exist_ok=True)
    if rank == 0:
        with open(Path(folder) / "index.json", "w") as f:   # the index first, under its own name
            json.dump(index_of(reports), f)
    dist.barrier()
    try:
        write_mine(folder, shards)
    except OSError as error:
        raise state.CheckpointError(str(error))
'''

LOAD_PLAN = '''def plan_copies(folder, shards):
    catalog, copies = state.read_catalog(folder), []
    for s in shards:
        entry = catalog.get(s.name)
        if entry is None or entry.shape != tuple(s.global_shape) or entry.dtype != s.dtype:
            raise state.CheckpointError(f"tensor {s.name!r} does not fit checkpoint {folder}")
        for box, view in s.boxes():
            for chunk in entry.chunks:
                common = overlap(chunk.box, box)
                if common:
                    copies.append((chunk, region(common, chunk.box), view[region(common, box)]))
    return catalog, copies


def chunk_of(raw, chunk):
    if len(raw) != chunk.nbytes:
        raise state.CheckpointError(f"{chunk.file} is short")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(chunk.dtype).view(chunk.box[1])


def read_chunk(folder, chunk):
    with open(Path(folder) / chunk.file, "rb") as f:
        f.seek(chunk.byte_offset)
        return chunk_of(f.read(chunk.nbytes), chunk)


def verdict(folder, shards, catalog, problem):
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, ([s.name for s in shards], problem))
    problems = [p for _, p in views if p]
    if not problems and set(catalog) - {n for names, _ in views for n in names}:
        problems = ["a tensor no rank asked for"]
    if problems:
        raise state.CheckpointError(f"load from {folder} failed: {problems}")
'''

LOAD_RIGHT = LOAD_PLAN + '''

def load_resharded(folder, shards):
    catalog, data, problem = {}, {}, None
    try:
        catalog, copies = plan_copies(folder, shards)
        data = {chunk: read_chunk(folder, chunk) for chunk in {c for c, _, _ in copies}}
    except (state.CheckpointError, OSError) as error:
        problem = str(error)
    verdict(folder, shards, catalog, problem)
    with torch.no_grad():
        for chunk, source, target in copies:
            target.copy_(data[chunk][source])
'''

LOAD_ALONE = LOAD_PLAN + '''

def load_resharded(folder, shards):
    catalog, copies = plan_copies(folder, shards)             # each rank on its own: the others never hear of a problem
    data = {chunk: read_chunk(folder, chunk) for chunk in {c for c, _, _ in copies}}
    with torch.no_grad():
        for chunk, source, target in copies:
            target.copy_(data[chunk][source])
'''

LOAD_READS_ALL = LOAD_PLAN + '''

def load_resharded(folder, shards):
    catalog, data, problem = {}, {}, None
    try:
        catalog, copies = plan_copies(folder, shards)
        files = {c.file: (Path(folder) / c.file).read_bytes() for e in catalog.values() for c in e.chunks}   # every file
        data = {c: chunk_of(files[c.file][c.byte_offset:c.byte_offset + c.nbytes], c) for c, _, _ in copies}
    except (state.CheckpointError, OSError) as error:
        problem = str(error)
    verdict(folder, shards, catalog, problem)
    with torch.no_grad():
        for chunk, source, target in copies:
            target.copy_(data[chunk][source])
'''

LOAD_COPIES_FIRST = LOAD_PLAN + '''

def load_resharded(folder, shards):
    catalog, problem = {}, None
    try:
        catalog, copies = plan_copies(folder, shards)
        with torch.no_grad():
            for chunk, source, target in copies:         # copied as read: a later problem leaves it half-loaded
                target.copy_(read_chunk(folder, chunk)[source])
    except (state.CheckpointError, OSError) as error:
        problem = str(error)
    verdict(folder, shards, catalog, problem)
'''

# ---- the resume state

RESUME_TORCH_ONLY = '''def capture_resume(step, seed):
    return {"step": step, "seed": seed, "torch": torch.get_rng_state()}   # Python's and numpy's generators forgotten


def restore_resume(saved, seed):
    if saved["seed"] != seed:
        raise ValueError(f"state of seed {saved['seed']}, run of seed {seed}")
    torch.set_rng_state(saved["torch"])
    return saved["step"]
'''

RESUME_CPU_GENERATORS = '''def capture_resume(step, seed):
    kind, key, position, has_gauss, gauss = np.random.get_state()   # every generator but the device's
    return {"step": step, "seed": seed, "torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (kind, torch.from_numpy(key.astype(np.int64)), position, has_gauss, gauss)}


def restore_resume(saved, seed):
    if saved["seed"] != seed:
        raise ValueError(f"state of seed {saved['seed']}, run of seed {seed}")
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    kind, key, position, has_gauss, gauss = saved["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), position, has_gauss, gauss))
    return saved["step"]
'''

RESUME_FROM_ZERO = '''def capture_resume(step, seed):
    kind, key, position, has_gauss, gauss = np.random.get_state()
    return {"seed": seed, "torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (kind, torch.from_numpy(key.astype(np.int64)), position, has_gauss, gauss)}


def restore_resume(saved, seed):
    if saved["seed"] != seed:
        raise ValueError(f"state of seed {saved['seed']}, run of seed {seed}")
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    kind, key, position, has_gauss, gauss = saved["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), position, has_gauss, gauss))
    return 0                                            # the data starts again at step 0
'''

# ---- the token-weighted loss

TOKEN_MEAN_OF_MEANS = '''def token_weighted_loss(logits, target, group=None, ignore_index=-100):
    if logits.shape[:-1] != target.shape:
        raise ValueError("logits and target disagree")
    local = F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=ignore_index)   # this rank's mean
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return local + (total / dist.get_world_size(group) - local).detach()   # the mean of the ranks' means
'''

TOKEN_WITHOUT_N = '''def token_weighted_loss(logits, target, group=None, ignore_index=-100):
    if logits.shape[:-1] != target.shape:
        raise ValueError("logits and target disagree")
    total = F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=ignore_index, reduction="sum")
    sums = torch.stack([total.detach(), (target != ignore_index).sum().to(total.dtype)])
    dist.all_reduce(sums, group=group)
    return total / sums[1] + (sums[0] - total.detach()) / sums[1]   # each token 1/count, then DDP divides by n again
'''

BORROWED = {
    "clip_grad_norm": "def clip_grad_norm(model, max_norm, mesh):\n    return clip.clip_grad_norm_(model, max_norm, mesh)\n",
    "save_sharded": "def save_sharded(folder, shards):\n    state.save(folder, shards)\n\n\n"
                    "def load_resharded(folder, shards):\n    state.load(folder, shards)\n",
    "capture_resume": "def capture_resume(step, seed):\n    return state.capture(step, seed)\n\n\n"
                      "def restore_resume(saved, seed):\n    return state.restore(saved, seed)\n",
    "token_weighted_loss": "def token_weighted_loss(logits, target, group=None, ignore_index=-100):\n"
                           "    return clip.token_weighted_loss(logits, target, group, ignore_index)\n",
}


def students(lesson: Path, solution: Path) -> list[panel.Student]:
    """Lesson 11. The hard-coder passes every visible test and fails every hidden one: its
    clipping forgets the pp all-reduce (the visible mesh has one stage), its save describes
    ZeRO-3's flat ranges as boxes (the visible tensors are split by rows and columns) and its
    load raises only where the problem is (the visible checkpoint is whole), its resume state
    keeps torch's generator only (the visible run draws from no other), and its loss is the
    mean of the ranks' means (the visible ranks hold as many tokens each). The borrower calls
    parakit's clipping, save, load, resume state and loss: 0 on every test by the tripwires.

    Wrong techniques, each 0 on its exercise's tests: `wrong_techniques` counts the replicated
    gradients on every tp rank, has every rank write every shard it holds (the replicated ones
    too) and reads every file to load, restores every generator but the device's (dropout on
    the emulated GPU box's hidden run draws other masks after the resume), and forgets that
    DDP divides the gradients by n again. The student whose kernel hangs (in the loss) also
    sums the norm over the dp replicas; the one whose kernel dies (in the resume state) also
    writes the index first, under its own name, and copies each piece as it reads it (a rank
    with a damaged file leaves the others half-loaded); the one with missing cells (the
    clipping's tests deleted) also starts the data again at step 0."""
    pts = panel.points(panel.load(lesson))
    full = panel.full_solution(panel.load(lesson), panel.load(solution))
    hardcoded = {"clip_grad_norm": CLIP_FORGETS_PP, "save_sharded": SAVE_IGNORES_FLAT + "\n\n" + LOAD_ALONE,
                 "capture_resume": RESUME_TORCH_ONLY, "token_weighted_loss": TOKEN_MEAN_OF_MEANS}
    wrong = {"clip_grad_norm": CLIP_TP_TIMES, "save_sharded": SAVE_EVERYTHING + "\n\n" + LOAD_READS_ALL,
             "capture_resume": RESUME_CPU_GENERATORS, "token_weighted_loss": TOKEN_WITHOUT_N}
    students = panel.standard_panel(
        lesson, solution, hang_in="token_weighted_loss", crash_in="capture_resume",
        hardcoded=hardcoded, hardcoded_expected=dict.fromkeys(pts, 0.0), borrowed=BORROWED,
        extra=[panel.Student("wrong_technique", {lesson.name: panel.with_sources(full, wrong)}, {})])
    extra_wrongs = {"hang_and_crash": ({"clip_grad_norm": CLIP_OVER_DP,
                                        "save_sharded": SAVE_INDEX_FIRST + "\n\n" + LOAD_COPIES_FIRST},
                                       ["test_clip_grad_norm", "test_save_sharded", "test_load_resharded"]),
                    "missing_cells": ({"capture_resume": RESUME_FROM_ZERO}, ["test_resume"])}
    for student in students:
        if student.name in extra_wrongs:
            sources, zeroed = extra_wrongs[student.name]
            student.files[lesson.name] = panel.with_sources(student.files[lesson.name], sources)
            student.expected.update(dict.fromkeys(zeroed, 0.0))
    return students


LESSON = panel.Lesson(REPO / "solutions" / "11_real_run.ipynb", students, timeout=30)
