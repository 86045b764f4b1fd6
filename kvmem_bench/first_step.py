"""A fresh process's start on a GPU: the adapter's warm-up (``TorchAdapter.warm_up``), then its first engine steps.

On a machine whose Triton cache is empty the warm-up is where flash-linear-attention's kernels and the engine's own
compile; the first steps after it should cost what later ones do. Random qwen35 weights of a shape, the speed
bench's session and default view; prints the seconds of each part (run it twice to see the cached start):

    python -m kvmem_bench.first_step --shape 9b --model <default GGUF>
"""

from __future__ import annotations

import argparse
import time

from kvmem_bench.speed_ab import Session
from kvmem_bench.speed_torch import DEFAULT_VIEW, session_engine


def run(shape: str, model: str | None, steps: int, device: str = "cuda", log=print) -> dict[str, float]:
    """Seconds of loading, of the warm-up and of each of ``steps`` first steps, in order."""
    t0 = time.perf_counter()
    engine = session_engine(shape, model, dict(DEFAULT_VIEW, sizes=(steps * 3000,), lines=100), device)
    try:
        out = {"load_s": time.perf_counter() - t0, "warm_up_s": engine.adapter.warm_up()}
        log(f"loaded in {out['load_s']:.1f} s, warmed up in {out['warm_up_s']:.1f} s")
        session = Session(engine)
        for i in range(steps):
            t = time.perf_counter()
            tokens, _ = session.step()
            out[f"step{i}_s"] = time.perf_counter() - t
            log(f"step {i}: {tokens} tokens, {out[f'step{i}_s']:.2f} s")
    finally:
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--model", default=None, help="the GGUF whose tokenizer and template the weights get")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    run(args.shape, args.model, args.steps)


if __name__ == "__main__":
    main()
