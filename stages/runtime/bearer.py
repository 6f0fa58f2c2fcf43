"""Bearer tokens for posttrain's HTTP servers (`posttrain serve-rewards`, the Atropos policy server).

A server takes its token from a flag or an environment variable; a caller sends `Authorization: Bearer <token>`
and a request without it (or with another) gets 401 and does nothing. A server may run without a token only on
a loopback address: bound to any other interface it refuses to start, saying how to set one. Clients name the
environment variable that holds the token (`token_env`), so no secret is written in a config file or a key.
"""

from __future__ import annotations

import hmac
import os

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def server_token(host: str, token: str | None, env_var: str, what: str, flag: str) -> str | None:
    """The token a server on `host` requires: `token`, else $env_var; None (no check) is allowed on loopback only.
    Raises ValueError, naming `what` and how to set a token, for a non-loopback host without one."""
    token = token or os.environ.get(env_var) or None
    if token is None and host not in LOOPBACK_HOSTS:
        raise ValueError(f"{what}: listening on {host} needs a bearer token, or anyone who reaches the port can use "
                         f"it; set {flag} or the {env_var} environment variable (callers send "
                         "`Authorization: Bearer <token>`), or listen on 127.0.0.1")
    return token


def authorized(authorization: str | None, token: str | None) -> bool:
    """True when no token is required, or the Authorization header is `Bearer <token>` (constant-time compare)."""
    if token is None:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def named_token(token_env: str | None, what: str) -> str | None:
    """The token in $token_env; None when no variable is named. Raises ValueError naming `what` when the
    variable is named but not set (a token was asked for and would silently be missing)."""
    if not token_env:
        return None
    token = os.environ.get(token_env)
    if not token:
        raise ValueError(f"{what} names {token_env}, which is not set in this environment")
    return token


def client_headers(token_env: str | None, what: str) -> dict[str, str]:
    """The Authorization header of a client whose token is in $token_env (none when token_env is unset)."""
    token = named_token(token_env, f"{what}: token_env")
    return {"Authorization": f"Bearer {token}"} if token else {}
