"""How private a token file must be for the gateway to start (serving/gateway/filemode.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from serving.gateway.filemode import check_private


@pytest.mark.parametrize(
    ("mode", "refused", "warned"),
    [(0o600, "", ""), (0o400, "", ""), (0o640, "", ""), (0o440, "", ""),
     (0o644, "", "others can read it"), (0o444, "", "others can read it"),
     (0o660, "its group can write it", ""), (0o602, "others can write it", ""),
     (0o601, "others can execute it", ""), (0o666, "others can write it", "")],
)  # fmt: skip
def test_a_token_file_others_can_write_is_refused_one_they_can_read_warned_about(
    tmp_path: Path, mode: int, refused: str, warned: str
) -> None:
    path = tmp_path / "tokens"
    path.write_text("t" * 32 + "\n")
    os.chmod(path, mode)
    refusal, warning = check_private(path)
    assert (refused in refusal) if refused else refusal == ""
    assert (warned in warning) if warned else warning == ""
    for message in (refusal, warning):
        if message:
            assert f"chmod 600 {path}" in message and "\n" not in message
    link = tmp_path / "link"  # Kubernetes mounts a Secret's files as links: the target counts
    link.symlink_to(path)
    assert check_private(link) == tuple(m.replace(str(path), str(link)) for m in (refusal, warning))
    assert check_private(tmp_path / "missing") == ("", "")  # reading it will say why
