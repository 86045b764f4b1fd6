"""A llama.cpp model and context built with llama-cpp-python's low-level API.

The high-level ``Llama`` class hides ``n_seq_max`` and ``kv_unified``, which block
assembly through a scratch sequence needs, so the context is built here directly.
Flash attention is set explicitly: a state blob saved with one setting does not restore
with the other (V is transposed without it). With layers offloaded the KV cache lives on
the device too (``offload_kqv``); state blobs still arrive in host buffers, since
llama.cpp reads and writes them through ``ggml_backend_tensor_get/set``.

A quantized cache (q8_0) is made with llama.cpp's attention rotation off (``unrotated_kv``): with it on, llama.cpp
stores Hadamard-rotated K and V, which the scorers' content keys and compact mode's re-rotation would misread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path
from typing import Iterator, Sequence

import llama_cpp as L
import numpy as np

from kvmem_core.errors import ModelNotFoundError, UnsupportedModelError
from kvmem_core.gguf_file import GGUFFile, gguf_rope_factors
from kvmem_core.threads import Threads
from kvmem_llamacpp.blob import GGML_TYPE_F16, GGML_TYPE_F32, blob_size, dims, parse, synthesize, tiled
from kvmem_llamacpp.gate import EvalGate

_ROPE_MULTI = {8, 24, 40}  # M-RoPE, vision, interleaved M-RoPE: cells carry extra position data
_backend_ready = False
_ROT_DISABLE = "LLAMA_ATTN_ROT_DISABLE"

# llama_decode's return codes (llama.h)
_DECODE_ERRORS = {
    1: "no free cells in the view for the batch",
    -1: "invalid batch: its first position must follow the last one the view holds",
}


@contextlib.contextmanager
def unrotated_kv(quantized: bool) -> Iterator[None]:
    """Contexts made inside store a quantized cache's K and V as computed: llama.cpp otherwise multiplies each head's
    Q, K and V by a Hadamard matrix when the cache type is quantized (read from ``LLAMA_ATTN_ROT_DISABLE`` as a
    context is made), which keeps attention the same but leaves stored keys in a frame RoPE and the scorers do not
    know. The variable is put back afterwards."""
    if not quantized:
        yield
        return
    before = os.environ.get(_ROT_DISABLE)
    os.environ[_ROT_DISABLE] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_ROT_DISABLE]
        else:
            os.environ[_ROT_DISABLE] = before


def init_backend() -> None:
    """Quiet llama.cpp's log and initialize its backends once per process."""
    global _backend_ready
    if not _backend_ready:
        L.llama_log_set(_QUIET, None)
        L.llama_backend_init()
        _backend_ready = True


