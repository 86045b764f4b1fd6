"""What a turn keeps from the last one to do only its new tokens' work gives the results of doing all of it again:
checkpoint keys (``PrefixKeys``), the registry's prefix match after blocks leave, the view's token array through
truncations, a workspace's selector spans (``StoredSpans``), the selector's group members and the messages a prompt
renders alone (only a turn's new ones are rendered, keyed by all JSON tells apart). A workspace manifest,
whose JSON grows with the workspace, is encoded by the NVMe writer, not by each append on the step's thread."""

from __future__ import annotations

import hashlib
import json
import threading

import numpy as np
import pytest

import kvmem_core.marks as marks_module
import kvmem_core.prompt as prompt_module
import kvmem_core.workspace as workspace_module
from kvmem_core.contract import StepRequest

from kvmem_core.checkpoints import PrefixKeys
from kvmem_core.layout import BlockMeta
from kvmem_core.retrieval import BlockSpans, StoredSpans
from kvmem_core.retrieval.selector import _Members
from kvmem_core.step import ViewState, append_computed, common_prefix
from kvmem_core.store import BlockStore
from test_store import BLOCK, LAYOUT, fill, host_store, nvme_store, tokens


def one_shot(ids: np.ndarray | list[int]) -> bytes:
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


def test_prefix_keys_equal_one_shot_digests_across_growth_forks_and_lists():
    keys, rng = PrefixKeys(), np.random.default_rng(0)
    seq = rng.integers(0, 1000, 5000)
    seq.flags.writeable = False
    for n in (100, 0, 3000, 5000, 1200, 4999):
        assert keys.key(seq, n) == one_shot(seq[:n]) == keys.key(seq[:n])
    fork = seq.copy()
    fork[2000] += 1  # another sequence sharing 2000 tokens
    for n in (4000, 2001, 2000, 1999):
        assert keys.key(fork[:n]) == one_shot(fork[:n])
    assert keys.key(seq) == one_shot(seq)
    assert keys.key(seq[:700].tolist()) == one_shot(seq[:700])
    grown = np.concatenate((seq, rng.integers(0, 1000, 300)))
    before = keys.hashed
    assert keys.key(grown) == one_shot(grown)
    assert keys.hashed - before == 300  # from the state after the whole of ``seq``


def test_prefix_keys_compare_a_prompt_once_for_all_its_prefixes(monkeypatch):
    import kvmem_core.checkpoints as checkpoints

    compared = []
    monkeypatch.setattr(checkpoints, "common_prefix", lambda a, b: compared.append(len(b)) or common_prefix(a, b))
    keys, rng = PrefixKeys(), np.random.default_rng(1)
    seq = rng.integers(0, 1000, 4000)
    seq.flags.writeable = False
    assert keys.key(seq) == one_shot(seq)
    turn = np.concatenate((seq[:3000], rng.integers(0, 1000, 1500)))  # the next prompt: an edit at 3000
    turn.flags.writeable = False
    compared.clear()
    for n in (2500, 3200, 4500, 100):
        assert keys.key(turn[:n]) == one_shot(turn[:n])
    assert keys.key(turn, 3001) == one_shot(turn[:3001])
    assert compared == [2500, 700]  # the first slice, then a longer one past the first's answer from there on
    writable = turn.copy()
    assert keys.key(writable[:50]) == one_shot(turn[:50]) and compared[-1] == 50  # a writable array: compared


def test_a_prefix_match_after_its_blocks_left_checks_them_again():
    store = host_store("keep-all")
    ids = tokens(4)
    ws_id, _ = fill(store, ids)
    assert store.open_workspace("ns", ids)[1].matched_blocks == 4
    store.delete_workspace(ws_id)
    assert store.open_workspace("ns", ids)[1].matched_blocks == 0
    other = ids.copy()
    other[LAYOUT.block_tokens + 3] += 1  # diverges in the second block
    ws_id, _ = fill(store, other)
    assert store.open_workspace("ns", other)[1].matched_blocks == 4
    assert store.open_workspace("ns", ids)[1].matched_blocks == 1
    assert store.open_workspace("other-ns", other)[1].matched_blocks == 0


def test_the_view_token_array_follows_appends_truncations_and_rebinds():
    view = ViewState(4)
    append_computed(view, [5, 6, 7, 8, 9])
    assert view.token_array().tolist() == [5, 6, 7, 8, 9]
    view.keep(3)
    append_computed(view, [1, 2])  # the same length as before, other tokens
    assert view.token_array().tolist() == [5, 6, 7, 1, 2] and not view.token_array().flags.writeable
    view.tokens = [4, 4]
    assert view.token_array().tolist() == [4, 4]
    view.assign([1, 2, 3], np.array([1, 2, 3]))
    append_computed(view, [7])
    assert view.token_array().tolist() == [1, 2, 3, 7] and view.common_prefix([1, 2, 9]) == 2


def meta(i: int, tags: frozenset[str] = frozenset(), n: int = 16) -> BlockMeta:
    return BlockMeta(f"h{i}", f"h{i - 1}", np.zeros(n, np.int32), 0, 0, {}, tags)


