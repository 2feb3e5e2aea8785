"""Start-up checks, before anything is trained: memory for a step, and the run directory.

`check_memory` refuses a batch whose activations cannot fit (the kernel's OOM killer would end
the run mid-step with no message of ours). `claim` takes the run directory for this run:
creates OUT and OUT/checkpoints, locks OUT/.lock (`lock`), proves OUT/checkpoints writable by
creating and removing a probe file, and checks that one checkpoint fits in the free space. Each
check is made once (rank 0 for the files; every node for its memory) and agreed, so every rank
raises the same ConfigError (exit 2) and rank 0 prints it once. A failed start removes the
directories and the lock file it created, so it leaves nothing behind.
"""

import bisect
import contextlib
import os
import pathlib
import socket
import sys
from dataclasses import dataclass, field, replace

from capstone.checkpoint import files
from capstone.collective.agree import agreed
from capstone.config import ConfigError
from capstone.runtime import lock

MIB = 1 << 20


def activation_bytes(mcfg, tcfg, recompute: bool = False, layers: int | None = None, keys: int | None = None) -> int:
    """Peak bytes of one micro-batch's forward+backward graph on one rank (autograd keeps every
    intermediate). Calibrated on measured peak RSS (float32; per position about 26 C floats per
    layer, 4 H T for attention, 4 V + 4 C for the head), within ~10% above the measurements.
    `recompute`: the forward keeps each block's input (C floats), the backward one block's activations.
    `layers`: the blocks of this rank's pipeline stage (None: all). `keys`: the keys per query row
    attention holds at once (None: T; --cp's ring: a tile's, capstone.model.ring). --dropout adds each
    block's masks: the two residual branches' (2 C) and the attention probabilities' (H T; the ring
    draws each tile's again in its backward instead) (measured: tests/test_dropout.py)."""
    c, t, h, v = mcfg.d_model, mcfg.seq_len, mcfg.n_heads, mcfg.vocab_size
    n_layers = mcfg.n_layers if layers is None else layers
    masks = (2 * c + (h * t if keys is None else 0)) if mcfg.dropout else 0
    block = 26 * c + 4 * h * (t if keys is None else keys) + masks
    per_position = 4 * ((n_layers * c + block if recompute else n_layers * block) + 4 * v + 4 * c)
    return tcfg.batch_size * t * per_position


def model_state_bytes(mcfg, plan, groups: tuple | None = None) -> int:
    """Bytes of the model's state on one rank of `plan`: the run's formula (capstone.observe.memory.states),
    its transient terms estimated before the reducer and seam exist (two of the largest parameter groups
    in flight; --reshard step at stages 2-3: the whole gradient, stage 3's groups all gathered);
    `groups`: a pipeline stage's; the snapshot about the canonical vectors' shard over the world."""
    from capstone.model.params import Layout
    from capstone.observe.memory import states
    layout = Layout.for_model(mcfg, plan.zero_group, plan.tp, groups)
    group, stage = 4 * max(b - a for a, b in layout.group_ranges().values()), plan.zero.stage
    whole = plan.reshard == "step" and stage > 1

    def reduce(grads: int) -> int:
        return 4 * layout.shard + 4 * layout.padded if stage == 1 or whole else 0 if stage == 0 else 2 * group
    gathered = (4 * layout.padded if whole else 2 * group) if stage == 3 else 0
    return states(plan, layout.padded, reduce, gathered, layout.shard).total


def available_bytes() -> tuple[int | None, str]:
    """Memory this node can still give (MemAvailable, capped by a cgroup limit such as Slurm's
    --mem), and where the number comes from."""
    avail, source = None, "MemAvailable in /proc/meminfo"
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        avail = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    if (room := _cgroup_room()) is not None and (avail is None or room < avail):
        avail, source = room, "the memory limit of this job's cgroup"
    return avail, source


def _cgroup_room() -> int | None:
    """limit - usage of this process's memory cgroup (v2 or v1), None when unlimited or unknown."""
    with contextlib.suppress(OSError):
        lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
        for _, controllers, path in (line.strip().split(":", 2) for line in lines if line.count(":") >= 2):
            for directory, limit_file, usage_file in _cgroup_files(controllers, path):
                with contextlib.suppress(OSError, ValueError):   # this one unreadable: the next
                    limit = pathlib.Path(directory, limit_file).read_text().strip()
                    usage = int(pathlib.Path(directory, usage_file).read_text())
                    if limit.isdigit() and int(limit) < 1 << 60:   # "max" or a huge number: unlimited
                        return int(limit) - usage
    return None


