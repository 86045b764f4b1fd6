from __future__ import annotations

import pytest

from kvmem_core import BlockLayout, ConfigError, KVMemConfig
from kvmem_core.config import AUTO_CTX, AUTO_GB, parse_retrieval_heads
from kvmem_core.machine_memory import usable_memory_bytes

SMOL = BlockLayout(n_layers=30, n_kv_heads=3, head_dim=64, n_heads=9)


QWEN_05B = BlockLayout(n_layers=24, n_kv_heads=2, head_dim=64, n_heads=14, block_tokens=64)


def test_defaults_are_valid_and_fit_the_default_model():
    cfg = KVMemConfig().sized_to(SMOL)
    cfg.validate_capacity(SMOL)
    cfg.validate_view(8192)
    assert cfg.view_tokens == cfg.budget + cfg.gen_budget


def test_an_auto_workspace_is_what_the_storage_tier_holds_in_whole_blocks(tmp_path):
    assert KVMemConfig().describe()["ctx"] == "auto"
    host = KVMemConfig(cpu_gb=4.0).sized_to(QWEN_05B)  # 12 KiB a token: 4 GiB hold 349,525 tokens, 5,461 blocks
    assert host.ctx == 5461 * 64 and host.ctx * QWEN_05B.bytes_per_token <= 4 << 30
    disk = KVMemConfig(nvme_dir=tmp_path).sized_to(QWEN_05B)  # the disk tier bounds the store when there is one
    assert disk.ctx == (32 << 30) // QWEN_05B.kv_bytes_per_block * 64
    assert KVMemConfig(ctx=4096).sized_to(QWEN_05B).ctx == 4096  # a set workspace stays as set
    with pytest.raises(ConfigError, match="needs"):
        KVMemConfig(ctx=1_000_000, cpu_gb=4.0).sized_to(QWEN_05B)
    with pytest.raises(ConfigError, match="holds no block"):
        KVMemConfig(cpu_gb=1e-6).sized_to(QWEN_05B)


def test_aliases_map_to_canonical_names():
    cfg = KVMemConfig(method="recency", scorer="key-direction-fixed4")
    assert (cfg.method, cfg.scorer) == ("recent", "key-direction")


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"method": "magic"}, "--kvmem-method"),
        ({"budget": 0}, "--kvmem-budget"),
        ({"budget": 256, "recent_tokens": 512}, "must hold sink"),
        ({"block_tokens": 4}, "block-tokens"),
    ],
)
def test_bad_knobs_name_the_flag(changes, words):
    with pytest.raises(ConfigError, match=words):
        KVMemConfig(**changes)


def test_view_must_hold_budget_and_reserve():
    with pytest.raises(ConfigError, match="do not fit"):
        KVMemConfig(budget=8192, gen_budget=512).validate_view(8192)


def test_capacity_message_says_how_much_is_needed():
    cfg = KVMemConfig(ctx=1_000_000, cpu_gb=1.0)
    with pytest.raises(ConfigError, match=r"needs 21\.46 GiB.*--kvmem-cpu-gb"):
        cfg.validate_capacity(SMOL)


def test_nvme_capacity_is_checked_when_a_directory_is_set(tmp_path):
    cfg = KVMemConfig(ctx=1_000_000, cpu_gb=1.0, nvme_dir=tmp_path, nvme_gb=64.0)
    cfg.validate_capacity(SMOL)


def test_parse_retrieval_heads():
    assert parse_retrieval_heads("3:1, 20:7") == ((3, 1), (20, 7))
    with pytest.raises(ConfigError):
        parse_retrieval_heads("3-1")


def test_groups_switch_reads_on_or_off_from_flag_or_env(monkeypatch):
    import argparse

    from kvmem.flags import add_kvmem_flags, resolve_config

    parser = argparse.ArgumentParser()
    add_kvmem_flags(parser)
    assert "(default: on; env KVMEM_GROUPS)" in " ".join(parser.format_help().split())
    assert resolve_config(parser.parse_args([]))[0].groups is True
    cfg, sources = resolve_config(parser.parse_args(["--kvmem-groups", "off"]))
    assert cfg == KVMemConfig(groups=False) and sources["groups"] == "flag"
    monkeypatch.setenv("KVMEM_GROUPS", "off")
    assert resolve_config(parser.parse_args([]))[0].groups is False
    monkeypatch.setenv("KVMEM_GROUPS", "maybe")
    with pytest.raises(ConfigError, match="KVMEM_GROUPS='maybe': choose from on, off"):
        resolve_config(parser.parse_args([]))
    with pytest.raises(ConfigError, match="--kvmem-groups must be on or off"):
        KVMemConfig(groups="off")


