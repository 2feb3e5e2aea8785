"""Asynchronous checkpoints (`--ckpt-async`, the default): the step copies what it saves into a
snapshot buffer and goes on training while a thread writes the file.

At the step boundary each rank copies its stored rows (master, m, v of its shard) into the
snapshot buffer (`Snapshot`, allocated once: `len(ROWS) x shard` float32, the memory table's
`snapshot` column) and the run state into its JSON; a thread of its own (`Writer`) then runs the
same collective save as a synchronous checkpoint (`capstone.checkpoint.write`: the file, the
digest file, the atomic publish, `latest`, retention) on a duplicate of the world communicator with
its own deadline and watchdog, so its collectives never mix with the step's. One write is in
flight at a time: the next save, a stop's save, a --keep-best save, the stop-time probe, the end
of the run and invariant (d) wait for it first (`Writer.wait`). A write that fails (disk full,
quota) fails the same way on every rank (the save's errors are agreed on the duplicate), keeps the
previous checkpoint and `latest`, and is raised in the training thread at the first step boundary
where no rank's write still runs (a flag of the step's agreement, `Flags.writing`), or at a wait
before it: the run ends with the save's message, exit 1, a step or so after the write failed. A
kill at any moment leaves the previous checkpoint published, as a synchronous save does: the file
becomes visible only by the same renames.

The snapshot is what makes the write independent of the step: the optimizer updates its shard in
place in the next step while the thread hashes and writes the copy. Without MPI_THREAD_MULTIPLE
(`Comm.for_thread` returns None) the run saves synchronously and says so once.
"""

import sys
import threading
import traceback

import numpy as np

from capstone.checkpoint.files import CheckpointError
from capstone.step.hooks import Hooks
from capstone.step.state import ROWS


class Snapshot:
    """The buffer a save copies this rank's stored rows into (one, reused by every save)."""

    def __init__(self, shard: int):
        self.rows = np.empty((len(ROWS), shard), dtype="<f4")   # untouched pages: no memory until the first save
        self.nbytes = self.rows.nbytes

    def take(self, stored) -> np.ndarray:
        """Copy `stored` (a ShardState) in; the buffer, which the caller must not change until the write ends."""
        for row, values in zip(self.rows, stored.rows()):
            np.copyto(row, values)
        return self.rows


class SaveHooks(Hooks):
    """The run's hooks (a test's faults) at the collectives of one background save, which belong to
    that save's step, whatever step the training thread has reached meanwhile."""

    def __init__(self, hooks, step: int):
        self.hooks, self.save_step = hooks, step

    def at(self, point: str, step: int | None = None) -> None:
        self.hooks.at(point, self.save_step if step is None else step)


class Writer:
    """The thread that writes checkpoints in the background, one at a time, on its own communicator."""

    def __init__(self, comm, main):
        self.comm, self.main = comm, main   # the duplicate, and the training thread's Comm (its deadline)
        self.thread: threading.Thread | None = None
        self.error: CheckpointError | None = None   # the failure of the write in flight, once it ended

    def start(self, job, hooks, step: int) -> None:
        """Run `job()` (the collective write of checkpoint `step`) in the thread, its collectives calling
        `hooks` as the step's own do. The previous write must have been waited for."""
        assert self.thread is None, "one checkpoint write in flight at a time"
        self.comm.hooks = SaveHooks(hooks, step)
        for name in ("explicit", "step", "longest_step", "record", "on_expire"):   # the training thread's deadline
            setattr(self.comm.deadline, name, getattr(self.main.deadline, name))
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(job,), name="checkpoint-writer")
        self.thread.start()

    def _run(self, job) -> None:
        try:
            job()
        except CheckpointError as exc:   # agreed: raised on every rank's thread alike
            self.error = exc
        except BaseException as exc:  # noqa: BLE001 - a bug: end the job, as launch.fail_fast does
            print(f"[rank {self.comm.rank}/{self.comm.size}] error in the checkpoint writer: "
                  f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}[rank {self.comm.rank}] aborting all ranks",
                  file=sys.stderr, flush=True)
            self.comm.abort(1)

    def running(self) -> bool:
        """The write in flight has not ended (its error, once ended, waits for `wait`)."""
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> None:
        """Wait for the write in flight, if any. Raises its CheckpointError, on every rank alike."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            if self.error is not None:
                raise self.error


def writer(world) -> Writer | None:
    """Collective. The background writer of a run on `world`, or None (with a note from rank 0)
    when MPI cannot run collectives from a second thread."""
    if (dup := world.for_thread("the checkpoint writer")) is None and world.rank == 0:
        print("note: MPI does not provide MPI_THREAD_MULTIPLE, so checkpoints are written synchronously "
              "(--no-ckpt-async); an MPI built with thread support writes them behind training.", flush=True)
    return None if dup is None else Writer(dup, world)
