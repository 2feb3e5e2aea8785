"""No pickle anywhere data is loaded: the package's source uses no pickle, np.load with
allow_pickle, or lowercase (pickling) mpi4py collectives."""

import os
import re

from conftest import ROOT

NO_PICKLE = [
    (r"^\s*(import|from)\s+(c?pickle|_pickle|dill|cloudpickle|joblib)\b", "imports pickle"),
    (r"allow_pickle\s*=\s*True", "np.load(allow_pickle=True)"),
    (r"\bnp\.load\(|\bnumpy\.load\(", "np.load (reads pickles when told to; use h5py or np.fromfile/memmap)"),
    (r"dtype\s*=\s*(object|\"O\"|'O')|special_dtype|vlen_dtype|h5py\.string_dtype|\bdtype=\"?object", "an object/vlen dtype"),
    (r"\b\w*([Cc]omm|COMM|[Mm]pi|MPI)\w*\.(bcast|gather|allgather|scatter|alltoall|reduce|allreduce|scan|exscan|send|recv|isend|irecv|"
     r"sendrecv|ibcast|igather|iallgather|iallreduce|ireduce)\(", "a lowercase mpi4py collective (pickles its argument)"),
]


def test_no_pickle_in_capstone():
    """README: 'No pickle: HDF5 datasets and JSON only'. No module imports pickle, loads .npy/.npz
    (np.load can unpickle), uses object/vlen dtypes, or calls a pickling (lowercase) mpi4py method.
    The runtime counterpart, with pickle made to raise, is\n    tests/mpi/test_training.py::test_training_checkpoints_resume_and_data_without_pickle."""
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "capstone")):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    code = line.split("#", 1)[0]
                    found += [f"{os.path.relpath(path, ROOT)}:{number}: {why}: {line.strip()}"
                              for pattern, why in NO_PICKLE if re.search(pattern, code)]
    assert not found, "\n".join(found)
