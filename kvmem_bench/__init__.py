"""KVMem's benchmarks (``kvmem bench ...``): speed against the plain engine; more in later suites."""

from __future__ import annotations
