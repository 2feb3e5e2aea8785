"""The shard/chunk split behind the logical digest: pieces tile the shard, one chunk each."""

import itertools

from capstone.checkpoint.digest import split_shard


def test_split_shard_tiles_every_shard_with_single_chunk_pieces():
    for n, chunk, world in itertools.product((1, 5, 64, 203), (1, 3, 7, 64, 500), (1, 2, 3, 4, 7)):
        shard = -(-n // world)
        covered = []
        for rank in range(world):
            lo, hi = rank * shard, (rank + 1) * shard
            complete, fragments = split_shard(lo, hi, n, chunk)
            pieces = [(c * chunk, min((c + 1) * chunk, n)) for c in complete] + fragments
            for a, b in pieces:
                assert a < b and a // chunk == (b - 1) // chunk, (n, chunk, world, rank, a, b)
            covered += pieces
        flat = sorted(covered)
        assert flat[0][0] == 0 and flat[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(flat, flat[1:])), (n, chunk, world)
