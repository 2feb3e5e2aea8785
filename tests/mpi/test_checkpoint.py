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
from capstone.parallel.dist import Dist
from capstone.model.params import Layout
from capstone.parallel.zero import ROWS, ShardState

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


def save(d: Dist, directory, step=10, keep_last=0):
    layout = Layout.for_model(CFG, d.world)
    return checkpoint.save(d, directory, step, shard_state(layout, d.rank, step), layout,
                           {"model_config": {"cfg": 1}, "run": {"data_cursor": 123}}, keep_last)


def test_round_trip_and_sha256_matches_plain_h5py(dist, shared_tmp):
    man = save(dist, shared_tmp)
    assert man["path"].endswith("ckpt-00000010.h5")
    layout = Layout.for_model(CFG, dist.world)
    state, meta = checkpoint.load(dist, man["path"], layout, EXPECT)
    want = shard_state(layout, dist.rank, 10)
    for k in ROWS:
        assert getattr(state, k).tobytes() == getattr(want, k).tobytes()
    assert state.t == 20 and meta["run"]["data_cursor"] == 123 and meta["world_size"] == dist.world
    if dist.rank == 0:  # serial plain h5py, no MPI driver
        with h5py.File(man["path"], "r") as f:
            assert sorted(f["shards"]) == [f"rank{r:05d}" for r in range(dist.world)]
            for r in range(dist.world):
                ds = f[f"shards/rank{r:05d}"]
                assert ds.attrs["sha256"] == hashlib.sha256(ds[...].tobytes()).hexdigest()
        assert files.read_pointer(shared_tmp) == man["path"]
        with open(man["path"] + ".sha256") as f:  # sha256sum -c format, size in a comment line
            assert f.read() == (f"# capstone checkpoint digest v1: {os.path.getsize(man['path'])} bytes\n"
                                f"{integrity.file_sha256(man['path'])}  ckpt-00000010.h5\n")
    dist.barrier()


def test_verify_snapshot_counts_differing_bytes(dist, shared_tmp):
    man = save(dist, shared_tmp)
    layout = Layout.for_model(CFG, dist.world)
    st = shard_state(layout, dist.rank, 10)
    snap = np.stack(st.rows())
    assert checkpoint.verify_snapshot(dist, man["path"], layout, EXPECT, snap)["ok"]
    if dist.rank == dist.world - 1:
        snap[2, 0] += 1.0
    res = checkpoint.verify_snapshot(dist, man["path"], layout, EXPECT, snap)
    assert not res["ok"] and 1 <= res["mismatched_bytes"] <= 4


@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_reshard_from_all_ranks_to_fewer(dist, shared_tmp, new_world):
    man = save(dist, shared_tmp)
    color = 0 if dist.rank < new_world else MPI.UNDEFINED
    sub = dist.comm.Split(color, dist.rank)
    if sub != MPI.COMM_NULL:
        d = Dist(sub)
        layout = Layout.for_model(CFG, d.world)
        state, meta = checkpoint.load(d, man["path"], layout, EXPECT)
        want = shard_state(layout, d.rank, 10)
        for k in ROWS:
            assert getattr(state, k).tobytes() == getattr(want, k).tobytes(), k
        sub.Free()
    dist.barrier()


def test_reshard_from_fewer_ranks_to_all(dist, shared_tmp):
    sub = dist.comm.Split(0 if dist.rank < 2 else MPI.UNDEFINED, dist.rank)
    if sub != MPI.COMM_NULL:
        save(Dist(sub), shared_tmp)
        sub.Free()
    dist.barrier()
    layout = Layout.for_model(CFG, dist.world)
    state, meta = checkpoint.load(dist, os.path.join(shared_tmp, files.final_name(10)), layout, EXPECT)
    assert meta["world_size"] == min(2, dist.world)
    want = shard_state(layout, dist.rank, 10)
    for k in ROWS:
        assert getattr(state, k).tobytes() == getattr(want, k).tobytes(), k


def test_logical_digest_is_independent_of_sharding(dist, shared_tmp):
    man = save(dist, shared_tmp)
    layout = Layout.for_model(CFG, dist.world)
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


def reseal(dist, path):
    """Rank 0 rewrites the digest file after a test changed the checkpoint: as if the damage
    happened before the file was hashed (in memory or on the way to disk), so only the digests
    inside the file can catch it."""
    if dist.rank == 0:
        integrity.write_digest(path)
    dist.barrier()


