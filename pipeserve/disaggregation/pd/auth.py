"""The credentials of prefill/decode disaggregation.

One shared secret, the PD key (`--disaggregation-auth-key`, or env PIPESERVE_PD_AUTH_KEY
which the process list does not show), is given to the router and to every prefill and
decode server; nothing of disaggregation runs without it. From it, by HMAC-SHA256 under
labels of their own (never the multi-node control plane's, so neither key opens the other's
link):

- the internal HTTP credential, sent in `X-Pipeserve-Internal` on the router's calls of a
  decode server and the decode server's calls of a prefill server. A decode server follows
  `X-Pipeserve-Prefill` only with it, and a prefill server's `POST /pd/prefill` needs it;
  the client API key (`--api-key`) opens neither.
- the secret of the KV data link (link.py): the decode workers' receivers let in only
  peers that prove they hold it (the prefill workers), and every record is encrypted under
  keys fresh to its connection, so a peer without the PD key can neither write nor read
  what travels.

The KV control link (the decode engine process opening rooms on its own workers) does not
derive from the PD key: each receiver makes a random secret at start and its engine learns
it from the worker's ready message on the control plane, so a PD key holder cannot open a
room. The PD key itself must carry at least 128 random bits (`config.key_problem`): a
recorded handshake lets one test guesses of it offline, which only a key of that size
defeats.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from pipeserve import envs
from pipeserve.config import MISSING_PD_KEY as MISSING_KEY
from pipeserve.config import key_problem
from pipeserve.disaggregation.pd.link import derive

INTERNAL_HEADER = "X-Pipeserve-Internal"
KV_LINK = "disaggregation kv link"  # the data link secret's label


def pd_key(flag: str | None) -> str:
    """The PD key: the flag's value, else the environment's; ValueError if neither."""
    key = flag or envs.pd_auth_key()
    if not key:
        raise ValueError(MISSING_KEY)
    problem = key_problem(key, "the PD key (PIPESERVE_PD_AUTH_KEY or --disaggregation-auth-key)")
    if problem:
        raise ValueError(problem)
    return key


def internal_token(key: str) -> str:
    """The value of `X-Pipeserve-Internal` that every holder of `key` computes alike."""
    label = b"pipeserve disaggregation internal http"
    return hmac.new(key.encode(), label, hashlib.sha256).hexdigest()


def internal_headers(key: str) -> dict[str, str]:
    return {INTERNAL_HEADER: internal_token(key)}


def is_internal(headers: Mapping[str, str], token: str) -> bool:
    """Whether a request carries the internal credential (compared in constant time)."""
    given = headers.get(INTERNAL_HEADER.lower(), headers.get(INTERNAL_HEADER, ""))
    return hmac.compare_digest(given.encode("latin-1", "replace"), token.encode())


def kv_link_secret(key: str) -> bytes:
    """The KV data link's secret: receivers let in only prefill workers that hold it."""
    return derive(key, KV_LINK)
