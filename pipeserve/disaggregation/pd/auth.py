"""The credentials of prefill/decode disaggregation.

One shared secret, the PD key (`--disaggregation-auth-key`, or env PIPESERVE_PD_AUTH_KEY
which the process list does not show), is given to the router and to every prefill and
decode server; nothing of disaggregation runs without it. From it, by HMAC-SHA256 under
labels of their own (never the multi-node control plane's, so neither key opens the other's
link):

- the key of the internal HTTP credential, sent in `X-Pipeserve-Internal` on the router's
  calls of a decode server and the decode server's calls of a prefill server. A decode
  server follows `X-Pipeserve-Prefill` only with it, and a prefill server's
  `POST /pd/prefill` needs it; the client API key (`--api-key`) opens neither. The
  credential is made per call (`InternalCredential`): an HMAC over the method, the path, the
  body's SHA-256, the prefill server named, a timestamp and a random nonce; the receiver
  takes it within WINDOW_S of its timestamp and once only, so a value seen on the network
  opens nothing else and not even the same call again.
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
import secrets
import time
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


WINDOW_S = 60.0  # a credential is taken this long either side of its timestamp
MAX_NONCES = 200_000  # credentials remembered within the window (legitimate calls only)


class InternalCredential:
    """Makes and checks the per-call credential of the internal HTTP legs (module
    docstring). The clocks of the router and the servers must agree within WINDOW_S."""

    def __init__(self, key: str) -> None:
        self._key = derive(key, "disaggregation internal http")
        self._seen: dict[str, float] = {}  # nonce -> when it was taken, oldest first

    def _mac(self, method: str, path: str, body: bytes, target: str, stamp: str, nonce: str) -> str:
        digest = hashlib.sha256(body).hexdigest()
        text = "\n".join((method.upper(), path, digest, target, stamp, nonce))
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def headers(self, method: str, path: str, body: bytes, target: str = "") -> dict[str, str]:
        """The header of one call: `target` is the X-Pipeserve-Prefill value it carries."""
        stamp, nonce = str(round(time.time() * 1000)), secrets.token_hex(16)  # stamp: ms
        mac = self._mac(method, path, body, target, stamp, nonce)
        return {INTERNAL_HEADER: f"{stamp}.{nonce}.{mac}"}

    def problem(
        self, method: str, path: str, body: bytes, headers: Mapping[str, str], target: str = ""
    ) -> str | None:
        """Why a call's credential is not taken (None: it is, and is used up)."""
        given = headers.get(INTERNAL_HEADER.lower(), headers.get(INTERNAL_HEADER, ""))
        stamp, _, rest = given.partition(".")
        nonce, _, mac = rest.partition(".")
        if not (stamp.isdigit() and len(stamp) < 20):
            return "no internal credential"
        when = int(stamp) / 1000
        want = self._mac(method, path, body, target, stamp, nonce)
        if not hmac.compare_digest(mac.encode("latin-1", "replace"), want.encode()):
            return "an internal credential that does not verify"
        now = time.time()
        if not abs(now - when) <= WINDOW_S:  # NaN fails too
            return "an internal credential out of its time window (are the clocks in sync?)"
        # a nonce taken at `now` is valid at most until now + 2 WINDOW_S (its stamp is at
        # least now - WINDOW_S): forget those taken before that, oldest first
        while self._seen and now - next(iter(self._seen.values())) > 2 * WINDOW_S:
            del self._seen[next(iter(self._seen))]
        if nonce in self._seen:
            return "an internal credential used before"
        if len(self._seen) >= MAX_NONCES:
            return "too many internal calls within the replay window"
        self._seen[nonce] = now
        return None


def kv_link_secret(key: str) -> bytes:
    """The KV data link's secret: receivers let in only prefill workers that hold it."""
    return derive(key, KV_LINK)
