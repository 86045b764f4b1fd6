"""A default thread count that follows the cores other processes leave free.

llama.cpp's threads meet at a barrier after every operation of a step, so one thread that
waits for a core holds up the rest: on a 2-core machine with one core busy elsewhere, 2
threads decode several times slower than 1, while on a quiet machine 2 are the faster
(``kvmem bench speed``'s ``busy`` rows). So when no count is given, the engine asks the
governor before each forward; at most every ``interval_s`` it reads how busy the cores this
process may use were since its last look, less this process's own CPU time, and gives up a
thread for every core other processes used beyond ``SLACK`` (at least 1 thread stays). It leans
to fewer threads: one thread too few costs a step at most its share of the cores, one too many
can cost it several times over.

It reads ``/proc/stat`` and ``/proc/self/stat`` (Linux); elsewhere it keeps every core.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal of a /proc/stat cpu line
SLACK = 0.2  # cores of background work (daemons, a server's event loop) that do not take a thread away


def cpu_busy_ticks(cpus: set[int], stat: str) -> int:
    """Clock ticks the CPUs ``cpus`` spent busy (idle and iowait excluded), from ``/proc/stat``'s text."""
    total = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in rest.split()]
            total += sum(values[i] for i in BUSY_FIELDS if i < len(values))
    return total


def process_ticks(stat: str) -> int:
    """User plus system clock ticks of a process, every thread included, from its ``/proc/PID/stat`` text."""
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces; the fields after it do not
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the file)


def read_ticks() -> tuple[int, int] | None:
    """(busy ticks of the CPUs this process may use, this process's own ticks); None where /proc is missing."""
    try:
        cpus = os.sched_getaffinity(0)
        with open("/proc/stat") as f:
            machine = f.read()
        with open("/proc/self/stat") as f:
            own = f.read()
    except (OSError, AttributeError):
        return None
    return cpu_busy_ticks(cpus, machine), process_ticks(own)


class ThreadGovernor:
    """The thread count to compute with now, out of ``cores``: the cores other processes left free lately."""

    def __init__(
        self,
        cores: int,
        *,
        interval_s: float = 0.25,
        ticks: Callable[[], tuple[int, int] | None] = read_ticks,
        clock: Callable[[], float] = time.monotonic,
        hz: int | None = None,
    ) -> None:
        self.cores, self.interval_s, self._ticks, self._clock = cores, interval_s, ticks, clock
        self._hz = hz or os.sysconf("SC_CLK_TCK")
        self._last = (clock(), ticks())
        self.current = cores

    def poll(self) -> int:
        """The count for the next forward: unchanged until ``interval_s`` has passed since the last look, then
        ``floor(cores - cores busy elsewhere + SLACK)`` clamped to 1..cores (unchanged when the ticks cannot be
        read)."""
        now = self._clock()
        then, before = self._last
        if now - then < self.interval_s:
            return self.current
        after = self._ticks()
        self._last = (now, after)
        if before is None or after is None:
            return self.current
        elsewhere = ((after[0] - before[0]) - (after[1] - before[1])) / self._hz / (now - then)
        self.current = max(1, min(self.cores, math.floor(self.cores - max(0.0, elsewhere) + SLACK)))
        return self.current