def _cgroup_files(controllers: str, path: str) -> list[tuple[str, str, str]]:
    if controllers == "":   # cgroup v2
        return [(base + path, "memory.max", "memory.current") for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")]
    if "memory" in controllers.split(","):
        return [("/sys/fs/cgroup/memory" + path, "memory.limit_in_bytes", "memory.usage_in_bytes")]
    return []


def checkpoint_bytes(mcfg, plan) -> int:
    """Peak bytes a model-parallel rank's checkpoint conversion adds (capstone.parallel.canonical, one of
    master/m/v at a time): its part gathered over its data-parallel group, every part of its replica (the
    largest part's size each) with its own copy, the canonical vector, and a part's position map (int64,
    a mask and their copies: 21 bytes an element). 0 without model parallelism (shards are stored as they are)."""
    from capstone.model.params import Layout
    mp = plan.tp * plan.pp
    if mp == 1:
        return 0
    width = max(Layout.for_model(mcfg, 1, plan.tp, g).n_params for g in plan.stages)
    part = max(Layout.for_model(mcfg, plan.world // mp, plan.tp, g).padded for g in plan.stages)
    return 4 * part + 4 * width * (1 + mp) + 4 * Layout.for_model(mcfg, plan.world).padded + 21 * width


def estimate(mcfg, tcfg, plan) -> tuple[int, int]:
    """(transient: activations or a checkpoint's conversion, model states) in bytes of the heaviest rank
    of the run `plan` lays out: the transient the larger of a step's activations and a checkpoint's
    conversion (`checkpoint_bytes`); with --pp, the largest stage holding the micro-batches its schedule
    keeps in flight (1f1b: up to K of them; afab: all; zb-h1: 1f1b's, stage p with p held-back weight passes
    besides its K - p, which stage 0 outweighs), and a tied head's wte on the last stage (its copy,
    and the share of its gradient of each micro-batch in flight: capstone.parallel.tiedstages)."""
    whole = mcfg
    ckpt, keys = checkpoint_bytes(mcfg, plan), None
    if plan.cp > 1:   # a rank's part of each sequence: T / cp rows; the ring holds one tile's scores at a time
        from capstone.model.ring import TILE
        mcfg, keys = replace(mcfg, seq_len=mcfg.seq_len // plan.cp), TILE
    if plan.pp == 1:
        return max(ckpt, activation_bytes(mcfg, tcfg, plan.recompute, keys=keys)), model_state_bytes(whole, plan)
    in_flight = tcfg.grad_accum if plan.schedule == "afab" else min(plan.pp, tcfg.grad_accum)
    layers = max(sum(g not in ("embed", "head") for g in groups) for groups in plan.stages)
    states = [model_state_bytes(whole, plan, groups) for groups in plan.stages]
    states[-1] += 4 * whole.vocab_size * whole.d_model * (1 + in_flight) * whole.tie_embeddings
    return max(ckpt, in_flight * activation_bytes(mcfg, tcfg, plan.recompute, layers, keys)), max(states)


def ranks_needed(mcfg, tcfg, plan, cap: int) -> str:
    """In words: the fewest ranks (the data-parallel size grown, tp and pp kept) at which a rank's step
    fits in `cap` bytes, with ZeRO-3 and --recompute, whose model states shrink as the ranks grow."""
    from capstone.plan import Zero
    parts = plan.tp * plan.pp

    def sharded(dp: int):
        return plan.on(dp * parts, zero=Zero(3), recompute=True, reshard="micro-batch")
    sizes = [d for d in range(1, 4097) if tcfg.global_batch % (d * tcfg.grad_accum) == 0 or not tcfg.global_batch]

    def need(i: int) -> int:
        return sum(estimate(mcfg, tcfg, sharded(sizes[i])))
    # a rank's bytes shrink as the replicas grow: the first that fits, by bisection
    i = bisect.bisect_left(range(len(sizes)), True, key=lambda i: need(i) <= cap)
    if i < len(sizes):
        return (f"at {cap / MIB:.0f} MiB per rank it needs {sizes[i] * parts} ranks (--zero-stage 3 --recompute, data "
                f"parallel {sizes[i]} x pp {plan.pp} x tp {plan.tp}: {need(i) / MIB:.0f} MiB each)")
    (acts, states), ckpt = estimate(mcfg, tcfg, sharded(4096)), checkpoint_bytes(mcfg, sharded(4096))
    if ckpt >= acts and ckpt > cap:
        return (f"at {cap / MIB:.0f} MiB per rank no number of ranks fits it: a checkpoint's conversion to the 1-rank "
                f"layout alone takes {ckpt / MIB:.0f} MiB (every model-parallel rank assembles the whole model)")
    if acts > cap:
        return (f"at {cap / MIB:.0f} MiB per rank no number of ranks fits it: one micro-batch's activations alone "
                f"take {acts / MIB:.0f} MiB (lower --batch-size or --seq-len, or add --pp stages)")
    return (f"at {cap / MIB:.0f} MiB per rank no number of ranks up to {4096 * parts} fits it: its model states "
            f"alone take {states / MIB:.0f} MiB per rank even then (a smaller model: --d-model, --n-layers)")


def check_memory(comm, mcfg, tcfg, plan) -> None:
    """Collective. ConfigError on every rank if a step's model states and activations do not fit on some node."""
    acts, states = estimate(mcfg, tcfg, plan)
    need = acts + states
    local = comm.node_size()
    avail, source = available_bytes()

    def check() -> None:
        if avail is not None and need * local > avail:
            raise ConfigError(
                f"--batch-size {tcfg.batch_size} at --seq-len {mcfg.seq_len} needs about {need / MIB:.0f} MiB per rank "
                f"({acts / MIB:.0f} MiB of activations{' with --recompute' if plan.recompute else ''} or a "
                f"checkpoint's conversion, {states / MIB:.0f} MiB of model states at --zero-stage {plan.zero.stage}; "
                f"{local} ranks on {socket.gethostname()}: {need * local / MIB:.0f} MiB), but only {avail / MIB:.0f} "
                f"MiB is available ({source}); the kernel would kill the run in its first step; "
                f"{ranks_needed(mcfg, tcfg, plan, avail // local)}. Lower --batch-size (raise --grad-accum to keep the "
                f"global batch) or --seq-len, add --recompute, raise --zero-stage, or run fewer ranks per node.")
    agreed(comm, check, errors=(ConfigError,), every=True, explain=lambda failed: ConfigError(failed[0][1]))


@dataclass
class Claim:
    """What a start created in the file system (rank 0), so that a failed start can undo it."""

    created: list = field(default_factory=list)   # directories, outermost first
    lock: "lock.Held | None" = None   # rank 0: the run directory's lock
    lock_path: str | None = None                  # the lock file, if this start created it

    def undo(self) -> None:
        if self.lock is not None:
            self.lock.release()
        if self.lock_path:
            with contextlib.suppress(OSError):
                os.remove(self.lock_path)
        for d in reversed(self.created):
            with contextlib.suppress(OSError):
                os.rmdir(d)   # only if empty: never removes anything else


def claim(comm, out: str, ckpt_dir: str, ckpt_bytes: int) -> Claim:
    """Collective. Create, lock and check the run directory; ConfigError on every rank if any
    check fails (after undoing what was created). Rank 0's Claim holds the lock."""
    done = Claim()
    try:
        agreed(comm, lambda: _claim(done, out, ckpt_dir, ckpt_bytes), errors=(ConfigError,))
    except ConfigError:
        done.undo()   # rank 0's: what it created (the other ranks' Claim is empty)
        raise
    return done


def _claim(done: Claim, out: str, ckpt_dir: str, ckpt_bytes: int) -> None:
    for d in (out, ckpt_dir):
        if os.path.exists(d) and not os.path.isdir(d):
            raise ConfigError(f"{d} exists and is not a directory; pass a directory (new or a run's) as --out.")
    _make_dirs(done, ckpt_dir)
    lock_path = os.path.join(out, lock.NAME)
    existed = os.path.exists(lock_path)
    try:
        done.lock, warning = lock.acquire(out)
    except BlockingIOError as exc:
        raise ConfigError(f"another run is using --out {out}: {exc}. Wait for it to end, stop it (kill -USR1 "
                          f"<its mpirun pid>, or scancel --signal=USR1 --batch <its job id>), or pass another "
                          f"--out.") from None
    except OSError as exc:
        raise ConfigError(f"cannot create the lock file {lock_path}: {exc.strerror}. Make {out} writable "
                          f"(chmod u+w {out}) or pass another --out.") from None
    done.lock_path = None if existed else lock_path
    if warning:
        print(warning, file=sys.stderr, flush=True)
    for d in (out, ckpt_dir):   # metrics.jsonl and summary.json go to OUT, checkpoints below it
        _probe(d)
    if (free := files.lacking_space(ckpt_dir, ckpt_bytes)) is not None:
        raise ConfigError(f"{ckpt_dir} has {free / MIB:.1f} MiB free but one checkpoint needs about "
                          f"{ckpt_bytes / MIB:.1f} MiB: free space there, or pass an --out on a larger filesystem.")


def _make_dirs(done: Claim, ckpt_dir: str) -> None:
    missing, d = [], os.path.abspath(ckpt_dir)
    while not os.path.exists(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except OSError as exc:
            raise ConfigError(f"cannot create the run directory {d}: {exc.strerror}. Choose an --out where you can "
                              f"write (under your home or scratch directory), or fix the permissions of "
                              f"{os.path.dirname(d)}.") from None
        done.created.append(d)


def _probe(directory: str) -> None:
    probe = os.path.join(directory, f".probe-{socket.gethostname()}-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"{directory} is not writable ({exc.strerror}): the run could not save its "
                          f"checkpoints and summary there. Fix its permissions (chmod u+w {directory}) or pass "
                          f"another --out.") from None
