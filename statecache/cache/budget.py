"""How much memory the state cache may hold: sizes of what it stores, and the budget from free device memory.

Pure arithmetic over a `TextConfig` and figures handed in (no torch calls here; `device_free_bytes` is the one
place that asks torch). The engine calls `cache_budget` after the weights, the static buffers and the captured
graphs are on the device, with the workspace of the largest forward it may still run (`forward_workspace_bytes`)
kept free: the cache gets `fraction` of what is left; `rebudget` re-checks that figure while serving, and
`check_fits` is how a worker that cannot fit its weights or its workspace refuses to start. The host tier's bound (`host_budget`) is the setting, else
`HOST_FRACTION` of the host's available memory (`host_available_bytes`, /proc/meminfo's MemAvailable), at most
`HOST_DEFAULT_MAX_MB` (on CUDA the tier is pinned, slab by slab as it fills: statecache.cache.tiers). Knows nothing of the cache's LRU or of
which rows come.
"""

from __future__ import annotations

from dataclasses import dataclass

from statecache.cache.config import CacheSettings
from statecache.cache.index import plan_chunks
from statecache.model.config import TextConfig

MIB = 2**20
CPU_DEFAULT_MB = 1024  # no device memory to measure on the CPU: a fixed bound
DEFAULT_FRACTION = CacheSettings.fraction
HOST_FRACTION = 0.5  # of MemAvailable, for the host tier when STATECACHE_HOST_CACHE_MB is unset
HOST_DEFAULT_MAX_MB = 256 * 1024  # a bound on the pinned memory one worker may come to hold
STATE_TOKENS = 4096  # "a 4k-token state", the unit the budget is reported in


def checkpoint_bytes(cfg: TextConfig, dtype_bytes: int) -> int:
    """One checkpoint's own tensors: each GDN layer's fp32 recurrent state and its last kernel-1 conv inputs."""
    g = len(cfg.linear_layers)
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * dtype_bytes
    return g * (state + conv)


def kv_bytes(cfg: TextConfig, tokens: int, dtype_bytes: int) -> int:
    """The attention K/V of `tokens` positions over all attention layers (a group's shared part)."""
    return len(cfg.full_layers) * tokens * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def checkpoints_planted(tokens: int, stride: int = 2048, tail: int = 16, align: int = 64) -> int:
    """How many checkpoints one state of `tokens` plants from scratch (the cache's own plan: index.plan_chunks)."""
    return len(plan_chunks(0, tokens, stride=stride, tail=tail, align=align))


def state_bytes(cfg: TextConfig, tokens: int, dtype_bytes: int, stride: int = 2048, tail: int = 16, align: int = 64) -> int:
    """What one new state of `tokens` costs the cache: its group's K/V plus the checkpoints it plants."""
    return kv_bytes(cfg, tokens, dtype_bytes) + checkpoints_planted(tokens, stride, tail, align) * checkpoint_bytes(cfg, dtype_bytes)


def forward_workspace_bytes(cfg: TextConfig, tokens: int, dtype_bytes: int) -> int:
    """A generous bound on the transient memory of one forward over `tokens` packed tokens (activations that live
    at once: residual, norms, projections of q/k/v/z/gates, the MLP's gate and up, the chunked delta rule's fp32
    per-chunk states and its fp32 work copies), times 1.5 for the allocator's fragmentation."""
    per_token = dtype_bytes * (8 * cfg.hidden_size + 3 * cfg.intermediate_size + 4 * cfg.conv_dim + 3 * cfg.value_dim
                               + 2 * cfg.num_attention_heads * cfg.head_dim)
    per_token += 4 * (3 * cfg.conv_dim + 2 * cfg.value_dim)  # fp32 copies inside the delta rule
    per_token += 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim // 64
    return int(1.5 * per_token * tokens)


@dataclass(frozen=True)
class Budget:
    mb: int  # the cache's bound in MiB
    source: str  # "setting" | "device" | "cpu default"
    states_4k: float  # how many new 4k-token states fit
    free_mb: float | None = None  # free device memory it was computed from
    workspace_mb: float | None = None  # kept free for the largest forward
    fraction: float | None = None

    def describe(self) -> str:
        text = f"state cache budget {self.mb} MiB ({self.states_4k:.1f} states of {STATE_TOKENS} tokens; {self.source}"
        if self.free_mb is not None:
            text += (f": {self.fraction:g} x ({self.free_mb:.0f} MiB free - {self.workspace_mb:.0f} MiB workspace for "
                     f"the largest forward)")
        return text + ")"