@L.llama_log_callback
def _QUIET(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    return None


def check_gguf(path: Path) -> None:
    """Raise ModelNotFoundError / UnsupportedModelError before llama.cpp sees a bad file."""
    if path.is_dir():
        raise UnsupportedModelError(
            f"{path} is a model directory; llama.cpp needs a GGUF file (or use --backend torch)"
        )
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise UnsupportedModelError(f"{path} is not a GGUF file")


def rope_factors(path: Path, n_rot: int) -> np.ndarray | None:
    """Per-frequency RoPE divisors llama.cpp applies to this file (``rope_freqs`` tensor, linear scaling),
    or None: the numpy rotations of blocks must match the cache's."""
    f = GGUFFile(path)
    try:
        freqs = f.tensor("rope_freqs.weight").tolist() if "rope_freqs.weight" in f.tensors else None
        factors = gguf_rope_factors(f.meta, f.meta["general.architecture"], n_rot, freqs)
    finally:
        f.close()
    return np.asarray(factors, dtype=np.float64) if factors else None


class LlamaModel:
    """Loaded weights plus vocabulary and metadata."""

    def __init__(self, path: Path, *, vocab_only: bool = False, n_gpu_layers: int = 0) -> None:
        """``n_gpu_layers``: layers whose weights go to the GPU (-1: all, with the output layer)."""
        check_gguf(path)
        init_backend()
        if not vocab_only:  # metadata first: refuse unsupported architectures before reading weights
            LlamaModel(path, vocab_only=True).close()
        params = L.llama_model_default_params()
        params.vocab_only = vocab_only
        params.n_gpu_layers = n_gpu_layers
        self.path, self.n_gpu_layers = path, n_gpu_layers
        self.ptr = L.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise UnsupportedModelError(
                f"llama.cpp could not load {path.name} (unknown architecture or a damaged file)"
            )
        self._refuse(self._arch_problem())
        if vocab_only:
            return
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_layer = L.llama_model_n_layer(self.ptr)
        self.n_head = L.llama_model_n_head(self.ptr)
        self.n_head_kv = L.llama_model_n_head_kv(self.ptr)
        self.n_embd = L.llama_model_n_embd(self.ptr)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.ptr)
        self.rope_type = L.llama_model_rope_type(self.ptr)
        self.head_dim = int(self.meta("attention.key_length", self.n_embd // self.n_head))
        self.rope_dims = int(self.meta("rope.dimension_count", self.head_dim))
        self.rope_base = float(self.meta("rope.freq_base", 10000.0))
        self.rope_factors = rope_factors(path, self.rope_dims)
        self._refuse("sliding-window attention models" if L.llama_model_n_swa(self.ptr) > 0 else None)

    def meta(self, key: str, default: object = None) -> str | object:
        """Metadata value as text; ``key`` without the ``<arch>.`` prefix is looked up under the architecture."""
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        buf = ctypes.create_string_buffer(1 << 17)
        n = L.llama_model_meta_val_str(self.ptr, full.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else default

    @property
    def arch(self) -> str:
        buf = ctypes.create_string_buffer(256)
        L.llama_model_meta_val_str(self.ptr, b"general.architecture", buf, len(buf))
        return buf.value.decode()

    def _arch_problem(self) -> str | None:
        """What makes the architecture unsupported (known from metadata alone), or None."""
        rope = L.llama_model_rope_type(self.ptr)
        if L.llama_model_is_recurrent(self.ptr) or L.llama_model_is_hybrid(self.ptr):
            return "recurrent/hybrid models"
        if rope in _ROPE_MULTI:
            return "multi-axis RoPE models"
        if L.llama_model_has_encoder(self.ptr):
            return "encoder-decoder models"
        if rope not in (0, 2):
            return "models without RoPE"
        return None

    def _refuse(self, why: str | None) -> None:
        if why:
            arch = self.arch
            self.close()
            raise UnsupportedModelError(f"{self.path.name} ({arch}): {why} are not supported by this adapter yet")

    def close(self) -> None:
        if self.ptr:
            L.llama_model_free(self.ptr)
            self.ptr = None


class LlamaContext:
    """One context over a model: sequence 0 is the view, sequence 1 the scratch for blob assembly."""

    VIEW, SCRATCH = 0, 1

    def __init__(
        self,
        model: LlamaModel,
        n_ctx: int,
        threads: Threads,
        *,
        n_batch: int = 512,
        flash_attn: bool = True,
        cache_type: int = GGML_TYPE_F16,
        gate: EvalGate | None = None,
    ) -> None:
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_batch, 2
        p.n_threads, p.n_threads_batch = threads.decode, threads.batch
        p.kv_unified = True
        p.offload_kqv = True  # the KV cache sits beside the offloaded layers
        p.op_offload = model.n_gpu_layers != 0  # else a GPU build still sends large CPU batches to the GPU
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = cache_type  # a ggml type: f16, f32 or q8_0 (which needs flash attention for V)
        p.no_perf = True
        if gate is not None:
            p.cb_eval, p.cb_eval_user_data = gate.callback, gate.user_data
        self.model, self.n_batch, self.threads = model, n_batch, threads
        self.gate = gate  # the eval callback's front, None without one
        with unrotated_kv(cache_type not in (GGML_TYPE_F16, GGML_TYPE_F32)):
            self.ptr = L.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise UnsupportedModelError("llama.cpp could not create a context for this model")
        self.n_ctx = L.llama_n_ctx(self.ptr)
        self.n_batch = L.llama_n_batch(self.ptr)  # llama.cpp caps it at the n_ctx asked for (before padding n_ctx up)
        self.mem = L.llama_get_memory(self.ptr)
        self._batch = L.llama_batch_init(n_batch, 0, 1)
        self._logits_type = ctypes.c_float * model.n_vocab
        self._state = np.empty(0, dtype=np.uint8)

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq: int, want_logits: bool, every_logit: bool = False
    ) -> None:
        """One ``llama_decode`` of at most ``n_batch`` tokens; logits for the last when asked, for every token with
        ``every_logit``."""
        n = len(tokens)
        assert 0 < n <= self.n_batch
        b = self._batch
        b.n_tokens = n
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = int(every_logit)
        b.logits[n - 1] = int(want_logits or every_logit)
        rc = L.llama_decode(self.ptr, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed (rc={rc}: {_DECODE_ERRORS.get(rc, 'compute error')})")

    def set_threads(self, threads: Threads) -> None:
        """Compute with other thread counts from the next ``decode`` on."""
        L.llama_set_n_threads(self.ptr, threads.decode, threads.batch)
        self.threads = threads

    def last_logits(self) -> np.ndarray:
        """The last decoded token's logits, float32 [vocab]: a view of llama.cpp's output buffer (not to be written),
        valid until this context's next ``decode`` (a copy would cost a large vocabulary ~2% of a GPU decode step).
        The view stays writeable: numpy copies a read-only array before ``argmax``."""
        ptr = L.llama_get_logits_ith(self.ptr, -1)
        return np.frombuffer(self._logits_type.from_address(ctypes.addressof(ptr.contents)), dtype=np.float32)

    def all_logits(self, n: int) -> np.ndarray:
        """The logits of the ``n`` tokens of the last ``decode`` with ``every_logit``, float32 [n, vocab]: a view of
        llama.cpp's output buffer, as ``last_logits`` is."""
        ptr = L.llama_get_logits(self.ptr)
        rows = (ctypes.c_float * (n * self.model.n_vocab)).from_address(ctypes.addressof(ptr.contents))
        return np.frombuffer(rows, dtype=np.float32).reshape(n, self.model.n_vocab)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        L.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def clear(self) -> None:
        L.llama_memory_clear(self.mem, True)

    def get_state(self, seq: int) -> memoryview:
        """The sequence's state blob, in a buffer reused across calls (valid until the next call)."""
        state, self._state = read_state(self.ptr, seq, self._state)
        return state

    def set_state(self, seq: int, blob: np.ndarray, n_bytes: int) -> None:
        """Replace ``seq`` with the first ``n_bytes`` of ``blob`` (``write_state``)."""
        write_state(self.ptr, seq, blob, n_bytes)

    def close(self) -> None:
        if self.ptr:
            L.llama_batch_free(self._batch)
            L.llama_free(self.ptr)
            self.ptr = None


def read_state(ctx: ctypes.c_void_p, seq: int, buffer: np.ndarray) -> tuple[memoryview, np.ndarray]:
    """Sequence ``seq``'s state blob of the llama.cpp context ``ctx``, read into ``buffer`` or, where that is too
    small, a larger one. -> (the blob, the buffer now holding it)"""
    size = L.llama_state_seq_get_size(ctx, seq)
    if buffer.size < size:
        buffer = np.empty(max(size, 2 * buffer.size), dtype=np.uint8)
    n = L.llama_state_seq_get_data(ctx, buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq)
    assert n == size, (n, size)
    return memoryview(buffer)[:n], buffer


def write_state(ctx: ctypes.c_void_p, seq: int, blob: np.ndarray, n_bytes: int) -> None:
    """Replace ``seq`` with the first ``n_bytes`` of ``blob``, an empty sequence's blob included (llama.cpp
    restores that by leaving the sequence's cells in place, hence the removal first)."""
    L.llama_memory_seq_rm(L.llama_get_memory(ctx), seq, -1, -1)
    if L.llama_state_seq_set_data(ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n_bytes, seq) != n_bytes:
        raise RuntimeError("llama_state_seq_set_data failed: the view has no room for these blocks")


def fill_sequence(ctx: ctypes.c_void_p, seq: int, n_tokens: int) -> None:
    """``kvmem_llamacpp.fill_sequence``: ``seq`` of ``ctx`` holds ``n_tokens`` cells repeating the ones it holds."""
    state, _ = read_state(ctx, seq, np.empty(0, dtype=np.uint8))
    n_layer, width = dims(state)
    seed, v_trans = parse(state, n_layer, width)
    out = np.empty(blob_size(n_tokens, n_layer, seed.k.shape[2] * seed.k.itemsize), dtype=np.uint8)
    write_state(ctx, seq, out, synthesize(out, seq, tiled(seed, n_tokens), v_trans))
