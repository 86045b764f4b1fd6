"""Typed errors raised at KVMem's boundaries.

Internal invariants use ``assert``; anything a user or client can cause raises a
``KVMemError`` subclass whose message says what to change. The server maps each class to
an HTTP status through ``http_status``.
"""

from __future__ import annotations


class KVMemError(Exception):
    """Base class; ``http_status`` and ``code`` feed the OpenAI error JSON."""

    http_status = 500
    code = "kvmem_error"


class ConfigError(KVMemError, ValueError):
    """A knob is out of range or the knobs contradict each other."""

    http_status = 400
    code = "invalid_config"


class CapacityError(KVMemError):
    """Storage is full under a keep-everything policy; the message names the limit to raise."""

    http_status = 507
    code = "storage_full"


class BudgetError(KVMemError):
    """Mandatory spans (sink, system, recent window, live tail) alone exceed the budget."""

    http_status = 413
    code = "budget_exceeded"


class ContextLengthError(KVMemError):
    """A prompt is longer than the logical workspace (``--ctx``)."""

    http_status = 400
    code = "context_length_exceeded"


class TemplateError(KVMemError):
    """The chat template cannot render this request: a ``chat_template_kwargs`` key it reserves, a value or
    a transcript the template refuses or chokes on."""

    http_status = 400
    code = "template_error"


class GrammarError(KVMemError):
    """A structured-output format (a JSON schema, a strict tool's parameters) that does not compile to a grammar,
    or a server without the grammar library."""

    http_status = 400
    code = "invalid_response_format"


class LimitError(KVMemError):
    """A request asks more than one request may (``kvmem_core.prompt.check_request``): too many messages,
    ``max_tokens`` over ``--ctx``."""

    http_status = 400
    code = "limit_exceeded"


class CorruptBlockError(KVMemError):
    """A stored block failed its checksum, magic or layout check; it is treated as missing."""

    http_status = 500
    code = "corrupt_block"


class BlockDtypeError(CorruptBlockError):
    """A block file holds KV of another dtype than the store's (``float16`` blocks in an ``fp8_e4m3`` store): it is
    refused, never read, and left in place (it belongs to a store of its own dtype)."""


class UnsupportedModelError(KVMemError):
    """The model's architecture or cache type is not handled by this adapter yet."""

    http_status = 400
    code = "unsupported_model"


class ModelNotFoundError(KVMemError):
    """A model path does not exist, or the embedded default model is not installed."""

    http_status = 404
    code = "model_not_found"


class WorkspaceFileError(KVMemError):
    """A workspace file to import is not one, or a block in it fails its checks."""

    http_status = 400
    code = "invalid_workspace_file"


class ModelMismatchError(KVMemError):
    """A workspace file was exported from another model or KV layout than this server runs."""

    http_status = 409
    code = "model_mismatch"


class WorkspaceExistsError(KVMemError):
    """An imported workspace's id, or its routing key, already names a workspace here."""

    http_status = 409
    code = "workspace_exists"
