"""Sharded checkpoints on real MPI + parallel HDF5: round trip, resharding, corruption."""

import hashlib
import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from capstone import checkpoint
from capstone.checkpoint import CheckpointError, files, integrity
from capstone.checkpoint.digest import logical_root
from capstone.config import ModelConfig
from capstone.model.params import Layout
from capstone.collective.comm import Comm
from capstone.step.state import ROWS, ShardState

CFG = ModelConfig(vocab_size=29, seq_len=4, d_model=8, n_heads=2, n_layers=1)
EXPECT = {"model_config": {"cfg": 1}}


def logical(layout, step=0):
    """The unsharded rows (master, m, v, good_*) every test saves: a formula of the position."""
    i = np.arange(layout.n_params, dtype=np.float64)
    return [np.sin(i * (k + 1) + step).astype(np.float32) for k in range(len(ROWS))]


def shard_state(layout, rank, step=0) -> ShardState:
    lo, hi = layout.shard_range(rank)
    rows = []
    for vec in logical(layout, step):
        padded = np.zeros(layout.padded, dtype=np.float32)
        padded[:layout.n_params] = vec
        rows.append(padded[lo:hi].copy())
    return ShardState(*rows, t=10 + step)


def save(d: Comm, directory, step=10, keep_last=0):
    layout = Layout.for_model(CFG, d.size)
    return checkpoint.save(d, directory, step, shard_state(layout, d.rank, step), layout,
                           {"model_config": {"cfg": 1}, "run": {"data_cursor": 123}}, keep_last)


def test_round_trip_and_sha256_matches_plain_h5py(world, shared_tmp):
    man = save(world, shared_tmp)
    assert man["path"].endswith("ckpt-00000010.h5")
    layout = Layout.for_model(CFG, world.size)
    state, meta = checkpoint.load(world, man["path"], layout, EXPECT)
    want = shard_state(layout, world.rank, 10)
    for k in ROWS:
        assert getattr(state, k).tobytes() == getattr(want, k).tobytes()
    assert state.t == 20 and meta["run"]["data_cursor"] == 123 and meta["world_size"] == world.size
    if world.rank == 0:  # serial plain h5py, no MPI driver
        with h5py.File(man["path"], "r") as f:
            assert sorted(f["shards"]) == [f"rank{r:05d}" for r in range(world.size)]
            for r in range(world.size):
                ds = f[f"shards/rank{r:05d}"]
                assert ds.attrs["sha256"] == hashlib.sha256(ds[...].tobytes()).hexdigest()
        assert files.read_pointer(shared_tmp) == man["path"]
        with open(man["path"] + ".sha256") as f:  # sha256sum -c format, size in a comment line
            assert f.read() == (f"# capstone checkpoint digest v1: {os.path.getsize(man['path'])} bytes\n"
                                f"{integrity.file_sha256(man['path'])}  ckpt-00000010.h5\n")
    world.Barrier()


def test_verify_snapshot_counts_differing_bytes(world, shared_tmp):
    man = save(world, shared_tmp)
    layout = Layout.for_model(CFG, world.size)
    st = shard_state(layout, world.rank, 10)
    snap = np.stack(st.rows())
    assert checkpoint.verify_snapshot(world, man["path"], layout, EXPECT, snap)["ok"]
    if world.rank == world.size - 1:
        snap[2, 0] += 1.0
    res = checkpoint.verify_snapshot(world, man["path"], layout, EXPECT, snap)
    assert not res["ok"] and 1 <= res["mismatched_bytes"] <= 4


@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_reshard_from_all_ranks_to_fewer(world, shared_tmp, new_world):
    man = save(world, shared_tmp)
    color = 0 if world.rank < new_world else MPI.UNDEFINED
    sub = world.mpi.Split(color, world.rank)
    if sub != MPI.COMM_NULL:
        d = Comm(sub)
        layout = Layout.for_model(CFG, d.size)
        state, meta = checkpoint.load(d, man["path"], layout, EXPECT)
        want = shard_state(layout, d.rank, 10)
        for k in ROWS:
            assert getattr(state, k).tobytes() == getattr(want, k).tobytes(), k
        sub.Free()
    world.Barrier()


def test_reshard_from_fewer_ranks_to_all(world, shared_tmp):
    sub = world.mpi.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    if sub != MPI.COMM_NULL:
        save(Comm(sub), shared_tmp)
        sub.Free()
    world.Barrier()
    layout = Layout.for_model(CFG, world.size)
    state, meta = checkpoint.load(world, os.path.join(shared_tmp, files.final_name(10)), layout, EXPECT)
    assert meta["world_size"] == min(2, world.size)
    want = shard_state(layout, world.rank, 10)
    for k in ROWS:
        assert getattr(state, k).tobytes() == getattr(want, k).tobytes(), k


def test_logical_digest_is_independent_of_sharding(world, shared_tmp):
    man = save(world, shared_tmp)
    layout = Layout.for_model(CFG, world.size)
    for name, vec in zip(ROWS, logical(layout, 10)):
        assert man["logical_sha256"][name] == logical_root(vec)


def flip_byte(path, dataset, index=5):
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + index)
        b = fh.read(1)
        fh.seek(offset + index)
        fh.write(bytes([b[0] ^ 0x01]))


