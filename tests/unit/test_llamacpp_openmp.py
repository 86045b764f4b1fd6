"""The spin setting of llama.cpp's OpenMP threads: which variables the engine adds, and when it says it is too late."""

from __future__ import annotations

import logging

import pytest

from kvmem_llamacpp import openmp


@pytest.mark.parametrize(
    ("env", "added"),
    [
        ({}, {"GOMP_SPINCOUNT": "300"}),
        ({"GOMP_SPINCOUNT": ""}, {"GOMP_SPINCOUNT": "300"}),  # set but empty counts as unset, as libgomp reads it
        ({"GOMP_SPINCOUNT": "300000"}, {}),
        ({"OMP_WAIT_POLICY": "active"}, {}),
        ({"OMP_WAIT_POLICY": "passive", "KVMEM_THREADS": "2"}, {}),
    ],
)
def test_a_short_spin_unless_the_user_chose_one(env: dict[str, str], added: dict[str, str]) -> None:
    assert openmp.spin_settings(env) == added


def test_the_setting_goes_into_the_environment_and_a_late_one_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    env: dict[str, str] = {"OTHER": "1"}
    monkeypatch.setattr(openmp, "openmp_loaded", lambda: False)
    with caplog.at_level(logging.WARNING, logger="kvmem.llamacpp"):
        openmp.set_spin_default(env)
    assert env == {"OTHER": "1", "GOMP_SPINCOUNT": "300"} and not caplog.records
    monkeypatch.setattr(openmp, "openmp_loaded", lambda: True)
    with caplog.at_level(logging.WARNING, logger="kvmem.llamacpp"):
        openmp.set_spin_default({})
        openmp.set_spin_default({"GOMP_SPINCOUNT": "7"})  # the user's own: nothing to warn about
    assert len(caplog.records) == 1 and "GOMP_SPINCOUNT=300" in caplog.records[0].getMessage()


def test_openmp_loaded_reads_the_process_maps(tmp_path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not openmp.openmp_loaded(str(maps))
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libgomp.so.1\n")
    assert openmp.openmp_loaded(str(maps))
    assert not openmp.openmp_loaded(str(tmp_path / "missing"))
