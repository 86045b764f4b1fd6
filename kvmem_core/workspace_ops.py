"""The workspace calls of ``KVMemEngine``: list, inspect, delete, pin, export and import.

A mixin over the engine's state (its store, adapter, view, retrieval indexes and recurrent
checkpoints; ``_abandon`` empties its view), so the step and these calls share one state
while each file keeps to its job. Export writes the portable file of ``kvmem_core.portable``;
import checks it, recomputes each block's scoring summaries with this engine's retrieval
heads, and adds the workspace all or nothing.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvmem_core.adapter import EngineAdapter
from kvmem_core.checkpoints import Checkpoints
from kvmem_core.config import KVMemConfig
from kvmem_core.errors import CorruptBlockError, WorkspaceExistsError, WorkspaceFileError
from kvmem_core.layout import BlockKV, BlockLayout
from kvmem_core.portable import WorkspaceReader, write_workspace
from kvmem_core.retrieval import BlockIndex, StoredSpans, SummaryOptions, summarize_block
from kvmem_core.step import ViewState
from kvmem_core.store import BlockStore
from kvmem_core.workspace import Workspace

PREVIEW_TOKENS = 24  # tokens of a block's text shown by workspace_info
WORKSPACE_ID = re.compile(r"ws-[0-9a-f]{16}")  # the ids KVMem makes; also safe as file names


class WorkspaceOps:
    """The Engine contract's workspace calls; mixed into ``KVMemEngine`` (see the module docstring)."""

    adapter: EngineAdapter
    config: KVMemConfig
    layout: BlockLayout
    model_id: str
    namespace: str
    store: BlockStore
    view: ViewState
    heads: tuple[tuple[int, int], ...]
    summary_opts: SummaryOptions
    checkpoints: Checkpoints | None
    _indexes: dict[str, BlockIndex]
    _stored_spans: dict[str, StoredSpans]
    _view_ws: str | None
    _abandon: Callable[[], None]

    def list_workspaces(self) -> list[dict[str, Any]]:
        return self.store.list_workspaces()

    def workspace_info(self, workspace_id: str) -> dict[str, Any] | None:
        """The store's view of a workspace plus the budget, the reserve, each block's first
        words and which blocks sit in the engine's view right now (tier ``gpu``)."""
        info = self.store.workspace_info(workspace_id)
        if info is None:
            return None
        resident = set(self.view.blocks) if workspace_id == self._view_ws else set()
        for block in info["blocks"]:
            meta = self.store.lookup(block["hash"])
            block["text"] = (
                self.adapter.detokenize(meta.token_ids[:PREVIEW_TOKENS].tolist()) if meta is not None else ""
            )
            block["tiers"] = (["gpu"] if block["index"] in resident else []) + block["tier"].split("+")
        info["totals"]["tokens_in_view"] = len(resident) * self.layout.block_tokens
        info.update(budget=self.config.budget, gen_budget=self.config.gen_budget, block_tokens=self.layout.block_tokens)
        return info

    def delete_workspace(self, workspace_id: str) -> bool:
        self._forget(workspace_id)
        if workspace_id == self._view_ws:
            self._abandon()
        return self.store.delete_workspace(workspace_id)

    def pin_workspace(self, workspace_id: str, pinned: bool) -> dict[str, Any] | None:
        """Pin (retention never evicts it) or unpin a workspace; its summary, None if unknown."""
        return self._summary(workspace_id) if self.store.set_pinned(workspace_id, pinned) else None

    def export_workspace(self, workspace_id: str, path: str) -> dict[str, Any] | None:
        """Write a workspace to ``path`` as one portable file; its summary, None if unknown. A block lost from
        the store meanwhile is a ``CorruptBlockError`` (the next step that sends the conversation recomputes it)."""
        ws = self.store.workspaces.get(workspace_id)
        if ws is None:
            return None
        fields = {
            "id": ws.id,
            "key": ws.key,
            "pinned": ws.pinned,
            "created": ws.created,
            "last_used": ws.last_used,
            "last_selection": ws.last_selection,
        }
        header = {
            "model_id": self.model_id,
            "namespace": self.namespace,
            "layout": dataclasses.asdict(self.layout),
            "workspace": fields,
        }
        write_workspace(
            Path(path), header, self.store.workspace_blocks(ws.id), lambda m: self.stored_kv(m.chain_hash), self.layout
        )
        return self._summary(ws.id)

    def import_workspace(self, path: str) -> dict[str, Any]:
        """Add the workspace a file exported (see ``kvmem_core.portable``); its summary. Refused, with nothing
        changed: another model's file (``ModelMismatchError``), a damaged one (``WorkspaceFileError``), an id
        already here (``WorkspaceExistsError``), no room (``CapacityError``)."""
        with WorkspaceReader(Path(path), self.layout, self.namespace) as reader:
            ws = self._imported(reader.header["workspace"])
            if self.store.workspaces.get(ws.id):
                raise WorkspaceExistsError(f"workspace {ws.id} is already here; delete it to import again")
            blocks = (
                (dataclasses.replace(m, summary=self._summarize(kv, m.start_pos)), kv) for m, kv in reader.blocks()
            )
            self.store.add_workspace(ws, blocks)
        return self._summary(ws.id)

    def stored_kv(self, block_hash: str) -> BlockKV:
        """A stored block's KV, from whichever tier holds it; ``CorruptBlockError`` when it is lost."""
        result = self.store.complete_load(self.store.prepare_load([block_hash]))
        if block_hash not in result.blocks:
            raise CorruptBlockError(f"block {block_hash} failed its checks or is gone from the store")
        return result.blocks[block_hash]

    def _summarize(self, kv: BlockKV, start_pos: int) -> dict[str, np.ndarray]:
        """A block's scoring summaries for this engine's retrieval heads."""
        return summarize_block(self.adapter.content_keys(kv.k, start_pos), self.heads, self.summary_opts)

    def _imported(self, fields: dict[str, Any]) -> Workspace:
        ws_id, key, selection = fields.get("id"), fields.get("key"), fields.get("last_selection", {})
        created, last_used = fields.get("created"), fields.get("last_used")
        if not (
            isinstance(ws_id, str)
            and WORKSPACE_ID.fullmatch(ws_id)
            and (key is None or isinstance(key, str))
            and isinstance(selection, dict)
            and isinstance(created, (int, float))
            and isinstance(last_used, (int, float))
        ):
            raise WorkspaceFileError("the workspace file's workspace fields are malformed")
        return Workspace(
            ws_id, self.namespace, [], float(created), float(last_used), selection, key, fields.get("pinned") is True
        )

    def _summary(self, workspace_id: str) -> dict[str, Any]:
        return next(w for w in self.store.list_workspaces() if w["id"] == workspace_id)

    def _forget(self, *ws_ids: str) -> None:
        """Drop the engine-side state (retrieval index, checkpoints) of workspaces gone from the store."""
        for ws_id in ws_ids:
            self._indexes.pop(ws_id, None)
            self._stored_spans.pop(ws_id, None)
            if self.checkpoints is not None:
                self.checkpoints.forget(ws_id)
