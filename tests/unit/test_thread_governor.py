"""The default thread count follows the cores other processes leave free: every core on a quiet machine, fewer
while others compute, back up when they stop; explicit counts are never governed."""

from __future__ import annotations

import time

import pytest

from kvmem_core.thread_governor import ThreadGovernor, cpu_busy_ticks, process_ticks, read_ticks
from kvmem_core.threads import Threads, resolve_threads

STAT = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 100 1 50 2000 5 2 3 4 0 0
cpu1 200 0 60 1000 5 0 0 0 0 0
cpu2 400 0 70 500 0 0 0 0 0 0
intr 12345
"""


class Machine:
    """Fake tick counters advanced by hand: ``run(seconds, own_cores, other_cores)``, at 100 ticks a second."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0, 0

    def run(self, seconds: float, own: float, others: float) -> None:
        self.now += seconds
        self.own += round(own * seconds * 100)
        self.busy += round((own + others) * seconds * 100)

    def governor(self, cores: int) -> ThreadGovernor:
        return ThreadGovernor(cores, ticks=lambda: (self.busy, self.own), clock=lambda: self.now, hz=100)


def test_quiet_machine_keeps_every_core_and_one_busy_core_gives_one_up() -> None:
    machine = Machine()
    governor = machine.governor(2)
    machine.run(0.5, own=2, others=0)
    assert governor.poll() == 2
    machine.run(0.5, own=1.2, others=0.8)  # another process took most of a core from our two spinning threads
    assert governor.poll() == 1
    machine.run(0.5, own=1, others=1)
    assert governor.poll() == 1
    machine.run(0.5, own=1, others=0)  # it stopped
    assert governor.poll() == 2
    machine.run(0.5, own=1.7, others=0.3)  # on and off: a third of a core already costs a thread
    assert governor.poll() == 1
    machine.run(0.5, own=2, others=0.1)  # background noise does not
    assert governor.poll() == 2


def test_at_least_one_thread_and_no_change_between_looks() -> None:
    machine = Machine()
    governor = machine.governor(4)
    machine.run(1.0, own=0.5, others=4)
    assert governor.poll() == 1
    machine.run(0.1, own=4, others=0)  # sooner than the interval: the last answer stands
    assert governor.poll() == 1
    machine.run(1.0, own=4, others=1)
    assert governor.poll() == 3


def test_unreadable_counters_keep_every_core() -> None:
    clock = iter([0.0, 1.0, 2.0])
    governor = ThreadGovernor(8, ticks=lambda: None, clock=lambda: next(clock), hz=100)
    assert governor.poll() == 8 and governor.poll() == 8


def test_proc_parsers_count_the_allowed_cpus_and_a_process_with_spaces_in_its_name() -> None:
    assert cpu_busy_ticks({0, 2}, STAT) == (100 + 1 + 50 + 2 + 3 + 4) + (400 + 70)
    assert process_ticks("42 (a (weird) name) S 1 42 42 0 -1 4194560 100 0 0 0 37 11 0 0 20 0 3 0 99") == 48


def test_real_counters_see_this_process_compute() -> None:
    before = read_ticks()
    if before is None:
        pytest.skip("no /proc here (not Linux)")
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    after = read_ticks()
    assert after is not None and after[1] - before[1] >= 20 and after[0] - before[0] >= after[1] - before[1] - 5


@pytest.mark.parametrize(
    "threads, batch, env, auto",
    [(None, None, {}, True), (2, None, {}, False), (None, 3, {}, False), (None, None, {"KVMEM_THREADS": "1"}, False)],
)
def test_only_unset_counts_are_governed(
    threads: int | None, batch: int | None, env: dict[str, str], auto: bool
) -> None:
    assert resolve_threads(threads, batch, env=env).auto is auto
    assert Threads(2, 2) == Threads(2, 2, auto=False)