def reseal(world, path):
    """Rank 0 rewrites the digest file after a test changed the checkpoint: as if the damage
    happened before the file was hashed (in memory or on the way to disk), so only the digests
    inside the file can catch it."""
    if world.rank == 0:
        integrity.write_digest(path)
    world.Barrier()


@pytest.mark.parametrize("target", ["shards/rank00000", "second", "last", "meta_json"])
def test_corrupted_byte_is_rejected_on_every_rank(world, shared_tmp, target):
    man = save(world, shared_tmp)
    name = {"last": f"shards/rank{world.size - 1:05d}", "second": f"shards/rank{min(1, world.size - 1):05d}"}.get(target, target)
    if world.rank == 0:
        flip_byte(man["path"], name)
    world.Barrier()
    layout = Layout.for_model(CFG, world.size)
    with pytest.raises(CheckpointError, match="not a valid checkpoint: .*: its sha256 is .* but was written as"):
        checkpoint.load(world, man["path"], layout, EXPECT)  # the whole-file digest, before HDF5 parses it
    reseal(world, man["path"])
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(world, man["path"], layout, EXPECT)
    assert man["path"] in str(err.value) and f"/{name}" in str(err.value)
    assert "mismatch" in str(err.value)


def test_truncated_file_is_rejected(world, shared_tmp):
    man = save(world, shared_tmp)
    if world.rank == 0:
        os.truncate(man["path"], os.path.getsize(man["path"]) // 2)
    world.Barrier()
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.load(world, man["path"], Layout.for_model(CFG, world.size), EXPECT)


def test_not_a_checkpoint_and_incompatible_config_are_refused(world, shared_tmp):
    other = os.path.join(shared_tmp, "other.h5")
    if world.rank == 0:
        with h5py.File(other, "w") as f:
            f["x"] = np.arange(3)
    world.Barrier()
    layout = Layout.for_model(CFG, world.size)
    with pytest.raises(CheckpointError, match="no digest file other.h5.sha256 .* capstone.checkpoint seal"):
        checkpoint.load(world, other, layout, EXPECT)
    reseal(world, other)
    with pytest.raises(CheckpointError, match="not a capstone checkpoint"):
        checkpoint.load(world, other, layout, EXPECT)
    man = save(world, shared_tmp)
    with pytest.raises(CheckpointError, match="cfg is 1 in the checkpoint but 2 in this run"):
        checkpoint.load(world, man["path"], layout, {"model_config": {"cfg": 2}})
    with pytest.raises(CheckpointError, match="layout"):
        checkpoint.load(world, man["path"], Layout.for_model(ModelConfig(vocab_size=30, seq_len=4, d_model=8,
                                                                        n_heads=2, n_layers=1), world.size), EXPECT)


def test_retention_keeps_newest_and_pointer(world, shared_tmp):
    for step in (1, 2, 3, 4):
        man = save(world, shared_tmp, step=step, keep_last=2)
    names = sorted(os.listdir(shared_tmp))
    assert [n for n in names if n.endswith(".h5")] == [files.final_name(3), files.final_name(4)]
    assert files.read_pointer(shared_tmp) == man["path"]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 1 << 16])
def test_distributed_logical_digest_equals_serial_for_any_chunking(world, chunk):
    """Chunks smaller than a shard, spanning several shards, and larger than the whole vector."""
    from capstone.checkpoint.digest import distributed_roots
    n = 203
    shard = -(-n // world.size)
    vec = np.cos(np.arange(shard * world.size, dtype=np.float32))
    vec[n:] = 0.0
    lo = world.rank * shard
    roots = distributed_roots(world, {"x": vec[lo:lo + shard]}, lo, n, chunk)
    assert roots["x"] == logical_root(vec[:n], chunk)
    other = vec.copy()
    other[n // 2] += 1.0
    assert distributed_roots(world, {"x": other[lo:lo + shard]}, lo, n, chunk)["x"] != roots["x"]


@pytest.mark.parametrize("obj, attr, value, message", [
    ("/", "adam_t", 99, "root attribute adam_t=99 disagrees"), ("/", "step", 11, "root attribute step=11 disagrees"),
    ("/", "shard", 1, "root attribute shard=1 disagrees"), ("/", "extra", 1, "root attribute extra=1 disagrees"),
    ("shards/rank00000", "offset", 1, "attribute offset=1 of /shards/rank00000 disagrees"),
    ("shards/rank00000", "length", 1, "attribute length=1 of /shards/rank00000 disagrees"),
    ("shards/rank00000", "rank", 1, "attribute rank=1 of /shards/rank00000 disagrees")])
def test_edited_attribute_is_rejected(world, shared_tmp, obj, attr, value, message):
    """Each attribute is checked against the verified /meta_json, even in a file whose digest
    file was rewritten after the edit."""
    man = save(world, shared_tmp)
    if world.rank == 0:
        with h5py.File(man["path"], "r+") as f:
            f[obj].attrs[attr] = value
    world.Barrier()
    layout = Layout.for_model(CFG, world.size)
    with pytest.raises(CheckpointError, match="not a valid checkpoint"):
        checkpoint.load(world, man["path"], layout, EXPECT)
    reseal(world, man["path"])
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(world, man["path"], layout, EXPECT)
