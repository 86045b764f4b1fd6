"""The server side of the engine's queue: a request the wire cannot carry is refused before it takes the slot."""
from __future__ import annotations

import asyncio

from kvmem import protocol as P
from kvmem.server.engine_client import EngineClient
from kvmem.server.errors import APIError

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import StepRequest

CONFIG = KVMemConfig(ctx=4096)
MESSAGE = {"role": "user", "content": "hi"}


def ready_engine(max_queue: int = 16) -> EngineClient:
    """A client whose engine counts as ready; nothing is spawned (frames it sends go nowhere)."""
    engine = EngineClient(P.EngineSpec(backend="llama.cpp", model=None, config=P.config_to_wire(CONFIG)), max_queue=max_queue)
    engine.state = "ready"
    engine._ready.set()
    return engine


def test_a_number_the_wire_cannot_carry_is_a_400_and_never_holds_the_step_slot() -> None:
    async def go() -> APIError:
        engine = ready_engine()
        request = StepRequest(messages=(MESSAGE,), template_kwargs={"n": -(2 ** 63) - 1})
        try:
            async for _ in engine.generate(request):
                pass
        except APIError as exc:
            assert not engine._slot.locked() and engine.busy == 0
            return exc
        finally:
            await engine.close()
        raise AssertionError("the step was not refused")

    err = asyncio.run(go())
    assert (err.status, err.code) == (400, "invalid_value")
