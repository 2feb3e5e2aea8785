"""capstone: MiniGPT training on MPI (data, tensor and pipeline parallelism, ZeRO stages 1-3) with sharded
parallel-HDF5 checkpoints."""

__version__ = "0.1.0"
