"""Content hashes of JSON-like values: the keys of caches and of finished runs."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def json_digest(value: Any, length: int = 64) -> str:
    """The first `length` hex digits of the SHA-256 of `value` as canonical JSON (sorted keys).

    Values JSON cannot hold are written with `str`, so equal content gives an equal digest whatever the
    key order.
    """
    if not 1 <= length <= 64:
        raise ValueError(f"length must be in 1..64 hex digits, got {length}")
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]
