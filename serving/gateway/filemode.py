"""Whether a secret file (the gateway's ``auth.token_file``) is private enough to start with.

The choice is to refuse, as ssh refuses a private key others can read, when the file lets
accounts other than its owner in: readable or writable by others (any local account could
call the gateway with its tokens, or make its own token accepted), or writable by its group.
A group may read it: that is how Kubernetes gives a Secret to a non-root container
(``defaultMode: 0440`` with the pod's ``fsGroup``, deploy/k8s/gateway.yaml), and a group is an
explicit grant. ``make serve`` and ``python -m serving.gateway.auth`` write 0600. A warning
instead would let a world-readable token file run for ever, the warning scrolled away.

:func:`check_private` only says why; the caller refuses to start with that line. Standard
library only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# permission bits a secret file must not have: any for others, write for its group
TOO_OPEN = stat.S_IRWXO | stat.S_IWGRP


def check_private(path: str | Path) -> str:
    """Why ``path`` is too open to hold secrets, in one line; "" when it is private enough
    (mode 0600, 0400, 0640 or 0440), when the system has no POSIX modes, or when it cannot be
    looked at (reading it will say why). A link is judged by the file it leads to."""
    if os.name != "posix":
        return ""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""
    if not mode & TOO_OPEN:
        return ""
    bits = ((stat.S_IROTH, "others can read it"), (stat.S_IWOTH, "others can write it"),
            (stat.S_IXOTH, "others can execute it"), (stat.S_IWGRP, "its group can write it"))  # fmt: skip
    why = ", ".join(text for bit, text in bits if mode & bit)
    return (
        f"{path} (mode {stat.S_IMODE(mode):04o}): {why}, and it holds secrets; chmod 600 {path} "
        "(640 for a group that only reads it)"
    )
