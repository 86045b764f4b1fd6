"""``--backend torch`` end to end on the small test model, SmolLM2 GGUF (CPU): ``kvmem run``, ``kvmem serve``,
and the retrieval-heads profile (reused by weights, or calibrated through the torch adapter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from model_support import SMALL_MODEL, small_model

GGUF = small_model()

from serving import ROOT, LiveServer  # noqa: E402

from kvmem.engines import adapter_factory, load_engine  # noqa: E402
from kvmem.profiles import run_calibration  # noqa: E402
from kvmem_core.config import KVMemConfig  # noqa: E402
from kvmem_core.retrieval import RetrievalProfile  # noqa: E402
from kvmem_torch import create_adapter  # noqa: E402

LLAMACPP_PROFILE = ROOT / "adapters" / "kvmem_llamacpp" / "profiles" / "564f5c63cf7aeb3e.json"
CONFIG = KVMemConfig(ctx=4096, budget=1024, gen_budget=256, sink_tokens=128, recent_tokens=256)


def kvmem(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmem", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        timeout=300,
    )


def test_torch_engine_reuses_the_profile_of_the_same_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))  # an empty user cache: only shipped profiles count
    torch.set_num_threads(1)
    engine = load_engine("torch", SMALL_MODEL, CONFIG, device="cpu")
    try:
        assert engine.adapter.caps.backend == "torch"
        assert engine.heads == RetrievalProfile.load(LLAMACPP_PROFILE).heads
        assert not any(tmp_path.rglob("*.json"))  # nothing was calibrated
    finally:
        engine.close()


def test_kvmem_run_and_serve_with_backend_torch(tmp_path: Path) -> None:
    env = {"KVMEM_CACHE_DIR": str(tmp_path / "cache"), "KVMEM_NVME_DIR": str(tmp_path / "nvme")}
    out = kvmem(
        "run",
        "--model",
        SMALL_MODEL,
        "--backend",
        "torch",
        "-p",
        "What is the capital of France?",
        "-n",
        "12",
        "--json",
        env=env,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "Paris" in result["text"] and result["stats"]["prompt_tokens"] > 0
    assert any((tmp_path / "nvme").rglob("*")) and not any((tmp_path / "cache").rglob("*.json"))
    server = LiveServer(
        tmp_path,
        "--no-ui",
        "--backend",
        "torch",
        "--device",
        "cpu",
        "--ctx",
        "4096",
        "--kvmem-budget",
        "1024",
        "--kvmem-recent-tokens",
        "256",
        env=env,
    ).start()
    try:
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(
            model=client.models.list().data[0].id,
            max_tokens=12,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert "Paris" in chat.choices[0].message.content
        assert "(torch on cpu)" in server.log.read_text()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def adapter() -> Iterator[object]:
    torch.set_num_threads(1)
    a = create_adapter(str(GGUF), KVMemConfig(), device="cpu", progress=False)  # the documents need 2K tokens
    yield a
    a.close()


@pytest.mark.slow
def test_calibration_through_the_torch_adapter_finds_llamacpp_heads(adapter: object) -> None:
    """Pre-RoPE q and k straight from the attention layers rank the heads as llama.cpp's blobs do: the reference is
    a calibration through llama.cpp now (the shipped profile came from the scorer of 2026-12-01)."""
    pytest.importorskip("llama_cpp")
    profile = run_calibration(adapter)
    assert profile.fingerprint == adapter.fingerprint
    llamacpp = adapter_factory("llama.cpp")(str(GGUF), KVMemConfig(), n_threads=1, n_threads_batch=1)
    try:
        assert profile.heads == run_calibration(llamacpp).heads
    finally:
        llamacpp.close()
