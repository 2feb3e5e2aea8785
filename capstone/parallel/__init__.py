"""Parallelism: the process grid, the deadline-aware communicators and what runs over them
(gradient reduction, the sharded optimizer, tensor parallelism, deterministic reduction)."""
