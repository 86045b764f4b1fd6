"""``kvmem serve`` as a user runs it: dry run, auth, binding, reuse, restart and stop.

The server here runs another retrieval configuration than test_server_openai's, and the
same client script passes against both.
"""

from __future__ import annotations

import socket
import urllib.request
from typing import Iterator

import pytest
from serving import LiveServer, exercise, get_json

pytestmark = pytest.mark.llamacpp
KEY = "test-key-123"
FLAGS = (
    "--api-key",
    KEY,
    "--kvmem-method",
    "recent",
    "--kvmem-retrieval-method",
    "mean-k",
    "--ctx",
    "4096",
    "--kvmem-budget",
    "1024",
    "--kvmem-recent-tokens",
    "256",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("launch"), *FLAGS).start()
    yield live
    live.stop()


def test_dry_run_shows_every_knob_with_its_source(server: LiveServer) -> None:
    done = server.command("--dry-run", "--kvmem-budget", "2048", "--port", "1")
    assert done.returncode == 0, done.stderr
    lines = {ln.split()[0]: ln for ln in done.stdout.splitlines() if ln.startswith("  ")}
    assert lines["budget"].split()[1:] == ["2048", "(flag)"]
    assert lines["positions"].split()[1:] == ["auto", "(default)"]
    assert lines["groups"].split()[1:] == ["on", "(default)"]  # switches read as their flag takes them
    assert lines["nvme_dir"].split()[1:] == ["unset", "(default)"]
    assert "backend   llama.cpp" in done.stdout and "device    cpu" in done.stdout
    env_run = LiveServer(server.run_dir, "--dry-run", env={"KVMEM_RECENT_TOKENS": "384"}).command()
    assert "384" in env_run.stdout and "(env)" in env_run.stdout
    assert get_json(server.url + "/health")[0] == 200  # a dry run on another port touched nothing


def test_the_body_limit_flag_takes_mib_or_auto(server: LiveServer) -> None:
    assert server.command("--dry-run", "--max-body-mb", "auto", "--port", "1").returncode == 0
    done = server.command("--dry-run", "--max-body-mb", "0", "--port", "1")
    assert done.returncode == 2 and "want a positive number of MiB or auto, got '0'" in done.stderr


def test_auth_guards_the_api_but_not_health_or_the_ui(server: LiveServer) -> None:
    assert get_json(server.url + "/health")[0] == 200
    status, body = get_json(server.url + "/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert get_json(server.url + "/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert get_json(server.url + "/v1/models", {"X-Api-Key": KEY})[0] == 200
    with urllib.request.urlopen(server.url + "/", timeout=5) as resp:
        assert resp.status == 200 and b"<html" in resp.read().lower()


def test_the_same_client_script_passes_on_another_configuration(server: LiveServer) -> None:
    seen = exercise(server.url, api_key=KEY)
    assert seen["model"].startswith("SmolLM2")


def test_binds_loopback_only_by_default(server: LiveServer) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            pytest.skip("no non-loopback interface")
        address = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("no non-loopback interface")
    with pytest.raises(OSError):
        socket.create_connection((address, server.port), timeout=2).close()
    socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_same_config_is_reused_and_another_needs_restart(server: LiveServer) -> None:
    pid = server.health()["pid"]
    again = server.command()
    assert again.returncode == 0 and "already up" in again.stdout and f"{server.url}/v1" in again.stdout
    other = server.command("--kvmem-budget", "2048")
    assert other.returncode == 2 and "--restart" in other.stderr
    assert server.health()["pid"] == pid


def test_restart_replaces_the_server_and_stop_stops_it(server: LiveServer) -> None:
    old = server.health()
    replacement = LiveServer(server.run_dir, *FLAGS, "--kvmem-budget", "2048", "--restart", port=server.port)
    try:
        new = replacement.start().health()
        assert new["pid"] != old["pid"] and new["fingerprint"] != old["fingerprint"]
        assert server.proc is not None and server.proc.wait(30) == 0
        stopped = server.command("--stop")
        assert stopped.returncode == 0 and "stopped" in stopped.stdout
        assert replacement.proc is not None and replacement.proc.wait(30) == 0
        assert not (server.run_dir / f"serve-{server.port}.json").exists()
        assert server.command("--stop").returncode == 1
    finally:
        replacement.stop()