@pytest.mark.parametrize("cut", [None, 2])
def test_stored_spans_equal_the_spans_of_every_block_converted_again(cut: int | None):
    tags = [frozenset({"mandatory"}), frozenset({"atomic:b"}), frozenset(), frozenset({"atomic:a"})]
    metas = [meta(i, tags[i % 4], 16 - i % 3) for i in range(10)]
    stored = StoredSpans()
    for end in (3, 6, 10):
        got, want = stored.spans(metas[:end]), BlockSpans.from_metas(metas[:end])
        for name in ("n_tokens", "mandatory", "groups"):
            assert getattr(got, name).tolist() == getattr(want, name).tolist()
    if cut is not None:
        changed = metas[:cut] + [meta(i + 100, tags[i % 4]) for i in range(cut, 10)]
        assert stored.spans(changed).groups.tolist() == BlockSpans.from_metas(changed).groups.tolist()


def test_a_workspace_view_reads_as_the_list_of_its_metas_it_was_taken_at():
    store = BlockStore(LAYOUT, cpu_bytes=16 * BLOCK)
    ws_id, _ = fill(store, tokens(6))
    listed, view = store.workspace_blocks(ws_id), store.workspace_view(ws_id)
    extra = [meta(100), meta(101)]
    both, whole = view.plus(extra), listed + extra
    assert len(view) == 6 and list(view) == listed and len(both) == 8 and list(both) == whole
    for i in (0, 5, 6, 7, -1, -8):
        assert both[i] is whole[i]
    for cut in (slice(None), slice(4, None), slice(5, 7), slice(-3, None), slice(None, None, 2), slice(9, 12)):
        assert both[cut] == whole[cut]
    with pytest.raises(IndexError):
        both[8]
    with pytest.raises(IndexError):
        both[-9]
    fill(store, tokens(8))  # the workspace grows: the view stays what it was taken at
    assert list(view) == listed


def test_group_members_list_each_groups_blocks_in_order():
    labels = np.array([-1, 2, 0, 2, -1, 0, 5, 2])
    members = _Members(labels)
    assert (members[0], members[2], members[5], members[3]) == ([2, 5], [1, 3, 7], [6], [])


def test_manifests_are_encoded_off_the_appending_thread_and_restart_whole(tmp_path, monkeypatch: pytest.MonkeyPatch):
    threads: list[str] = []

    def dumps(obj: object) -> str:
        threads.append(threading.current_thread().name)
        return json.dumps(obj)

    monkeypatch.setattr(workspace_module, "json", type("Json", (), {"dumps": staticmethod(dumps)}))
    store = nvme_store(tmp_path, cpu_blocks=16)
    ws_id, _ = fill(store, tokens(12))
    store.set_selection(ws_id, {"blocks": [1]})
    store.close()
    assert threads and threading.main_thread().name not in threads
    again = nvme_store(tmp_path, cpu_blocks=16)
    assert again.workspace_info(ws_id)["totals"]["blocks"] == 12
    assert again.workspace_info(ws_id)["last_selection"] == {"blocks": [1]}


class Chat:
    """A chat template and a character tokenizer that count their renders."""

    def __init__(self) -> None:
        self.renders = 0

    def render_chat(self, messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
        self.renders += 1
        return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + ("<a>" if add_generation_prompt else "")

    def token_array(self, text: str) -> np.ndarray:
        return np.array([ord(c) for c in text], dtype=np.int64)

    def token_bytes(self, token: int) -> bytes:
        return chr(token).encode()


def test_a_prompt_renders_alone_only_its_new_messages_and_marks_them_as_before():
    chat, messages, spent = Chat(), [{"role": "system", "content": "sys"}], []
    for turn in range(40):
        messages += [{"role": "user", "content": f"result {turn}"}, {"role": "assistant", "content": f"ok {turn}"}]
        before = chat.renders
        prompt = prompt_module.build_prompt(chat, StepRequest(messages=tuple(messages)))
        spent.append(chat.renders - before)
        marks_module._lone_renders.pop(chat)
        marks_module._marked.pop(chat)  # from scratch: nothing carried over from the last turn
        again = prompt_module.build_prompt(chat, StepRequest(messages=tuple(messages)))
        assert (prompt.messages, prompt.groups, prompt.mandatory) == (again.messages, again.groups, again.mandatory)
    assert spent[0] == 1 + 3 and spent[-1] == 1 + 2  # the whole transcript once, then each new message alone


def test_a_message_renders_alone_again_when_anything_json_tells_apart_changes():
    chat = Chat()
    chat.render_chat = lambda messages, **kw: "".join(f"<{m['role']}>{json.dumps(m['content'])}</>" for m in messages)
    request = StepRequest(messages=({"role": "user", "content": "x"},))
    render = prompt_module._renderer(chat, request)
    lone = marks_module.lone_renderer(chat, marks_module.setting(request), render)
    variants = [1, 1.0, True, "1", [1], {"a": 1}, {"a": 1.0}, [[1]], None]
    texts = [lone({"role": "user", "content": v}) for v in variants]
    assert texts == [render([{"role": "user", "content": v}], False) for v in variants]
    assert len(set(texts)) == len(variants)  # no two share a cached rendering
    marks_module._lone_renders.pop(chat)
