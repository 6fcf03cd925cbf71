"""Who a call belongs to: tenants, their weights, and the call's tenant as it is served.

Every accepted token is a tenant's (a *flow* in Kubernetes' API Priority and Fairness): the token
file may name one and its weight on the token's line (``<token>  tenant=ads  weight=2``), so that
several tokens (a rotation's old and new) share one tenant; a token with no name is a tenant of
its own, named ``t-`` and the first 8 hex digits of the token's SHA-256 (stable across edits of
other lines; 32 bits of a digest say nothing usable about a 256-bit token). Without a token file
every call is the tenant ``default``.

The gateway's door (serving/gateway/admission.py) learns a call's tenant from its token and puts
it in a context variable of the call's task (:func:`current`), so the scoring path below it, the
same task, charges the right tenant without passing it through every signature.

Stdlib only: the token file's parser (serving/gateway/auth.py) is used by clients too.
"""

from __future__ import annotations

import contextvars
import hashlib
import re
from dataclasses import dataclass

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
MAX_WEIGHT = 1000.0
KEYS = ("tenant", "weight")


@dataclass(frozen=True)
class Tenant:
    """A tenant: its name (a metric label, a refusal's subject) and its weight (its share of
    the backends' capacity against the other busy tenants' is weight / their weights' sum)."""

    name: str
    weight: float = 1.0


DEFAULT = Tenant("default")
"""Every call's tenant when the gateway has no token file (and in unit tests of the path)."""

_CURRENT: contextvars.ContextVar[Tenant] = contextvars.ContextVar("tenant", default=DEFAULT)


def current() -> Tenant:
    """The tenant of the call this task serves (:data:`DEFAULT` outside one)."""
    return _CURRENT.get()


def enter(tenant: Tenant) -> contextvars.Token[Tenant]:
    """This task serves a call of ``tenant`` until :func:`leave`."""
    return _CURRENT.set(tenant)


def leave(token: contextvars.Token[Tenant]) -> None:
    _CURRENT.reset(token)


def anonymous_name(token: str) -> str:
    """The name of a token's tenant when its line names none."""
    return "t-" + hashlib.sha256(token.encode()).hexdigest()[:8]


def parse_settings(token: str, words: list[str], where: str) -> Tenant:
    """The tenant of ``token`` from the ``key=value`` words after it on its line; ValueError
    naming ``where`` (the file and line) and the word, never the token."""
    settings: dict[str, str] = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or key not in KEYS:
            raise ValueError(
                f"{where}: {word[:40]!r} after the token: expected tenant=NAME or weight=W "
                "(a comment starts with '#' after whitespace)"
            )
        if key in settings:
            raise ValueError(f"{where}: {key}= given twice")
        settings[key] = value
    name = settings.get("tenant", "")
    if name and not NAME.fullmatch(name):
        raise ValueError(
            f"{where}: tenant={name[:40]!r}: a name is 1-63 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    weight = 1.0
    if "weight" in settings:
        try:
            weight = float(settings["weight"])
        except ValueError:
            weight = float("nan")
        if not 0 < weight <= MAX_WEIGHT:  # NaN fails too
            raise ValueError(
                f"{where}: weight={settings['weight'][:20]!r}: a number in (0, {MAX_WEIGHT:g}]"
            )
    return Tenant(name or anonymous_name(token), weight)


def check_consistent(tenants: list[tuple[Tenant, str]]) -> None:
    """One weight per tenant name across its tokens' lines (``(tenant, where)`` pairs);
    ValueError naming both lines otherwise."""
    seen: dict[str, tuple[Tenant, str]] = {}
    for tenant, where in tenants:
        first = seen.setdefault(tenant.name, (tenant, where))
        if first[0].weight != tenant.weight:
            raise ValueError(
                f"{where}: tenant {tenant.name} has weight {tenant.weight:g} here and "
                f"{first[0].weight:g} at {first[1]}: give its tokens one weight"
            )
