from pathlib import Path

import pytest

from trl_dart_es.digest import json_digest


def test_digest_ignores_key_order_and_sees_values():
    a = json_digest({"b": 1, "a": [1, 2], "c": {"y": 2, "x": 1}})
    assert a == json_digest({"c": {"x": 1, "y": 2}, "a": [1, 2], "b": 1})
    assert a != json_digest({"b": 1, "a": [2, 1], "c": {"y": 2, "x": 1}})
    assert len(a) == 64 and set(a) <= set("0123456789abcdef")


def test_digest_length_and_non_json_values():
    full = json_digest({"path": Path("/tmp/x")})
    assert json_digest({"path": Path("/tmp/x")}, 16) == full[:16]
    assert full == json_digest({"path": "/tmp/x"})  # written with str
    for bad in (0, 65):
        with pytest.raises(ValueError, match=str(bad)):
            json_digest({}, bad)
