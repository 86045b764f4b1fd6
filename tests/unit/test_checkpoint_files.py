"""Recurrent checkpoints on disk: exact round trips, reopening, capacity, forgetting, damaged files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvmem_core.checkpoint_files import CheckpointFiles


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"conv": rng.standard_normal((3, 8, 3), dtype=np.float32), "rec": rng.standard_normal((3, 4, 4, 4))}


def key(i: int) -> bytes:
    return bytes([i]) * 16


def test_round_trip_is_exact_and_survives_reopening(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path, "model-a")
    files.put(key(1), 48, "ws-1", arrays(1))
    got = files.get(key(1))
    assert set(got) == {"conv", "rec"} and all(np.array_equal(got[k], arrays(1)[k]) for k in got)
    files.close()
    again = CheckpointFiles(tmp_path, "model-a")
    assert dict(again.index) == {key(1): (48, "ws-1")}
    assert np.array_equal(again.get(key(1))["rec"], arrays(1)["rec"])
    assert not CheckpointFiles(tmp_path, "model-b").index  # another model's namespace sees nothing
    again.close()


def test_capacity_drops_the_oldest_and_forget_drops_a_workspace(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path, "m", capacity=3)
    for i in range(5):
        files.put(key(i), 16 * i, f"ws-{i % 2}", arrays(i))
    assert list(files.index) == [key(2), key(3), key(4)]
    files.forget("ws-0")
    assert list(files.index) == [key(3)]
    files.close()
    assert sorted(p.stem for p in files.dir.glob("*.npz")) == [key(3).hex()]


def test_damaged_and_partial_files_are_removed(tmp_path: Path) -> None:
    files = CheckpointFiles(tmp_path, "m")
    files.put(key(1), 16, "ws", arrays(1))
    files.put(key(2), 32, "ws", arrays(2))
    files.close()
    path = files.dir / f"{key(1).hex()}.npz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a member: its CRC fails when read
    path.write_bytes(bytes(data))
    (files.dir / "cut.tmp").write_bytes(b"partial")
    reopened = CheckpointFiles(tmp_path, "m")
    assert not list(reopened.dir.glob("*.tmp"))
    assert key(1) in reopened.index  # the zip directory still parses: the damage shows when the arrays load
    assert reopened.get(key(1)) is None
    assert np.array_equal(reopened.get(key(2))["conv"], arrays(2)["conv"])
    reopened.close()  # the removal has run
    assert key(1) not in reopened.index and not path.exists()
