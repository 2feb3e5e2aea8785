"""A thread that drives this rank's prefetched collectives while NumPy computes.

Open MPI advances a non-blocking collective only inside MPI calls, and a layer's forward or
backward makes none: a gather started before a block computes would otherwise still be waiting
when the block is done. This thread tests the requests it is given (MPI_THREAD_MULTIPLE; NumPy
releases the GIL in its loops and BLAS) and marks each done, with the time it completed; only this
thread touches a request once it is submitted. The main thread waits on the mark, under the run's
deadline (`Ticket.wait`), and learns how much of the collective it had to wait for (exposed) and how
much ran behind its compute (hidden).
"""

import threading
import time

from capstone.collective.deadline import expire

POLL_S = 5e-5   # between two rounds of tests while something is pending


class Ticket:
    """One submitted request: done when it completes, `started` and `completed` (perf_counter)."""

    def __init__(self, request, buffers):
        self.request, self.buffers = request, buffers    # buffers stay alive until completion
        self.started, self.completed, self.done = time.perf_counter(), None, threading.Event()

    def wait(self, comm, what: str, kind: str, op: str, nbytes: int) -> None:
        """Wait for completion (ending the job at `comm`'s deadline); counted on `comm` under `kind`, with
        the seconds waited (exposed) and the rest of the collective's time (hidden behind compute)."""
        t0 = time.perf_counter()
        while not self.done.wait(0.01):
            if time.perf_counter() - t0 >= comm.deadline.seconds:
                expire(comm.deadline, what, time.perf_counter() - t0)
        waited = time.perf_counter() - t0
        comm.count(kind, op, nbytes, waited, 1, max(0.0, self.completed - self.started - waited))


class Progress:
    def __init__(self):
        self.cv = threading.Condition()
        self.pending: list[Ticket] = []
        threading.Thread(target=self._run, name="collective-progress", daemon=True).start()

    def submit(self, request, *buffers) -> Ticket:
        ticket = Ticket(request, buffers)
        with self.cv:
            self.pending.append(ticket)
            self.cv.notify()
        return ticket

    def _run(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.pending)
                tickets = list(self.pending)
            finished, now = [t for t in tickets if t.request.Test()], time.perf_counter()
            with self.cv:
                for t in finished:
                    self.pending.remove(t)
                    t.completed = now
                    t.done.set()
            if not finished:
                time.sleep(POLL_S)
