"""qwen35's MTP layer (``kvmem_torch.mtp``) against a float64 reference of the published architecture written
here from the checkpoint's own tensors (Qwen3-Next / Qwen3.5: pre-fc norms on the embedding and the hidden state,
their concatenation through ``fc``, one gated-attention decoder layer, the final norm, the shared LM head), and
the loaders: an HF directory's ``mtp.*`` tensors and a GGUF's ``nextn`` block load to the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf_writer import write_gguf  # noqa: E402
from kvmem_torch.gguf_loader import load_gguf  # noqa: E402
from kvmem_torch.hf_loader import load_hf_dir, weights_from_hf  # noqa: E402
from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.mtp import Forwarded, MTPDrafter, has_mtp  # noqa: E402
from kvmem_torch.paged import View  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model, tiny_mtp_state, tiny_spec_weights  # noqa: E402

CONFIG = tiny_hf_config("qwen35")
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny() -> tuple[object, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    return tiny_hf_model("qwen35", seed=5), tiny_mtp_state(CONFIG, seed=6)


def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's RMSNorm: the stored weight is w, the multiplier 1 + w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG["rms_norm_eps"]) * (1 + w)


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the first quarter of each head (partial_rotary_factor 0.25)."""
    rd = int(CONFIG["head_dim"] * 0.25)
    theta = CONFIG["rope_parameters"]["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    r, rest = x[..., :rd], x[..., rd:]
    rotated = torch.cat([-r[..., rd // 2 :], r[..., : rd // 2]], -1)
    return torch.cat([r * cos + rotated * sin, rest], -1)


def reference(state, embed, head, hidden, tokens, positions) -> torch.Tensor:  # noqa: ANN001
    """Draft logits of the pairs (hidden[i], tokens[i]) at ``positions``, attending causally among themselves."""
    return reference_hidden(state, embed, hidden, tokens, positions) @ head.double().T


def reference_hidden(state, embed, hidden, tokens, positions) -> torch.Tensor:  # noqa: ANN001
    """The draft hidden states (after the MTP layer's final norm) of ``reference``."""
    W = {k.removeprefix("mtp."): v.double() for k, v in state.items()}
    L = {k.removeprefix("layers.0."): v for k, v in W.items() if k.startswith("layers.0.")}
    T, heads, kv, hd = len(tokens), CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    e = norm(embed.double()[tokens], W["pre_fc_norm_embedding.weight"])
    x = torch.cat([e, norm(hidden.double(), W["pre_fc_norm_hidden.weight"])], -1) @ W["fc.weight"].T
    a = norm(x, L["input_layernorm.weight"])
    q, gate = (a @ L["self_attn.q_proj.weight"].T).view(T, heads, 2 * hd).chunk(2, dim=-1)
    q = rope(norm(q, L["self_attn.q_norm.weight"]), positions)
    k = rope(norm((a @ L["self_attn.k_proj.weight"].T).view(T, kv, hd), L["self_attn.k_norm.weight"]), positions)
    v = (a @ L["self_attn.v_proj.weight"].T).view(T, kv, hd)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * hd**-0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
    x = x + out @ L["self_attn.o_proj.weight"].T
    m = norm(x, L["post_attention_layernorm.weight"])
    up = torch.nn.functional.silu(m @ L["mlp.gate_proj.weight"].T) * (m @ L["mlp.up_proj.weight"].T)
    x = x + up @ L["mlp.down_proj.weight"].T
    return norm(x, W["norm.weight"])


def test_mtp_forward_matches_the_float64_reference(tiny) -> None:
    """In one call, and split in two (the second half attending to the first through the head's own KV)."""
    hf, mtp = tiny
    spec, weights = tiny_spec_weights(hf)
    weights.update(weights_from_hf(spec, mtp, torch.float32))
    head = Model(spec, weights).mtp
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(12, CONFIG["hidden_size"], generator=gen)
    tokens = torch.randint(0, CONFIG["vocab_size"], (12,), generator=gen)
    positions = torch.arange(40, 52)
    state = hf.state_dict()
    want = reference(mtp, state["model.embed_tokens.weight"], state["lm_head.weight"], hidden, tokens, positions)
    with torch.inference_mode():
        head.truncate(0)
        whole = head.logits(head.forward(hidden, tokens.tolist(), positions.tolist()))
        head.truncate(0)
        first = head.logits(head.forward(hidden[:5], tokens[:5].tolist(), positions[:5].tolist()))
        rest = head.logits(head.forward(hidden[5:], tokens[5:].tolist(), positions[5:].tolist()))
    scale = want.abs().max().item()
    assert (whole.double() - want).abs().max().item() <= TOL * scale
    assert (torch.cat([first, rest]).double() - want).abs().max().item() <= TOL * scale
    head.truncate(5)  # forgetting the second half and running it again gives the same
    with torch.inference_mode():
        again = head.logits(head.forward(hidden[5:], tokens[5:].tolist(), positions[5:].tolist()))
    assert torch.equal(again, rest)


def test_drafter_pairs_hidden_states_with_the_next_tokens(tiny) -> None:
    """After a forward over a prompt, the drafter pairs the main model's final-normed hidden state of each prompt
    token with the token after it (the last one with the token chosen after the prompt), then feeds each guess
    back with the head's own output: its three guesses are the reference's argmax chain."""
    hf, mtp = tiny
    spec, weights = tiny_spec_weights(hf)
    weights.update(weights_from_hf(spec, mtp, torch.float32))
    model = Model(spec, weights)
    prompt = torch.randint(0, CONFIG["vocab_size"], (10,), generator=torch.Generator().manual_seed(8))
    model.run(prompt, torch.arange(10), model.new_cache(4, 16), View(), model.new_state())
    with torch.no_grad():
        want_hidden = hf.model(prompt[None]).last_hidden_state[0]
    torch.testing.assert_close(model.hidden, want_hidden, rtol=1e-4, atol=1e-4)  # the hidden states MTP reads
    drafter = MTPDrafter(model.mtp, lambda: Forwarded(prompt.tolist(), list(range(10)), model.hidden))
    drafter.extend([77])
    draft = drafter.propose()
    state = hf.state_dict()
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    hidden, tokens, want = model.hidden.double(), [*prompt[1:].tolist(), 77], []
    for i in range(3):
        out = reference_hidden(mtp, embed, hidden, torch.tensor(tokens), torch.arange(10 + i))
        want.append(int((out[-1] @ head.double().T).argmax()))
        hidden, tokens = torch.cat([hidden, out[-1:]]), [*tokens, want[-1]]
    assert draft == want
    assert model.mtp.length == 10, "the prompt's pairs are kept, the guesses' K/V are not"


def test_hf_directory_and_gguf_load_the_mtp_layer(tiny, tmp_path: Path) -> None:
    """``mtp.*`` safetensors beside the model's own, and the same written as a GGUF's ``blk.N.nextn.*`` block,
    load to the same internal MTP weights; the main layers' count leaves the MTP block out."""
    from safetensors.torch import save_file

    hf, mtp = tiny
    hf.save_pretrained(tmp_path / "hf")
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(tmp_path / "hf" / "mtp.safetensors"))
    spec, from_dir = load_hf_dir(tmp_path / "hf", torch.float32, progress=False)
    write_gguf(tmp_path / "m.gguf", CONFIG, {**hf.state_dict(), **mtp})
    gguf_spec, from_gguf, meta = load_gguf(tmp_path / "m.gguf", torch.float32, progress=False)
    assert meta["qwen35.nextn_predict_layers"] == 1 and gguf_spec.n_layers == spec.n_layers == 4
    assert has_mtp(from_dir) and has_mtp(from_gguf)
    names = sorted(n for n in from_dir if n.startswith("mtp."))
    assert names == sorted(n for n in from_gguf if n.startswith("mtp.")) and len(names) == len(mtp)
    for name in names:
        torch.testing.assert_close(from_gguf[name], from_dir[name], rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(from_dir["mtp.enorm"], 1 + mtp["mtp.pre_fc_norm_embedding.weight"])
    assert not has_mtp(tiny_spec_weights(hf)[1]), "a model without mtp.* tensors has no MTP layer"
