"""The torch engine against HF transformers on tiny random models (fp32): logits and states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvmem_torch.hf_loader import load_hf_dir  # noqa: E402
from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.paged import View  # noqa: E402
from torch_tiny import tiny_hf_model, tiny_spec_weights  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen35")
TOL = 1e-4
B = 16


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest) -> tuple[object, Model]:
    torch.set_num_threads(1)
    hf = tiny_hf_model(request.param, seed=3)
    spec, weights = tiny_spec_weights(hf)
    return hf, Model(spec, weights)


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf: object, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
    with torch.no_grad():
        pos = torch.arange(offset, offset + len(ids))[None]
        return hf(ids[None], position_ids=pos).logits[0]


def hf_incremental(hf: object, chunks: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    from transformers import DynamicCache

    cache, out, seen = DynamicCache(config=hf.config), [], 0
    with torch.no_grad():
        for ids in chunks:
            pos = torch.arange(seen, seen + len(ids))[None]
            out.append(hf(ids[None], position_ids=pos, cache=cache, use_cache=True).logits[0])
            seen += len(ids)
    return out, cache


def scrambled_cache(model: Model, num_blocks: int = 24):
    """A cache whose free list is shuffled, so views use non-contiguous, out-of-order blocks."""
    cache = model.new_cache(num_blocks, B)
    cache.free = [int(i) for i in torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))]
    return cache


def test_one_shot_matches_hf(pair) -> None:
    hf, model = pair
    ids = tokens(150)
    cache, view, state = scrambled_cache(model), View(), model.new_state()
    ours = model.run(ids, torch.arange(150), cache, view, state, last_only=False)
    assert view.length == 150 and len(view.table) == 10
    assert (ours - hf_logits(hf, ids)).abs().max().item() <= TOL


def test_hf_directory_loads_to_the_same_model(pair, tmp_path: Path) -> None:
    """``save_pretrained`` safetensors (tied embeddings left out of the file for qwen2) load back exactly."""
    hf, _ = pair
    hf.save_pretrained(tmp_path)
    spec, weights = load_hf_dir(tmp_path, torch.float32, progress=False)
    assert spec.arch == {"llama": "llama", "qwen2": "qwen2", "qwen3_5_text": "qwen35"}[hf.config.model_type]
    assert ("lm_head" in weights) != spec.tie_embeddings
    ids, model = tokens(60, seed=10), Model(spec, weights)
    ours = model.run(ids, torch.arange(60), scrambled_cache(model), View(), model.new_state(), last_only=False)
    assert (ours - hf_logits(hf, ids)).abs().max().item() <= TOL


def test_chunked_prefill_and_decode_match_hf(pair) -> None:
    hf, model = pair
    ids = tokens(136, seed=2)
    # the 80-token chunk follows a prefix: causal attention aligned to the last key, no mask tensor
    chunks = [ids[:37], ids[37:117], ids[117:131]] + [ids[i : i + 1] for i in range(131, 136)]
    ref, hf_cache = hf_incremental(hf, chunks)
    cache, view, state = scrambled_cache(model), View(), model.new_state()
    for chunk, expected in zip(chunks, ref):
        pos = torch.arange(view.length, view.length + len(chunk))
        got = model.run(chunk, pos, cache, view, state, last_only=False)
        assert (got - expected).abs().max().item() <= TOL
    for j, layer in enumerate(model.spec.deltanet_layers):
        hf_rec = hf_cache.get_recurrent_state(layer)[0]
        hf_conv = hf_cache.get_conv_state(layer)[0]
        assert (state.rec[j] - hf_rec).abs().max().item() <= 1e-6
        # conv tails are raw projections (|x| up to ~4): 1e-6 relative is a few fp32 ulps
        assert (state.conv[j] - hf_conv[:, 1:]).abs().max().item() <= 1e-6 * max(1.0, hf_conv.abs().max().item())


def test_fork_from_snapshot_matches_hf(pair) -> None:
    """Prefill a prefix, snapshot, continue one way, then fork the other way from the snapshot."""
    hf, model = pair
    prefix, left, right = tokens(70, seed=4), tokens(30, seed=5), tokens(25, seed=6)
    cache, view, state = scrambled_cache(model), View(), model.new_state()
    model.run(prefix, torch.arange(70), cache, view, state)
    snap = state.snapshot()
    shared = view.table[: 70 // B]
    model.run(left, torch.arange(70, 100), cache, view, state)
    fork = View(table=shared + cache.allocate(1), length=70)
    k, v, pos = cache.read_block(view.table[70 // B])  # copy-on-write of the partly shared block
    cache.write_kv(fork.table[-1], k.clone(), v.clone())
    cache.set_positions([fork.table[-1]], pos.clone())
    state.restore(snap)
    got = model.run(right, torch.arange(70, 95), cache, fork, state, last_only=False)
    expected = hf_logits(hf, torch.cat([prefix, right]))[70:]
    assert (got - expected).abs().max().item() <= TOL
    again = model.run(left[:1], torch.arange(100, 101), cache, view, model.new_state())
    assert again.shape == (1, model.spec.vocab_size)


def test_explicit_positions_shift_invariance(pair) -> None:
    """Positions are honoured: an offset run equals HF at the same offset."""
    hf, model = pair
    ids = tokens(40, seed=8)
    cache, view, state = scrambled_cache(model), View(), model.new_state()
    got = model.run(ids, torch.arange(300, 340), cache, view, state, last_only=False)
    assert (got - hf_logits(hf, ids, offset=300)).abs().max().item() <= TOL


def test_compact_re_rope_of_stored_blocks(pair) -> None:
    """Re-positioning stored (pre-RoPE) blocks then decoding equals HF at the new positions."""
    hf, model = pair
    ids = tokens(49, seed=9)
    cache, view, state = scrambled_cache(model), View(), model.new_state()
    model.run(ids[:48], torch.arange(48), cache, view, state)
    cache.set_positions(view.table, torch.arange(200, 200 + len(view.table) * B))
    got = model.run(ids[48:], torch.tensor([248]), cache, view, state)
    expected = hf_logits(hf, ids, offset=200)[-1:]
    assert (got - expected).abs().max().item() <= TOL
