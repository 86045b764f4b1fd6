"""``TorchAdapter``: the EngineAdapter (kvmem_core.adapter) over the native torch engine.

The engine frame of a block is pre-RoPE K, so ``content_keys`` is the identity and placing a
block at another position (compact mode) only changes the positions stored with its slots.
Hybrid (qwen35) models also expose their recurrent state: ``save_state`` / ``restore_state``
take and apply checkpoints (the query-replay point, turn boundaries).
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvmem_core.adapter import PREFILL_CHUNK, Capabilities, ForwardOut, Placement, file_fingerprint
from kvmem_core.errors import ModelNotFoundError
from kvmem_core.layout import BlockKV, BlockLayout
from kvmem_core.retrieval.summaries import SummaryOptions
from kvmem_core.threads import Threads, resolve_threads
from kvmem_torch import fp8
from kvmem_torch.host_memory import host_tensor, to_host_array
from kvmem_torch.model import Model, RecurrentState
from kvmem_torch.mtp import Forwarded, MTPDrafter
from kvmem_torch.runner import Runner
from kvmem_torch.scoring import TorchRetrievalHeads
from kvmem_torch.spec import ModelSpec
from kvmem_torch.staged import StagedBlocks
from kvmem_torch.tokenizer import IdTokenizer, Tokenizer, from_gguf_meta, from_hf_dir
from kvmem_torch.transfer import BlockStager
from kvmem_torch.warm_up import warm_up

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
Loaded = tuple[
    ModelSpec, dict[str, torch.Tensor], Tokenizer | IdTokenizer, str
]  # spec, weights, tokenizer, fingerprint


@dataclass
class Verified:
    """The tokens of a ``forward_every`` on a hybrid model and the recurrent state before them."""

    before: RecurrentState
    tokens: list[int]
    positions: list[int]


class TorchAdapter:
    """One model (GGUF file or HF directory) and its view of ``view_tokens`` cells."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        view_tokens: int,
        block_tokens: int = 128,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        prefill_chunk: int | None = None,
        cuda_graphs: bool | None = None,
        progress: bool = True,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        loaded: Loaded | None = None,
        kv_fp8: bool = False,
    ) -> None:
        """Thread counts (CPU only) default as ``kvmem_core.threads.resolve_threads`` says. ``dtype`` (a torch dtype
        or its name; None: bfloat16 on CUDA, float32 elsewhere) holds weights and KV. ``loaded``: spec,
        weights (``dtype`` on ``device``), tokenizer and fingerprint already in memory (the speed bench's random
        weights); ``model_path`` then only names the model. ``prefill_chunk``: most tokens per forward (None:
        ``prefill_chunk_for(device)``). ``kv_fp8``: K/V as 8-bit e4m3 rows with scales (``fp8``) in the view and
        every tier, instead of in ``dtype``."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.threads = resolve_threads(n_threads, n_threads_batch)
        self._on_cpu = device == "cpu"
        self._use_threads(self.threads.batch)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        path = Path(model_path)
        spec, weights, self.tokenizer, self.fingerprint = loaded or _load(path, dtype, device, progress)
        self.model = Model(spec, weights)
        self.model.use_cudnn_prefill(True)  # long eager forwards' attention, where it runs and agrees
        num_blocks = -(-view_tokens // block_tokens) + 2  # slack for partly filled blocks
        self.runner = Runner(self.model, num_blocks, block_tokens, cuda_graphs, kv_fp8)
        self.stager = BlockStager(self.runner.cache)
        self.model_path, self.model_id = str(path), path.stem if path.is_file() else path.name
        self.chat_template = self.tokenizer.chat_template or ""
        self.prefill_chunk = prefill_chunk or prefill_chunk_for(device)
        self._mirrors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # retrieval index -> GPU copy
        self._verified: Verified | None = None  # a hybrid model's last ``forward_every``, while it can be cut back
        self.layout = BlockLayout(
            len(spec.attention_layers),
            spec.n_kv_heads,
            spec.head_dim,
            spec.n_heads,
            block_tokens,
            "fp8_e4m3" if kv_fp8 else _DTYPE_NAMES[dtype],
        )
        self.caps = Capabilities(
            backend="torch",
            max_view_tokens=view_tokens,
            trained_ctx=spec.max_context,
            paged_slots=True,
            recurrent_state=bool(spec.deltanet_layers),
            async_copies=device.startswith("cuda"),
            devices=(device,),
            prefill_chunk=self.prefill_chunk,
            staged_reads=True,
            draft_head=self.model.mtp is not None,
            cheap_drafts=self.runner.graph_verify,
            snapshots=bool(spec.deltanet_layers),
            moves_cells=True,
        )
        self._forwarded: Forwarded | None = None  # with an MTP head: the last forward's rows (``draft_head``)
        self.staged = StagedBlocks()  # reads ``stage_reads`` took, for ``read_block``

    # ---- text ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def token_array(self, text: str) -> np.ndarray:
        return self.tokenizer.encode_array(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return b"".join(self.tokenizer.token_bytes(t) for t in ids).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return self.tokenizer.token_bytes(token)

    def is_eog(self, token: int) -> bool:
        return self.tokenizer.is_eog(token)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        return self.tokenizer.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)

    # ---- forward ------------------------------------------------------------------------

    def forward(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        *,
        want_logits: bool = True,
        capture_from: int | None = None,
        snapshot_at: Sequence[int] = (),
    ) -> ForwardOut:
        """``EngineAdapter.forward``; captured queries and ``snapshot_at`` states are copied to the host behind the
        forward (on a GPU the host does not wait for them until it reads them)."""
        assert len(tokens) == len(positions) and len(tokens) > 0
        assert len(tokens) <= self.view_free(), "view overflow: the core must make room first"
        self._use_threads(self.threads.batch if len(tokens) > 1 else self.threads.decode)
        self.stager.wait()
        self._verified = None
        captured, logits, states = [], None, []
        for a in range(0, len(tokens), self.prefill_chunk):
            b = min(a + self.prefill_chunk, len(tokens))
            capture = capture_from is not None and b > capture_from
            snaps = [(o - a, self.model.new_state()) for o in snapshot_at if a < o < b]
            logits, q = self.runner.forward(list(tokens[a:b]), list(positions[a:b]), capture=capture, snapshots=snaps)
            states += [state for _, state in snaps] + ([self.runner.state.snapshot()] if b in snapshot_at else [])
            if capture:
                skip = max(0, capture_from - a)
                captured.append(torch.stack([q[i][skip:] for i in self.model.spec.attention_layers]))
        queries = _queued_to_host(torch.cat(captured, dim=1).float()) if captured else None
        read_states = _queued_to_host(*(x for s in states for x in (s.conv, s.rec))) if states else None
        out = {
            "read_queries": (lambda: queries()[0].numpy()) if queries else None,
            "read_states": (lambda: _pairs(read_states())) if read_states else None,
        }
        self._keep_rows(tokens[a:b], positions[a:b])
        if not want_logits:
            return ForwardOut(**out)
        last = logits[-1]
        # page-locked on a GPU: a pageable copy of the vocabulary costs a decode step more than the bytes
        return ForwardOut(read=lambda: _to_host(last.float()).numpy(), **out)

    def forward_every(self, tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """``forward`` with the logits of every token, float32 ``[len(tokens), vocab]`` (speculative decoding
        verifies a draft with them). At most one prefill chunk. On a hybrid model the recurrent state before the
        tokens is kept until the next forward: ``drop`` of a rejected suffix rebuilds the state of the kept ones."""
        assert 0 < len(tokens) <= min(self.prefill_chunk, self.view_free()) and len(tokens) == len(positions)
        self._use_threads(self.threads.batch if len(tokens) > 1 else self.threads.decode)
        self.stager.wait()
        before = self.runner.state.snapshot() if self.caps.recurrent_state else None
        logits = self.runner.forward_all(list(tokens), list(positions))
        self._keep_rows(tokens, positions)
        self._verified = None if before is None else Verified(before, list(tokens), list(positions))
        return _to_host(logits.float()).numpy()

    def draft_head(self) -> MTPDrafter:
        """A drafter from the model's MTP layer (``caps.draft_head``) for a step whose prefill just ran: it pairs the
        hidden states of each forward's committed rows with the tokens that followed them (``kvmem_torch.mtp``)."""
        assert self.model.mtp is not None, "the model has no MTP layer"
        return MTPDrafter(self.model.mtp, lambda: self._forwarded)

    def _keep_rows(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        """With an MTP head: the forward just run, its rows' hidden states (None where the model kept none)."""
        hidden = self.model.hidden
        self._forwarded = None if hidden is None else Forwarded(list(tokens), list(positions), hidden)

    def view_free(self) -> int:
        return min(self.caps.max_view_tokens - self.runner.length, self.runner.view_free())

    def set_threads(self, threads: Threads) -> None:
        """Compute with other thread counts from the next forward on (``kvmem bench speed``'s thread sweep)."""
        self.threads = threads

    def _use_threads(self, n: int) -> None:
        if self._on_cpu and torch.get_num_threads() != n:  # resizing torch's pool is not free: only on a change
            torch.set_num_threads(n)

    # ---- blocks -------------------------------------------------------------------------

    def read_block(self, start_pos: int, n_tokens: int) -> BlockKV:
        """The cells' KV; a read ``stage_reads`` took is handed out as it was then (waiting only for its copy)."""
        staged = self.staged.take(start_pos, n_tokens)
        if staged is not None:
            return staged
        self.stager.wait()
        k, v = self.runner.read_cells(start_pos, n_tokens)
        return BlockKV(to_host_array(k), to_host_array(v))

    def stage_reads(self, starts: Sequence[int], n_tokens: int) -> None:
        """Take the KV of the ``n_tokens`` cells from each of ``starts`` now, for ``read_block`` later (after
        forwards and drops in between): one gather of every block, on a GPU copied into page-locked arrays the host
        tier keeps, with the blocks' summaries where ``summarize_staged`` asked (``staged.StagedBlocks``), queued
        behind the work so far, so the host may queue the next forward before it waits for them."""
        self.stager.wait()
        if starts:
            self.staged.stage(*self.runner.read_runs(starts, n_tokens), starts, n_tokens)

    def summarize_staged(self, heads: Sequence[tuple[int, int]], opts: SummaryOptions) -> None:
        self.staged.summarize(heads, opts, self.layout.quantized)

    def staged_summary(self, start_pos: int, n_tokens: int) -> dict[str, np.ndarray] | None:
        return self.staged.summary(start_pos, n_tokens)

    def write_blocks(self, placements: Sequence[Placement]) -> None:
        """Insert blocks at ``dst_pos`` (K is pre-RoPE: nothing to re-rotate); copies run on the stager."""
        dtype = self.runner.cache.kv.dtype
        blocks = [
            (_from_numpy(p.kv.k, dtype), _from_numpy(p.kv.v, dtype), range(p.dst_pos, p.dst_pos + p.kv.k.shape[1]))
            for p in placements
        ]
        self.stager.put(self.runner, blocks)

    def move_cells(self, moves: Sequence[tuple[int, int, int]]) -> None:
        """``MovesCells``: new positions for resident cells, in place (their RoPE rows rewritten, K is pre-RoPE)."""
        self.stager.wait()
        self.runner.move_cells(moves)
        self._verified = self._forwarded = None  # their positions are the cells' old ones

    def content_keys(self, k: np.ndarray, start_pos: int) -> np.ndarray:
        if k.dtype == np.uint8:
            return fp8.dequantize(torch.from_numpy(k), torch.float32).numpy()
        return _from_numpy(k, torch.float32).numpy() if k.dtype == np.uint16 else k.astype(np.float32)

    def drop(self, p0: int, p1: int) -> None:
        """Remove the cells at positions ``[p0, p1)`` (``p1 < 0``: to the end). A tail cut into the tokens of the
        last ``forward_every`` also rewinds a hybrid model's recurrent state to the tokens kept."""
        self.stager.wait()
        self.runner.drop(p0, p1 if p1 >= 0 else 1 << 62)
        if self._verified is not None and p1 < 0:
            self._rewind(p0)

    def _rewind(self, end: int) -> None:
        """Make the recurrent state that of the verified tokens before position ``end``: the checkpoint taken
        before them, then the kept ones forwarded again (their cells are recomputed with it)."""
        v = self._verified
        kept = sum(p < end for p in v.positions)
        if kept == len(v.tokens):
            return
        self.runner.drop(v.positions[0], 1 << 62)
        self.runner.state.restore(v.before)
        if kept:
            self.runner.forward(v.tokens[:kept], v.positions[:kept])
        self._verified = Verified(v.before, v.tokens[:kept], v.positions[:kept])

    def clear_view(self) -> None:
        """Empty the view and reset the recurrent state (a fresh sequence); staged reads are forgotten."""
        self.stager.wait()
        self.staged.clear()
        self.runner.clear()
        self._verified = self._forwarded = None

    def warm_up(self) -> float:
        """``WarmUp.warm_up`` on a GPU (``kvmem_torch.warm_up``); on the CPU nothing compiles: 0."""
        return warm_up(self) if self.model.device.type == "cuda" else 0.0

    def make_scorer(self, name: str, heads: Sequence[tuple[int, int]]) -> TorchRetrievalHeads | None:
        """``retrieval-heads`` on the GPU when the model runs on one (None: the core's numpy scorer)."""
        if name != "retrieval-heads" or self.model.device.type != "cuda" or not heads:
            return None
        return TorchRetrievalHeads(tuple(heads), self.model.device, mirrors=self._mirrors)

    # ---- recurrent state (hybrid models) ------------------------------------------------

    def save_state(self) -> RecurrentState:
        """Checkpoint of the recurrent state at the view's current end, in host memory (pinned on a GPU: a
        27B-shape state is ~150 MB, which pageable memory takes ~9x longer to receive)."""
        state = self.runner.state
        return RecurrentState(_to_host(state.conv), _to_host(state.rec))

    def restore_state(self, snap: RecurrentState) -> None:
        self.runner.state.restore(snap)
        self._verified = None

    def state_arrays(self, snap: RecurrentState) -> dict[str, np.ndarray]:
        """The conv tails (widened to fp32: exact for bf16/fp16) and the fp32 recurrent matrices."""
        return {"conv": snap.conv.float().numpy(), "rec": snap.rec.numpy()}

    def state_from_arrays(self, arrays: dict[str, np.ndarray]) -> RecurrentState:
        conv = torch.from_numpy(arrays["conv"]).to(self.runner.state.conv.dtype)
        return RecurrentState(conv, torch.from_numpy(arrays["rec"]))

    def close(self) -> None:
        self.stager.wait()
        self.staged.clear()
        del self.runner, self.model


def prefill_chunk_for(device: str) -> int:
    """Tokens per prefill forward: 4096 on a GPU, where larger GEMMs and fewer passes over the view's keys pay
    (measured at the 27B shape, docs/torch.md); the core's default on the CPU, where they do not."""
    return 4096 if device.startswith("cuda") else PREFILL_CHUNK


def _load(path: Path, dtype: torch.dtype, device: str, progress: bool) -> Loaded:
    """Spec, weights, tokenizer (token ids as numbers for ``no_vocab`` test models) and fingerprint."""
    from kvmem_torch.gguf_loader import load_gguf
    from kvmem_torch.hf_loader import load_hf_dir

    if path.is_dir():
        spec, weights = load_hf_dir(path, dtype, device, progress)
        digest = hashlib.blake2b(digest_size=8)
        for f in sorted(path.glob("*.safetensors")):
            digest.update(file_fingerprint(str(f)).encode())
        return spec, weights, from_hf_dir(path), digest.hexdigest()
    if not path.is_file():
        raise ModelNotFoundError(f"model not found: {path}")
    spec, weights, meta = load_gguf(path, dtype, device, progress)
    no_vocab = meta.get("tokenizer.ggml.model") == "no_vocab"
    tokenizer = IdTokenizer(spec.vocab_size) if no_vocab else from_gguf_meta(meta)
    return spec, weights, tokenizer, file_fingerprint(str(path))


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of ``x``; page-locked when ``x`` is on a GPU (the copy then runs at the DMA rate)."""
    if not x.is_cuda:
        return x.clone()
    return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)


def _queued_to_host(*xs: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
    """Host copies of ``xs`` (fresh tensors the caller does not write again): on a GPU, copies to page-locked
    memory queued on the current stream now, and a call that waits for them alone; on the CPU, ``xs`` as they are."""
    if not xs[0].is_cuda:
        return lambda: list(xs)
    host = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in xs]
    for h, x in zip(host, xs):
        h.copy_(x, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> list[torch.Tensor]:
        copied.synchronize()
        return host

    return wait


def _pairs(tensors: list[torch.Tensor]) -> list[RecurrentState]:
    """(conv, rec, conv, rec, ...) as checkpoints."""
    return [RecurrentState(conv, rec) for conv, rec in zip(tensors[::2], tensors[1::2])]


def _from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return host_tensor(np.ascontiguousarray(a)).to(dtype)
