"""``LlamaCppAdapter``: the EngineAdapter over an unmodified llama.cpp (llama-cpp-python 0.3.36).

The view is sequence 0 of a unified KV cache. A block travels as a sequence-state blob:
copied to the scratch sequence 1 with ``seq_cp`` and saved (export), or synthesized for
sequence 1, restored and copied into the view (import). Every buffer is reused.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import jinja2.sandbox
import llama_cpp as L
import numpy as np

from kvmem_core.adapter import Capabilities, ForwardOut, Placement, file_fingerprint
from kvmem_core.errors import UnsupportedModelError
from kvmem_core.layout import BlockKV, BlockLayout
from kvmem_core.thread_governor import ThreadGovernor
from kvmem_core.tokens import PrefixTokenizer, read_only
from kvmem_core.threads import Threads, map_on, resolve_threads
from kvmem_llamacpp import blob, q8_0
from kvmem_llamacpp.capture import QueryCapture
from kvmem_llamacpp.blob import GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_Q8_0
from kvmem_llamacpp.lowlevel import LlamaContext, LlamaModel, init_backend
from kvmem_llamacpp.offload import can_offload, describe, offload_runtime, resolve_gpu_layers
from kvmem_llamacpp.rope import rotate
from kvmem_llamacpp.scoring import ThreadedHeadsScorer
from kvmem_llamacpp.vocab import cut_tokens, tokens

# ChatML, the common default of instruction-tuned GGUFs that carry no template
CHATML_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}"
)
log = logging.getLogger("kvmem.llamacpp")
_CACHE_TYPES = {"float32": GGML_TYPE_F32, "float16": GGML_TYPE_F16, "q8_0": GGML_TYPE_Q8_0}  # layout dtype -> ggml


class LlamaCppAdapter:
    """One GGUF model and its view of ``view_tokens`` cells (see kvmem_core.adapter.EngineAdapter)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        view_tokens: int,
        block_tokens: int = 128,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_gpu_layers: int | None = None,
        n_batch: int = 512,
        flash_attn: bool = True,
        f32_cache: bool = False,
        chat_template: str | None = None,
        capture_context: bool | None = None,
        kv_q8_0: bool = False,
    ) -> None:
        """Thread counts default as ``kvmem_core.threads.resolve_threads`` says, GPU layers as ``offload`` says;
        ``chat_template`` replaces the model's own. ``capture_context`` captures queries in a second context,
        so the view's own context runs without an eval callback (``_copy_view`` says what each costs); None: on
        when layers are offloaded to a GPU (where the callback costs decode most), off on the CPU. ``kv_q8_0``: K and V
        cached, exported and stored as q8_0 (8.5 bits a value; needs ``flash_attn``)."""
        if kv_q8_0 and not flash_attn:
            raise UnsupportedModelError("llama.cpp quantizes the V cache only with flash attention")
        kv_dtype = "q8_0" if kv_q8_0 else "float32" if f32_cache else "float16"
        path = Path(model_path)
        init_backend()
        self.model = LlamaModel(path, n_gpu_layers=resolve_gpu_layers(n_gpu_layers, can_offload()))
        m = self.model
        self.capture = QueryCapture(m.n_layer, m.n_head, m.head_dim)
        threads = resolve_threads(n_threads, n_threads_batch)
        self._governor = ThreadGovernor(threads.decode)
        self._governed = threads.auto
        context = functools.partial(
            LlamaContext,
            m,
            view_tokens,
            threads,
            n_batch=n_batch,
            flash_attn=flash_attn,
            cache_type=_CACHE_TYPES[kv_dtype],
        )
        self.ctx, self._capture_ctx = self._make_contexts(
            context, m.n_gpu_layers != 0 if capture_context is None else capture_context, capture_context is None
        )
        self.placement = describe(m.n_gpu_layers, m.n_layer)
        self.model_path = str(path)
        self.model_id = path.stem
        self.fingerprint = file_fingerprint(self.model_path)
        self.layout = BlockLayout(m.n_layer, m.n_head_kv, m.head_dim, m.n_head, block_tokens, kv_dtype)
        self.caps = Capabilities(
            backend="llama.cpp",
            max_view_tokens=self.ctx.n_ctx,
            trained_ctx=m.n_ctx_train,
            devices=(offload_runtime(m.n_gpu_layers),),
            probe=True,
        )
        self._n_embd_kv = m.n_head_kv * m.head_dim
        self._v_trans = 0 if flash_attn else 1
        self._import = np.empty(0, dtype=np.uint8)
        self._view: set[int] = set()
        self.chat_template = chat_template or self.model.meta("tokenizer.chat_template") or CHATML_TEMPLATE
        self._template = self._compile_template()

    def _make_contexts(
        self, context: Callable[..., LlamaContext], separate: bool, optional: bool
    ) -> tuple[LlamaContext, LlamaContext | None]:
        """(view context, capture context or None). An ``optional`` capture context that cannot be made (GPU
        memory for a second view) leaves capture on the view's own context."""
        if not separate:
            return context(gate=self.capture.gate), None
        view = context(gate=None)
        try:
            return view, context(gate=self.capture.gate)
        except UnsupportedModelError:
            view.close()
            if not optional:
                raise
            log.warning("no room for a capture context: queries are captured in the view's own context")
            return context(gate=self.capture.gate), None

    # ---- text -------------------------------------------------------------------------

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        ids = self._parsed(text) if special else tokens(self.model.vocab, text, special=False)
        bos = self._added_bos()
        return [bos, *ids] if bos is not None and ids[:1] != [bos] else ids

    def token_array(self, text: str) -> np.ndarray:
        ids, bos = self._parsed.array(text), self._added_bos()
        if bos is None or ids[:1].tolist() == [bos]:
            return ids
        return read_only(np.concatenate(([bos], ids)))

    def _added_bos(self) -> int | None:
        """The BOS id where the model was trained with one: it gets it once, whether or not the template wrote it."""
        bos = L.llama_vocab_bos(self.model.vocab)
        return bos if L.llama_vocab_get_add_bos(self.model.vocab) and bos >= 0 else None

    @functools.cached_property
    def _parsed(self) -> PrefixTokenizer:
        """Tokens of a text with special tokens parsed, reusing those of the prefix it shares with a recent one."""
        vocab = self.model.vocab
        return PrefixTokenizer(functools.partial(tokens, vocab, special=True), functools.partial(cut_tokens, vocab))

    def token_bytes(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.model.vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.model.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:n]

    def detokenize(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.model.vocab, token))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        return self._template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special(L.llama_vocab_bos),
            eos_token=self._special(L.llama_vocab_eos),
            **kwargs,
        )

    def _special(self, getter: Any) -> str:
        token = getter(self.model.vocab)
        return self.token_bytes(token).decode("utf-8", "replace") if token >= 0 else ""

    def _compile_template(self) -> jinja2.Template:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        return env.from_string(self.chat_template)

    # ---- forward ----------------------------------------------------------------------

    def forward(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        *,
        want_logits: bool = True,
        capture_from: int | None = None,
        stop_after: int | None = None,
    ) -> ForwardOut:
        assert len(tokens) == len(positions) and len(tokens) > 0
        assert stop_after is None or capture_from is not None, "a probe captures queries"
        want_logits = want_logits and stop_after is None
        assert len(tokens) <= self.view_free(), "view overflow: the core must make room first"
        ctx = self.ctx if capture_from is None or self._capture_ctx is None else self._capture_ctx
        self._govern(ctx)
        if capture_from is not None:
            self.capture.arm(len(tokens), capture_from, stop_after)
        if ctx is not self.ctx:
            _copy_view(self.ctx, ctx)
        step = ctx.n_batch
        for i in range(0, len(tokens), step):
            last = i + step >= len(tokens)
            if capture_from is not None:
                self.capture.next_chunk(min(step, len(tokens) - i))
            ctx.decode(tokens[i : i + step], positions[i : i + step], LlamaContext.VIEW, want_logits and last)
        if ctx is not self.ctx:
            _copy_view(ctx, self.ctx)
        self._view.update(int(p) for p in positions)
        queries = self.capture.take() if capture_from is not None else None
        return ForwardOut(queries=queries, read=ctx.last_logits if want_logits else None)

    def forward_every(self, tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """``forward`` with the logits of every token, float32 ``[len(tokens), vocab]`` (speculative decoding
        verifies a draft with them); a view of llama.cpp's buffer, valid until the next forward. At most one
        batch of tokens."""
        assert 0 < len(tokens) <= min(self.ctx.n_batch, self.view_free()) and len(tokens) == len(positions)
        self._govern(self.ctx)
        self.ctx.decode(tokens, positions, LlamaContext.VIEW, True, every_logit=True)
        self._view.update(int(p) for p in positions)
        return self.ctx.all_logits(len(tokens))

    def _govern(self, ctx: LlamaContext) -> None:
        """Follow the cores other processes leave free, when the thread count is automatic."""
        if self._governed and ctx.threads.decode != (n := self._governor.poll()):
            ctx.set_threads(Threads(n, n, auto=True))

    def view_free(self) -> int:
        return self.ctx.n_ctx - len(self._view)

    def set_threads(self, threads: Threads) -> None:
        """Compute with other thread counts from the next forward on (``kvmem bench speed``'s thread sweep);
        ``auto`` counts follow the cores other processes leave free, up to ``threads.decode``."""
        self._governed = threads.auto
        if threads.auto and threads.decode != self._governor.cores:
            self._governor = ThreadGovernor(threads.decode)
        for ctx in self._contexts():
            ctx.set_threads(threads)

    # ---- blocks -----------------------------------------------------------------------

    def read_block(self, start_pos: int, n_tokens: int) -> BlockKV:
        c = self.ctx
        c.seq_cp(c.VIEW, c.SCRATCH, start_pos, start_pos + n_tokens)
        try:
            kv, _ = blob.parse(c.get_state(c.SCRATCH), self.model.n_layer, self._n_embd_kv)
        finally:
            c.seq_rm(c.SCRATCH)
        assert kv.positions.size == n_tokens and kv.positions[0] == start_pos, "block not resident in the view"
        shape = (self.model.n_layer, n_tokens, self.model.n_head_kv, self.layout.head_row)
        return BlockKV(kv.k.reshape(shape), kv.v.reshape(shape))

    def write_blocks(self, placements: Sequence[Placement]) -> None:
        if not placements:
            return
        runs = self._assemble(placements)
        c = self.ctx
        n_cells = sum(run.positions.size for run in runs)
        size = blob.blob_size(n_cells, self.model.n_layer, runs[0].k.shape[2] * runs[0].k.itemsize)
        if self._import.size < size:
            self._import = np.empty(size, dtype=np.uint8)
        n = blob.synthesize(self._import, c.SCRATCH, runs, self._v_trans)
        assert n == size
        c.set_state(c.SCRATCH, self._import, n)
        c.seq_cp(c.SCRATCH, c.VIEW)
        c.seq_rm(c.SCRATCH)
        self._view.update(int(p) for run in runs for p in run.positions)

    def _assemble(self, placements: Sequence[Placement]) -> list[blob.SeqKV]:
        """The placements' KV, each at its ``dst_pos``, as runs of one sequence; moved blocks are rotated on the
        prefill threads (the model is idle meanwhile)."""

        def move(p: Placement) -> blob.SeqKV:
            kv, n = self.moved(p.kv, p.src_pos, p.dst_pos), p.kv.k.shape[1]
            k, v = kv.k.reshape(self.model.n_layer, n, -1), kv.v.reshape(self.model.n_layer, n, -1)
            return blob.SeqKV(np.arange(p.dst_pos, p.dst_pos + n, dtype=np.int32), k, v)

        return map_on(self.ctx.threads.batch, move, placements)

    def moved(self, kv: BlockKV, src_pos: int, dst_pos: int) -> BlockKV:
        """K rotated by ``dst_pos - src_pos`` positions in its own storage (q8_0: dequantized, rotated, quantized
        again); ``kv`` itself where the positions agree."""
        if dst_pos == src_pos:
            return kv
        shifted = self._rotate(kv.k, np.full(kv.k.shape[1], dst_pos - src_pos))
        return BlockKV(q8_0.quantize(shifted) if self.layout.quantized else shifted.astype(kv.k.dtype), kv.v)

    def make_scorer(self, name: str, heads: Sequence[tuple[int, int]]) -> ThreadedHeadsScorer | None:
        """``retrieval-heads`` scoring on as many threads as a prefill computes with (the model is idle while a
        step selects); None for the other scorers (the core's)."""
        if name != "retrieval-heads" or not heads:
            return None
        return ThreadedHeadsScorer(tuple(heads), self.ctx.threads.batch)

    def content_keys(self, k: np.ndarray, start_pos: int) -> np.ndarray:
        return self._rotate(k, -np.arange(start_pos, start_pos + k.shape[1]))

    def _rotate(self, k: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Stored K [layers, n, kv heads, row] rotated by ``positions`` [n], as float values."""
        m = self.model
        values = q8_0.dequantize(k) if self.layout.quantized else k
        return rotate(values, positions, n_rot=m.rope_dims, base=m.rope_base, style=m.rope_type, factors=m.rope_factors)

    def drop(self, p0: int, p1: int) -> None:
        self.ctx.seq_rm(LlamaContext.VIEW, p0, p1)
        hi = p1 if p1 >= 0 else (1 << 62)
        self._view = {p for p in self._view if not p0 <= p < hi}

    def clear_view(self) -> None:
        self.ctx.clear()
        self._view.clear()

    def close(self) -> None:
        for ctx in self._contexts():
            ctx.close()
        self.model.close()

    def _contexts(self) -> list[LlamaContext]:
        return [self.ctx] if self._capture_ctx is None else [self.ctx, self._capture_ctx]


def _copy_view(src: LlamaContext, dst: LlamaContext) -> None:
    """Make ``dst``'s view the same cells as ``src``'s (the blob restores bit for bit). With any eval callback set,
    llama.cpp's scheduler computes each split as a graph view and synchronizes after it, which costs a small
    model ~10% of its GPU decode speed; the capture context keeps that off the view's own context."""
    state = src.get_state(LlamaContext.VIEW)
    dst.set_state(LlamaContext.VIEW, np.frombuffer(state, dtype=np.uint8), len(state))


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)
