"""Value checks every config section uses; each raises a one-line ConfigError naming the key."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any

from megatron_lol.errors import ConfigError


def asdict(obj: Any) -> Any:
    if is_dataclass(obj):
        return {f.name: asdict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, list):
        return [asdict(x) for x in obj]
    return obj


def positive(key: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{key}: must be > 0 (got {value!r})")
    if not math.isfinite(value):  # nan passes the comparison above; inf trains into NaN
        raise ConfigError(f"{key}: must be a finite number > 0 (got {value!r})")


def nonnegative(key: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{key}: must be >= 0 (got {value!r})")
    if not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number >= 0 (got {value!r})")


def choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(map(str, choices))} (got {value!r})")
