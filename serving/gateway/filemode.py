"""Whether a secret file (the gateway's ``auth.token_file``) is private enough to start with.

**Refused** (the gateway does not start, one line with the chmod): a file others or its group
can *write*, or others can execute: any local account could make its own token accepted.
**Warned about** (one line at start, the gateway serves): a file others can *read*. Reading is
the weaker harm, and it is what every default Secret mount gives: Kubernetes mounts a Secret's
files 0644 unless ``defaultMode`` says otherwise, and podman before 4.7 ignores ``defaultMode``
(``podman kube play`` mounts them 0644/0444), where the container's only account is the app's.
``make serve`` and ``python -m serving.gateway.auth`` write 0600; deploy/k8s/gateway.yaml asks
for 0440 with the pod's ``fsGroup`` (a group may read: an explicit grant).

:func:`check_private` only says why; the caller refuses or warns. Standard library only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# permission bits a secret file must not have (refused), and ones it should not (warned about)
REFUSED = stat.S_IWOTH | stat.S_IXOTH | stat.S_IWGRP
WARNED = stat.S_IROTH


def check_private(path: str | Path) -> tuple[str, str]:
    """``(refusal, warning)`` for the secret file ``path``, each one line or "": a refusal
    when others or its group can write it (or others execute it), a warning when others can
    read it; ("", "") when it is private (0600, 0400, 0640, 0440), when the system has no POSIX
    modes, or when it cannot be looked at (reading it will say why). A link is judged by the
    file it leads to."""
    if os.name != "posix":
        return "", ""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "", ""
    bits = ((stat.S_IROTH, "others can read it"), (stat.S_IWOTH, "others can write it"),
            (stat.S_IXOTH, "others can execute it"), (stat.S_IWGRP, "its group can write it"))  # fmt: skip
    why = ", ".join(text for bit, text in bits if mode & bit)
    line = (
        f"{path} (mode {stat.S_IMODE(mode):04o}): {why}, and it holds secrets; chmod 600 {path} "
        "(640 for a group that only reads it)"
    )
    if mode & REFUSED:
        return line, ""
    return "", line if mode & WARNED else ""
