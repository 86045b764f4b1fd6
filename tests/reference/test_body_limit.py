"""``BODY_BYTES_PER_TOKEN`` holds for what agents send, with the default model's tokenizer: a transcript token of code,
prose or Chinese, as a message's content or inside a tool call's arguments (JSON in JSON), JSON-escaped as Python's
``json`` does by default (``ensure_ascii``) or not, takes fewer bytes of request body, so ``--max-body-mb auto``
admits a conversation as long as the workspace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmem.server.app import BODY_BYTES_PER_TOKEN
from kvmem_core.errors import ModelNotFoundError
from kvmem_core.gguf_file import GGUFFile
from kvmem_torch.tokenizer import from_gguf_meta

ROOT = Path(__file__).resolve().parents[2]
CHINESE = (
    "在这个项目中，我们把整个工作区的注意力键值缓存保存为固定大小的块，并根据当前问题选择相关的块放入显存。"
    "测试失败的原因是解析器没有处理空行，我们需要修改第三个函数并重新运行全部测试。"
)


def samples() -> dict[str, str]:
    code = "".join(p.read_text() for p in sorted((ROOT / "kvmem_core").rglob("*.py")))[:200_000]
    prose = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))[:200_000]
    return {"code": code, "prose": prose, "chinese": CHINESE * 200}


def bodies(text: str) -> list[bytes]:
    content = [{"role": "tool", "tool_call_id": "c1", "content": text}]
    call = {"name": "write_file", "arguments": json.dumps({"path": "a.py", "content": text})}
    arguments = [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": call}]}]
    return [json.dumps({"messages": m}, ensure_ascii=a).encode() for m in (content, arguments) for a in (True, False)]


def test_a_transcript_token_takes_fewer_body_bytes_than_the_limit_allows() -> None:
    from kvmem.models import resolve_model

    try:
        f = GGUFFile(resolve_model(None))
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    tokenizer = from_gguf_meta(f.meta)
    f.close()
    worst = {}
    for name, text in samples().items():
        tokens = len(tokenizer.encode(text, special=False))
        worst[name] = max(len(body) for body in bodies(text)) / tokens
    assert max(worst.values()) < BODY_BYTES_PER_TOKEN, worst
    assert worst["chinese"] > 8  # the case the constant is set by: escaped twice it is far from prose's ~3