@pytest.mark.parametrize(
    "flag, env, field, auto, good, bad, message",
    [
        ("--ctx", "KVMEM_CTX", "ctx", AUTO_CTX, ("131072", 131072), ("0", "-4", "128k"), "token count"),
        (
            "--kvmem-cpu-gb",
            "KVMEM_CPU_GB",
            "cpu_gb",
            AUTO_GB,
            ("2.5", 2.5),
            ("0", "-1", "4G", "nan", "inf"),
            "number of GiB",
        ),
    ],
)
def test_auto_knobs_read_auto_or_a_positive_value_from_flag_or_env(
    monkeypatch, flag, env, field, auto, good, bad, message
):
    import argparse

    from kvmem.flags import add_kvmem_flags, resolve_config

    parser = argparse.ArgumentParser()
    add_kvmem_flags(parser)
    assert f"(default: auto; env {env})" in " ".join(parser.format_help().split())
    assert getattr(resolve_config(parser.parse_args([flag, "auto"]))[0], field) == auto
    assert getattr(resolve_config(parser.parse_args([flag, good[0]]))[0], field) == good[1]
    for text in bad:
        monkeypatch.setenv(env, text)
        with pytest.raises(ConfigError, match=f"want a positive {message} or auto"):
            resolve_config(parser.parse_args([]))


def _mem_total() -> int:
    """The machine's RAM as the kernel reports it, read independently of ``usable_memory_bytes``."""
    with open("/proc/meminfo") as f:
        line = next(line for line in f if line.startswith("MemTotal:"))
    return int(line.split()[1]) * 1024


def test_usable_memory_is_the_machine_s_unless_a_cgroup_limits_it(tmp_path):
    proc = tmp_path / "proc-self-cgroup"  # absent: only the root's limit files are read
    assert usable_memory_bytes(tmp_path, proc) == _mem_total()  # no limit files: the machine's RAM
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    assert usable_memory_bytes(tmp_path, proc) == _mem_total()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("2147483648\n")  # cgroup v1: 2 GiB
    assert usable_memory_bytes(tmp_path, proc) == 2 << 30
    (tmp_path / "memory.max").write_text("1073741824\n")  # v2: 1 GiB, the lower one counts
    assert usable_memory_bytes(tmp_path, proc) == 1 << 30


@pytest.mark.parametrize(
    "line, limits",
    [
        ("0::/system.slice/kvmem.service", "system.slice/memory.max"),  # v2: a parent's limit binds its children
        ("0::/system.slice/kvmem.service", "system.slice/kvmem.service/memory.max"),
        ("7:cpu,memory:/docker/abc", "memory/docker/abc/memory.limit_in_bytes"),  # v1: the memory hierarchy's path
    ],
)
def test_the_process_s_own_cgroup_and_its_ancestors_limit_it(tmp_path, line, limits):
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"3:cpuset:/elsewhere\nnot a cgroup line\n{line}\n")
    assert usable_memory_bytes(tmp_path, proc) == _mem_total()  # the files are not there yet
    (tmp_path / limits).parent.mkdir(parents=True)
    (tmp_path / limits).write_text("3221225472\n")
    assert usable_memory_bytes(tmp_path, proc) == 3 << 30
    (tmp_path / "cpuset" / "elsewhere").mkdir(parents=True)  # another controller's hierarchy is not read
    (tmp_path / "cpuset" / "elsewhere" / "memory.max").write_text("1024\n")
    assert usable_memory_bytes(tmp_path, proc) == 3 << 30


def test_an_auto_host_tier_is_half_the_memory_shared_by_the_replicas():
    assert KVMemConfig().cpu_gb == AUTO_GB and KVMemConfig().describe()["cpu_gb"] == "auto"
    half = _mem_total() / 2 / (1 << 30)
    one = KVMemConfig().with_host_tier()
    assert one.cpu_gb == pytest.approx(min(half, usable_memory_bytes() / 2 / (1 << 30)), abs=0.01)
    assert KVMemConfig().with_host_tier(replicas=4).cpu_gb == pytest.approx(one.cpu_gb / 4, abs=0.01)
    assert KVMemConfig(cpu_gb=3.0).with_host_tier(replicas=4).cpu_gb == 3.0  # a set tier stays as set
    sized = KVMemConfig().sized_to(QWEN_05B)  # the engine sizes both: the tier, then the workspace it holds
    assert sized.cpu_gb == one.cpu_gb
    assert sized.ctx == int(one.cpu_gb * (1 << 30) // QWEN_05B.kv_bytes_per_block) * 64
