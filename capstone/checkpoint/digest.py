"""Content digests of checkpoints.

- `sha256_hex(array)`: the digest stored on each dataset: sha256 of its raw bytes as stored.
- The *logical* digest of a flat vector of n values (the unsharded master, m or v): sha256 over
  fixed chunks of CHUNK values, root = sha256 of the concatenated chunk digests. It does not
  depend on how the vector is sharded, so a checkpoint written by N ranks and loaded on M ranks
  proves, by recomputing it, that the restored state is exactly the saved one.
"""

import hashlib

import numpy as np

CHUNK = 1 << 16  # values per logical chunk (256 KiB of float32)


def sha256_hex(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array)).hexdigest()   # the buffer itself: no copy of it


def logical_root(vector: np.ndarray, chunk: int = CHUNK) -> str:
    """Logical digest of a whole vector (serial reference; e.g. for `verify`)."""
    digests = [hashlib.sha256(np.ascontiguousarray(vector[i:i + chunk])).digest() for i in range(0, len(vector), chunk)]
    return hashlib.sha256(b"".join(digests)).hexdigest()


def split_shard(lo: int, hi: int, n: int, chunk: int = CHUNK):
    """For a shard [lo, hi) of a logical vector of n values: the chunks wholly inside it, and the
    (start, stop) fragments of the chunks it only partly holds (those must be joined across ranks)."""
    hi = min(hi, n)
    cuts = [lo] + list(range((lo // chunk + 1) * chunk, hi, chunk)) + [hi]
    pieces = list(zip(cuts, cuts[1:])) if hi > lo else []
    whole = [(a, b) for a, b in pieces if a % chunk == 0 and b == min(a + chunk, n)]
    return [a // chunk for a, _ in whole], [p for p in pieces if p not in whole]


def distributed_roots(comm, shards: dict, lo: int, n: int, chunk: int = CHUNK) -> dict:
    """Collective: call on all ranks. Logical digests of vectors sharded as [lo, lo+len) per rank.

    `shards` maps a name (e.g. "master") to this rank's 1-D shard; values at positions >= n are
    padding and ignored. Complete chunks are hashed where they live; the pieces of chunks split
    between ranks (at most two per rank once shards exceed a chunk) go to rank 0 with the chunk
    digests, which computes the roots and broadcasts them. Returns {name: root hex} on every rank."""
    complete, fragments = split_shard(lo, lo + len(next(iter(shards.values()))), n, chunk)
    local = {"chunks": {}, "fragments": [[a, b] for a, b in fragments], "data": {}}
    for name, shard in shards.items():
        local["chunks"][name] = [[c, sha256_hex(shard[c * chunk - lo:min((c + 1) * chunk, n) - lo])] for c in complete]
        local["data"][name] = [shard[a - lo:b - lo].tobytes().hex() for a, b in fragments]
    gathered = comm.gather_json(local)
    return comm.bcast_json({name: _root(gathered, name, n, chunk) for name in shards} if comm.rank == 0 else None)


def _root(gathered: list, name: str, n: int, chunk: int) -> str:
    """Rank 0's half of `distributed_roots`: join the pieces of vector `name`, hash, and make its root."""
    digests, parts = {}, {}
    for item in gathered:
        digests.update({c: bytes.fromhex(h) for c, h in item["chunks"][name]})
        for (a, b), hexdata in zip(item["fragments"], item["data"][name]):
            parts.setdefault(a // chunk, []).append((a, bytes.fromhex(hexdata)))
    for c, pieces in parts.items():
        digests[c] = hashlib.sha256(b"".join(data for _, data in sorted(pieces))).digest()
    n_chunks = -(-n // chunk)
    if sorted(digests) != list(range(n_chunks)):
        raise RuntimeError(f"logical digest of {name}: chunks {sorted(set(range(n_chunks)) - set(digests))} missing")
    return hashlib.sha256(b"".join(digests[c] for c in range(n_chunks))).hexdigest()