@pytest.mark.parametrize("target", ["shards/rank00000", "second", "last", "meta_json"])
def test_corrupted_byte_is_rejected_on_every_rank(dist, shared_tmp, target):
    man = save(dist, shared_tmp)
    name = {"last": f"shards/rank{dist.world - 1:05d}", "second": f"shards/rank{min(1, dist.world - 1):05d}"}.get(target, target)
    if dist.rank == 0:
        flip_byte(man["path"], name)
    dist.barrier()
    layout = Layout.for_model(CFG, dist.world)
    with pytest.raises(CheckpointError, match="not a valid checkpoint: .*: its sha256 is .* but was written as"):
        checkpoint.load(dist, man["path"], layout, EXPECT)  # the whole-file digest, before HDF5 parses it
    reseal(dist, man["path"])
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(dist, man["path"], layout, EXPECT)
    assert man["path"] in str(err.value) and f"/{name}" in str(err.value)
    assert "mismatch" in str(err.value)


def test_truncated_file_is_rejected(dist, shared_tmp):
    man = save(dist, shared_tmp)
    if dist.rank == 0:
        os.truncate(man["path"], os.path.getsize(man["path"]) // 2)
    dist.barrier()
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.load(dist, man["path"], Layout.for_model(CFG, dist.world), EXPECT)


def test_not_a_checkpoint_and_incompatible_config_are_refused(dist, shared_tmp):
    other = os.path.join(shared_tmp, "other.h5")
    if dist.rank == 0:
        with h5py.File(other, "w") as f:
            f["x"] = np.arange(3)
    dist.barrier()
    layout = Layout.for_model(CFG, dist.world)
    with pytest.raises(CheckpointError, match="no digest file other.h5.sha256 .* capstone.checkpoint seal"):
        checkpoint.load(dist, other, layout, EXPECT)
    reseal(dist, other)
    with pytest.raises(CheckpointError, match="not a capstone checkpoint"):
        checkpoint.load(dist, other, layout, EXPECT)
    man = save(dist, shared_tmp)
    with pytest.raises(CheckpointError, match="cfg is 1 in the checkpoint but 2 in this run"):
        checkpoint.load(dist, man["path"], layout, {"model_config": {"cfg": 2}})
    with pytest.raises(CheckpointError, match="layout"):
        checkpoint.load(dist, man["path"], Layout.for_model(ModelConfig(vocab_size=30, seq_len=4, d_model=8,
                                                                        n_heads=2, n_layers=1), dist.world), EXPECT)


def test_retention_keeps_newest_and_pointer(dist, shared_tmp):
    for step in (1, 2, 3, 4):
        man = save(dist, shared_tmp, step=step, keep_last=2)
    names = sorted(os.listdir(shared_tmp))
    assert [n for n in names if n.endswith(".h5")] == [files.final_name(3), files.final_name(4)]
    assert files.read_pointer(shared_tmp) == man["path"]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 1 << 16])
def test_distributed_logical_digest_equals_serial_for_any_chunking(dist, chunk):
    """Chunks smaller than a shard, spanning several shards, and larger than the whole vector."""
    from capstone.checkpoint.digest import distributed_roots
    n = 203
    shard = -(-n // dist.world)
    vec = np.cos(np.arange(shard * dist.world, dtype=np.float32))
    vec[n:] = 0.0
    lo = dist.rank * shard
    roots = distributed_roots(dist, {"x": vec[lo:lo + shard]}, lo, n, chunk)
    assert roots["x"] == logical_root(vec[:n], chunk)
    other = vec.copy()
    other[n // 2] += 1.0
    assert distributed_roots(dist, {"x": other[lo:lo + shard]}, lo, n, chunk)["x"] != roots["x"]


@pytest.mark.parametrize("obj, attr, value, message", [
    ("/", "adam_t", 99, "root attribute adam_t=99 disagrees"), ("/", "step", 11, "root attribute step=11 disagrees"),
    ("/", "shard", 1, "root attribute shard=1 disagrees"), ("/", "extra", 1, "root attribute extra=1 disagrees"),
    ("shards/rank00000", "offset", 1, "attribute offset=1 of /shards/rank00000 disagrees"),
    ("shards/rank00000", "length", 1, "attribute length=1 of /shards/rank00000 disagrees"),
    ("shards/rank00000", "rank", 1, "attribute rank=1 of /shards/rank00000 disagrees")])
def test_edited_attribute_is_rejected(dist, shared_tmp, obj, attr, value, message):
    """Each attribute is checked against the verified /meta_json, even in a file whose digest
    file was rewritten after the edit."""
    man = save(dist, shared_tmp)
    if dist.rank == 0:
        with h5py.File(man["path"], "r+") as f:
            f[obj].attrs[attr] = value
    dist.barrier()
    layout = Layout.for_model(CFG, dist.world)
    with pytest.raises(CheckpointError, match="not a valid checkpoint"):
        checkpoint.load(dist, man["path"], layout, EXPECT)
    reseal(dist, man["path"])
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(dist, man["path"], layout, EXPECT)
