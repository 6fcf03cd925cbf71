"""What the gateway reads of TorchServe's key file (serving/torchserve/keys.py): the inference
key alone, while the management tools still read every key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.gateway import server
from serving.torchserve import keys
from serving.torchserve.keys import KeyFileError, KeySource, inference_key, read_keys

FULL = {"inference": {"key": "i"}, "management": {"key": "m"}, "API": {"key": "a"}}


def _write(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_the_inference_key_is_read_without_the_others(tmp_path: Path) -> None:
    """Entries not asked for are neither checked nor returned: a file whose management entry
    is not even a key serves inference calls (it was refused whole)."""
    odd = _write(tmp_path / "odd.json", {"inference": {"key": "i"}, "management": "never read"})
    assert inference_key(odd) == "i"
    assert KeySource(odd).metadata() == (("authorization", "Bearer i"),)


def test_the_management_tools_still_read_every_key(tmp_path: Path) -> None:
    path = _write(tmp_path / "k.json", FULL)
    assert read_keys(path) == {"inference": "i", "management": "m", "API": "a"}
    assert read_keys(path, ("management",)) == {"management": "m"}
    assert read_keys(path, keys.INFERENCE) == {"inference": "i"}
    only = _write(tmp_path / "only.json", {"inference": {"key": "i"}})
    with pytest.raises(KeyFileError, match="no 'management' key"):
        read_keys(only, ("management",))
    with pytest.raises(KeyFileError, match="entry 'management' has no string 'key'"):
        read_keys(_write(tmp_path / "bad.json", {**FULL, "management": 5}))


def test_the_gateway_asks_for_the_inference_key_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read the gateway makes (its start-up check, each backend's key source) asks for
    ``inference`` only."""
    asked: list[object] = []
    real = keys.read_keys

    def spy(path: Path, kinds: object = None) -> dict[str, str]:
        asked.append(kinds)
        return real(path, kinds)  # type: ignore[arg-type]

    monkeypatch.setattr(keys, "read_keys", spy)
    path = _write(tmp_path / "k.json", FULL)
    KeySource(path).metadata()
    schema = _write(tmp_path / "schema.json", {"model": {"name": "m", "version": "1"},
                    "features": {"dense": ["d"], "sparse": ["s"]}})  # fmt: skip

    async def serve(cfg: object) -> None:  # main()'s checks, not the server
        return None

    monkeypatch.setattr(server, "serve", serve)
    monkeypatch.setattr(server, "keep_freed_memory", lambda: True)
    assert server.main(["--schema", str(schema), "--key-file", str(path)]) == 0
    assert asked == [("inference",)] * 2, asked
