"""A turn's 387 new tokens through the llama.cpp adapter: prefilled over an empty view (what the speed bench's suffix
floor times) and over a 2,176-token view (what a turn attends to), alternated, five times each.

python docs/results/turn-first-pass-cpu-2026-12-06/first_pass.py MODEL.gguf [--no-flash-attn]
"""

import sys
import time

from kvmem_core.config import KVMemConfig
from kvmem_llamacpp import create_adapter

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEW, VIEW = 387, 2176


def main() -> None:
    flash_attn = "--no-flash-attn" not in sys.argv
    adapter = create_adapter(sys.argv[1], KVMemConfig(ctx=8192, budget=4096), flash_attn=flash_attn)
    ids = adapter.tokenize(FILLER * 200)
    for view in (0, VIEW) * 5:
        adapter.clear_view()
        for start in range(0, view, 512):
            chunk = ids[start : min(start + 512, view)]
            adapter.forward(chunk, list(range(start, start + len(chunk))), want_logits=False)
        t = time.perf_counter()
        adapter.forward(ids[:NEW], list(range(view, view + NEW))).logits
        print(f"{NEW} new tokens over a {view}-token view: {time.perf_counter() - t:.3f} s", flush=True)
    adapter.close()


if __name__ == "__main__":
    main()
