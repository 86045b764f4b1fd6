"""A short real soak (``kvmem bench soak``'s own run): one live server, its engine killed, its NVMe disk filled
for a while (where a tmpfs can be mounted) and clients that hang up mid-stream; no conversation is lost and the
server's RSS and disk stay within their budgets."""

from __future__ import annotations

import pytest
from model_support import SMALL_MODEL

from kvmem_bench import soak

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow, pytest.mark.timeout(600)]  # about 3 minutes on 2 busy vCPUs


def test_a_short_soak_with_every_fault_loses_no_conversation_and_stays_in_budget():
    plan = soak.SoakPlan(
        clients=2, turns=4, cpu_gb=0.5, nvme_gb=1.0, disk_full_s=5, disconnect_every=2, turn_timeout_s=120
    )
    result = soak.run(SMALL_MODEL, plan, log=lambda line: None)
    assert result["goals"] == {"no_lost_conversation": True, "rss_within_budget": True, "disk_within_budget": True}
    assert result["served"] == 8 and result["disconnects"] == 4 and not result["errors"]
    assert result["engine_kills"] == 1 and result["engine_restarts"] == 1
    if result["disk_fault"] == "injected":
        assert result["disk_full"]["full"] and result["disk_full"]["held_s"] >= 5
    else:
        assert result["disk_fault"].startswith("not injected: ")