def cache_budget(cfg: TextConfig, dtype_bytes: int, *, setting_mb: int | None = None, free_bytes: int | None = None,
                 workspace_bytes: int = 0, fraction: float = DEFAULT_FRACTION, stride: int = 2048, tail: int = 16,
                 align: int = 64) -> Budget:
    """The cache's bound: `setting_mb` when given; else `fraction` of (`free_bytes` - `workspace_bytes`) when a
    device figure is given (never negative); else the CPU default."""
    if not 0 < fraction <= 1:
        raise ValueError(f"cache fraction {fraction} must be in (0, 1]")
    one = state_bytes(cfg, STATE_TOKENS, dtype_bytes, stride, tail, align)
    if setting_mb is not None:
        if setting_mb < 0:
            raise ValueError(f"cache MiB {setting_mb} must be >= 0")
        return Budget(int(setting_mb), "setting", setting_mb * MIB / one)
    if free_bytes is None:
        return Budget(CPU_DEFAULT_MB, "cpu default", CPU_DEFAULT_MB * MIB / one)
    usable = max(0, int(free_bytes) - int(workspace_bytes))
    mb = int(fraction * usable) // MIB
    return Budget(mb, "device", mb * MIB / one, free_bytes / MIB, workspace_bytes / MIB, fraction)


def device_free_bytes(device) -> int | None:
    """Free memory on a CUDA device by the driver's count; None for other devices. Memory torch's caching allocator
    holds reserved but unused is not counted: part of it is the captured graphs' private pool, which the cache's
    tensors cannot use."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def rebudget(start: Budget, free_bytes: int, own_growth_bytes: int) -> int:
    """The cache's bound in MiB, re-checked while serving (statecache.engine calls this every few seconds on CUDA):
    the start-up formula over the memory another process has not taken, i.e. what the driver says is free now plus
    what this process has reserved since start-up (its own cache and forwards are not another's). Another worker
    taking memory shrinks it; memory given back grows it. Two workers sharing a device settle near an even split."""
    if start.free_mb is None or start.fraction is None:
        return start.mb
    usable = max(0, int(free_bytes) + int(own_growth_bytes) - int((start.workspace_mb or 0) * MIB))
    return int(start.fraction * usable) // MIB


class DeviceTooSmall(RuntimeError):
    """The device cannot hold what a worker needs before any state is cached: the message names both figures."""


def check_fits(what: str, need_bytes: int, free_bytes: int | None, hint: str) -> None:
    """Raise DeviceTooSmall when `need_bytes` of `what` do not fit `free_bytes` (None: not measured, passes)."""
    if free_bytes is not None and need_bytes > free_bytes:
        raise DeviceTooSmall(f"{what} needs {need_bytes / MIB:.0f} MiB of device memory and {free_bytes / MIB:.0f} MiB "
                             f"is free: {hint}")


@dataclass(frozen=True)
class HostBudget:
    mb: int  # the host tier's bound in MiB (0: no host tier)
    source: str  # "setting" | "host memory" | "unknown host memory"
    available_mb: float | None = None

    def describe(self) -> str:
        text = f"host tier {self.mb} MiB ({self.source}"
        if self.available_mb is not None and self.source == "host memory":
            text += f": {HOST_FRACTION:g} x {self.available_mb:.0f} MiB available, at most {HOST_DEFAULT_MAX_MB} MiB"
        return text + ")"


def host_budget(setting_mb: int | None, available_bytes: int | None) -> HostBudget:
    """The host tier's bound: `setting_mb` when given (0 turns the tier off), else HOST_FRACTION of the available
    host memory capped at HOST_DEFAULT_MAX_MB (0 when it is unknown)."""
    if setting_mb is not None:
        if setting_mb < 0:
            raise ValueError(f"host cache MiB {setting_mb} must be >= 0")
        return HostBudget(int(setting_mb), "setting", None if available_bytes is None else available_bytes / MIB)
    if available_bytes is None:
        return HostBudget(0, "unknown host memory")
    return HostBudget(min(HOST_DEFAULT_MAX_MB, int(HOST_FRACTION * available_bytes) // MIB), "host memory",
                      available_bytes / MIB)


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of the host (None where there is no /proc/meminfo)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
