"""capstone: data-parallel MiniGPT training on MPI with ZeRO-1 and sharded parallel-HDF5 checkpoints."""

__version__ = "0.1.0"
