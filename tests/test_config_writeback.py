"""Write-back sizing settings: the derived defaults (queue, daily SSD write budget, burst), explicit
values, and one-line errors for values that could never work."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.core.errors import UsageError
from kvtier.daemon import config

GiB, MiB = 1 << 30, 1 << 20


def load(tmp_path: Path, **flags: str) -> config.Config:
    return config.load(flags, {"HOME": str(tmp_path)})


def test_defaults_of_a_full_size_daemon(tmp_path: Path) -> None:
    cfg = load(tmp_path, dram_bytes="4GiB", slot_bytes="2MiB", ssd_bytes="16GiB")
    assert cfg.ssd_dwpd == 1.0
    assert cfg.writeback_queue_bytes == GiB  # min(4 GiB / 4, 1 GiB) = 512 slots of 2 MiB
    assert cfg.ssd_write_bytes_per_day == 16 * GiB  # 16 GiB cache x 1 DWPD
    # min(16 GiB, max(16 GiB / 4, 4 x 1 GiB)) = 4 GiB: four 8K-token documents of an 8B model.
    assert cfg.ssd_write_burst_bytes == 4 * GiB


def test_defaults_of_small_pools(tmp_path: Path) -> None:
    cfg = load(tmp_path, dram_bytes="16MiB", slot_bytes="64KiB", ssd_bytes="64MiB")
    assert cfg.writeback_queue_bytes == 4 * MiB  # 16 MiB / 4
    # min(64 MiB, max(16 MiB, 16 MiB)) = 16 MiB
    assert cfg.ssd_write_burst_bytes == 16 * MiB
    # A small DRAM pool next to a smaller SSD: 4 queues (4 x 256 MiB) > a day of 512 MiB -> a day.
    cfg = load(tmp_path, dram_bytes="1GiB", ssd_bytes="512MiB")
    assert (cfg.writeback_queue_bytes, cfg.ssd_write_burst_bytes) == (256 * MiB, 512 * MiB)
    # Queue rounded down to whole slots: 10 MiB / 4 = 2.5 MiB -> 2 slots of 1 MiB.
    cfg = load(tmp_path, dram_bytes="10MiB", slot_bytes="1MiB", ssd_bytes="0")
    assert cfg.writeback_queue_bytes == 2 * MiB
    assert cfg.ssd_write_bytes_per_day == 0 and cfg.ssd_write_burst_bytes == 16 * MiB


def test_explicit_values_win(tmp_path: Path) -> None:
    cfg = load(tmp_path, dram_bytes="1GiB", ssd_bytes="10GiB", ssd_dwpd="0.3",
               writeback_queue_bytes="64MiB")
    assert cfg.ssd_write_bytes_per_day == int(10 * GiB * 0.3)
    assert cfg.writeback_queue_bytes == 64 * MiB
    assert cfg.ssd_write_burst_bytes == int(10 * GiB * 0.3) // 4  # > 4 x 64 MiB
    cfg = load(tmp_path, ssd_bytes="10GiB", ssd_write_bytes_per_day="100GiB",
               ssd_write_burst_bytes="3GiB")
    assert (cfg.ssd_write_bytes_per_day, cfg.ssd_write_burst_bytes) == (100 * GiB, 3 * GiB)


@pytest.mark.parametrize("flags,message", [
    ({"ssd_dwpd": "0"}, "ssd_dwpd (from flag --ssd-dwpd): must be in (0, 100]"),
    ({"ssd_dwpd": "lots"}, "ssd_dwpd (from flag --ssd-dwpd): expected a number"),
    ({"writeback_queue_bytes": "1KiB"},
     "writeback_queue_bytes (from flag --writeback-queue-bytes): must hold one slot"),
    ({"dram_bytes": "64MiB", "writeback_queue_bytes": "65MiB"}, "fit the DRAM pool"),
    ({"ssd_write_burst_bytes": "16KiB"},
     "ssd_write_burst_bytes (from flag --ssd-write-burst-bytes): must hold one block"),
])
def test_bad_values_are_one_line_errors(tmp_path: Path, flags: dict[str, str],
                                        message: str) -> None:
    with pytest.raises(UsageError) as err:
        load(tmp_path, **flags)
    assert message in str(err.value) and "\n" not in str(err.value)
