"""Stored Responses: kept across a restart in their SQLite file, bounded, deletable over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

from kvmem.server.state import STATE, ResponseStore
from serving import AppClient


def response(i: int) -> dict:
    return {"id": f"resp_{i}", "object": "response", "output_text": f"answer {i}"}


def test_a_reopened_file_still_chains_and_the_oldest_go_past_capacity(tmp_path: Path) -> None:
    path = tmp_path / "nvme" / "responses.sqlite3"
    store = ResponseStore(path, capacity=3)
    for i in range(5):
        store.put(f"resp_{i}", response(i), [{"role": "user", "content": f"q{i}"}])
    store.db.close()
    again = ResponseStore(path, capacity=3)
    assert [again.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert again.get("resp_4") == {"response": response(4), "transcript": [{"role": "user", "content": "q4"}]}
    assert again.delete("resp_4") and not again.delete("resp_4") and again.get("resp_4") is None


def test_an_unreadable_file_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(b"not a database" * 100)
    store = ResponseStore(path)
    store.put("resp_1", response(1), [])
    assert store.get("resp_1")["response"] == response(1)
    assert path.with_suffix(".corrupt").read_bytes().startswith(b"not a database")


def test_get_and_delete_routes() -> None:
    app = AppClient()
    try:
        app.server.app[STATE].responses.put("resp_1", response(1), [])
        status, _, body = app.request("GET", "/v1/responses/resp_1")
        assert status == 200 and json.loads(body) == response(1)
        status, _, body = app.request("DELETE", "/v1/responses/resp_1")
        assert status == 200 and json.loads(body) == {"id": "resp_1", "object": "response", "deleted": True}
        status, _, body = app.request("DELETE", "/v1/responses/resp_1")
        assert status == 404 and json.loads(body)["error"]["code"] == "response_not_found"
    finally:
        app.close()
