"""Progress bars of pack() and Store.verify(): one tqdm bar on rank 0 for every rank's work."""

import time

from mpi4py import MPI

from hpcdl._agree import describe_ranks
from hpcdl.collectives import PoliteWait

_PROGRESS_TAG = 4242
_MAX_POLL_SLEEP_S = 0.05  # the wait for the last reports: a bar, not a step


def _bar(enabled, **kwargs):
    from tqdm import tqdm

    return tqdm(disable=not enabled, mininterval=0.5, **kwargs)


class _Progress:
    """Packing progress of every rank on one tqdm bar on rank 0 (files/s, MB/s).

    Other ranks send (files, bytes) increments at most twice a second on their
    own communicator; rank 0 collects them whenever it reports its own work.
    """

    def __init__(self, comm, total_files, total_bytes, enabled):
        self.comm, self.rank = comm, comm.Get_rank()
        self.files = self.bytes = 0
        self.unsent = [0, 0]
        self.last_send = time.monotonic()
        self.requests = []
        self.start = time.monotonic()
        self.total_files = total_files
        self.finished = {0}  # the ranks that sent their last report (rank 0 reports to itself)
        self.bar = (
            _bar(
                enabled and self.rank == 0, total=total_bytes, unit="B", unit_scale=True, desc="[hpcdl rank 0] packing"
            )
            if self.rank == 0
            else None
        )

    def advance(self, files, nbytes):
        if self.rank == 0:
            self._show(files, nbytes)
            self._collect(block=False)
            return
        self.unsent[0] += files
        self.unsent[1] += nbytes
        if time.monotonic() - self.last_send > 0.5:
            self._send(done=False)

    def _send(self, done):
        self.requests.append(self.comm.isend((self.unsent[0], self.unsent[1], done), 0, _PROGRESS_TAG))
        self.unsent = [0, 0]
        self.last_send = time.monotonic()

    def _show(self, files, nbytes):
        self.files += files
        self.bytes += nbytes
        self.bar.update(nbytes)
        rate = self.files / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.files}/{self.total_files} files, {rate:.0f} files/s", refresh=False)

    def _collect(self, block):
        """Show the reports that arrived; with block, wait until every rank said done,
        under hpcdl.configure()'s stall limits counted from the last report of any rank:
        a rank that stops writing (stopped, dead, a file system that does not answer)
        is named once the others are done, where a blocking receive waited for ever."""
        nranks = self.comm.Get_size()
        wait = PoliteWait(_MAX_POLL_SLEEP_S)
        while True:
            status = MPI.Status()
            if self.comm.iprobe(MPI.ANY_SOURCE, _PROGRESS_TAG, status):
                files, nbytes, done = self.comm.recv(source=status.Get_source(), tag=_PROGRESS_TAG)
                self._show(files, nbytes)
                if done:
                    self.finished.add(status.Get_source())
                wait = PoliteWait(_MAX_POLL_SLEEP_S)
            elif not block or len(self.finished) == nranks:
                return
            else:
                wait.check(self._describe_stall)
                wait.sleep()

    def _describe_stall(self, waited):
        silent = sorted(set(range(self.comm.Get_size())) - self.finished)
        return (
            f"pack has had no progress report for {waited:.1f} s: {describe_ranks(silent)} still writing "
            "(stopped, dead, or on a file system that does not answer)"
        )

    def finish(self):
        """Collective: rank 0 waits for every rank's last report."""
        if self.rank == 0:
            self._collect(block=True)
            self.bar.close()
        else:
            self._send(done=True)
            MPI.Request.Waitall(self.requests)
