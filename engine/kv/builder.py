"""Builds the KV tiers below the device pool from the engine's config."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.kv.disk_tier import DiskTier
from engine.kv.fingerprint import model_fingerprint
from engine.kv.format import KVFormat
from engine.kv.hierarchy import KVHierarchy
from engine.kv.host_tier import HostTier

logger = logging.getLogger(__name__)

GIB = 1 << 30


def host_tier_blocks(config: EngineConfig, block_nbytes: int) -> int:
    """Blocks the host tier holds (0: no host tier)."""
    if config.num_host_blocks_override is not None:
        return config.num_host_blocks_override
    return int(config.kv_offloading_size * GIB) // block_nbytes


def build_hierarchy(
    config: EngineConfig,
    fmt: KVFormat,
    device: torch.device,
    model_path: Path,
    fingerprint_settings: Mapping[str, str],
) -> KVHierarchy | None:
    """The host (and disk) tiers, or None when none is configured.

    Raises:
        ValueError: a host tier too small for one block.
    A disk directory that cannot be created or read is logged and skipped:
    the engine runs without the disk tier, as it would after a disk fault.
    """
    if not config.host_tier_enabled:
        return None
    blocks = host_tier_blocks(config, fmt.block_nbytes)
    if blocks < 1:
        raise ValueError(
            f"--kv-offloading-size {config.kv_offloading_size} GiB holds no KV block of "
            f"{fmt.block_nbytes} bytes"
        )
    cuda = device.type == "cuda"
    host = HostTier(blocks, fmt.block_nbytes, pin_memory=cuda)
    disk: DiskTier | None = None
    if config.kv_offloading_disk_path is not None:
        fp = model_fingerprint(model_path, {**fingerprint_settings, "kv_format": fmt.describe()})
        try:
            disk = DiskTier(
                Path(config.kv_offloading_disk_path),
                int(config.kv_offloading_disk_size * GIB),
                fmt.block_nbytes,
                fmt.block_size,
                fp,
            )
        except OSError as e:
            logger.warning("KV disk tier off: cannot use %s: %s", config.kv_offloading_disk_path, e)
    return KVHierarchy(host, disk, async_copies=cuda, write_queue_blocks=config.kv_disk_write_queue)
