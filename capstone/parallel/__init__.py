"""Parallelism over the process grid: gradient reduction (buckets, deterministic, ZeRO-2), the
sharded optimizer (ZeRO-1/3), tensor and pipeline parallelism. Collectives go through
capstone.collective."""
