"""Resident set size of the servers ``loadtest compare`` started, sampled in the background.

Read from ``/proc/PID/status`` (``VmRSS``) of the server process and its
children, so it is Linux-only; elsewhere every reading is None. The sampler
keeps the largest value seen since the last ``mark``, so a cell's peak is
what the server held at most while that cell ran.
"""

from __future__ import annotations

import threading
from pathlib import Path


def rss_bytes(pid: int) -> int | None:
    """VmRSS of ``pid`` plus its direct children, in bytes (None: not readable)."""
    total = 0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    found = False
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    found = True
                    break
        except (OSError, ValueError):
            continue
    return total if found else None


class RssSampler:
    """Samples ``pids`` (side -> pid) every ``interval_s`` on a daemon thread."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self._peak: dict[str, int | None] = dict.fromkeys(pids)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def now(self) -> dict[str, int | None]:
        return {side: rss_bytes(pid) for side, pid in self.pids.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            reading = self.now()
            with self._lock:
                for side, v in reading.items():
                    old = self._peak.get(side)
                    if v is not None and (old is None or v > old):
                        self._peak[side] = v

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def mark(self) -> dict[str, int | None]:
        """The peak of each side since the previous mark (or the start), then reset."""
        reading = self.now()
        with self._lock:
            peak = {
                s: max(
                    (x for x in (self._peak.get(s), reading.get(s)) if x is not None), default=None
                )
                for s in self.pids
            }
            self._peak = dict.fromkeys(self.pids)
        return peak

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
