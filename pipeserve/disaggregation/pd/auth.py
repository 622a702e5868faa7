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
  opens no other call, nor the same call again on that server (another server of the same
  role, within the window, could still be sent it once).
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
import re
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
STAMP = re.compile(r"[0-9]{1,17}")  # microseconds since the epoch


class InternalCredential:
    """Makes and checks the per-call credential of the internal HTTP legs (module
    docstring). The clocks of the router and the servers must agree within WINDOW_S.

    The header is `STAMP.NONCE.HEAD.FULL`: HEAD is an HMAC over the method, the path, the
    prefill server named, the body's length, STAMP and NONCE, so a receiver refuses a
    stranger before it reads a byte of the body (`head_problem`); FULL adds the body's
    SHA-256 (`problem`). A receiver takes a NONCE once: it remembers the last MAX_NONCES,
    and past that refuses any stamp not newer than the newest it forgot."""

    def __init__(self, key: str) -> None:
        self._key = derive(key, "disaggregation internal http")
        self._seen: dict[str, int] = {}  # nonce -> its stamp, in the order taken
        self._floor = -1  # stamps at or below this may be forgotten nonces: refused

    def _mac(self, *fields: str) -> str:
        return hmac.new(self._key, "\n".join(fields).encode(), hashlib.sha256).hexdigest()

    def headers(self, method: str, path: str, body: bytes, target: str = "") -> dict[str, str]:
        """The header of one call: `target` is the X-Pipeserve-Prefill value it carries."""
        stamp, nonce = str(round(time.time() * 1e6)), secrets.token_hex(16)  # stamp: µs
        head = self._mac("head", method.upper(), path, target, str(len(body)), stamp, nonce)
        full = self._mac("full", head, hashlib.sha256(body).hexdigest())
        return {INTERNAL_HEADER: f"{stamp}.{nonce}.{head}.{full}"}

    @staticmethod
    def _parts(headers: Mapping[str, str]) -> list[str] | None:
        given = headers.get(INTERNAL_HEADER.lower(), headers.get(INTERNAL_HEADER, ""))
        parts = given.split(".")
        if len(parts) != 4 or not STAMP.fullmatch(parts[0]):
            return None
        return parts

    def head_problem(
        self, method: str, path: str, headers: Mapping[str, str], target: str = ""
    ) -> str | None:
        """What is wrong with a call's credential that its head alone shows (None: nothing
        yet): checked before its body is read. The Content-Length header must be there."""
        parts = self._parts(headers)
        if parts is None:
            return "no internal credential"
        stamp, nonce, head, _ = parts
        length = headers.get("content-length", "0")
        want = self._mac("head", method.upper(), path, target, length, stamp, nonce)
        if not hmac.compare_digest(head.encode("latin-1", "replace"), want.encode()):
            return "an internal credential that does not verify"
        if not abs(time.time() - int(stamp) / 1e6) <= WINDOW_S:
            return "an internal credential out of its time window (are the clocks in sync?)"
        return None

    def problem(
        self, method: str, path: str, body: bytes, headers: Mapping[str, str], target: str = ""
    ) -> str | None:
        """Why a call's credential is not taken (None: it is, and is used up)."""
        headers = {k.lower(): v for k, v in headers.items()} | {"content-length": str(len(body))}
        problem = self.head_problem(method, path, headers, target)
        if problem is not None:
            return problem
        parts = self._parts(headers)
        assert parts is not None
        stamp, nonce, head, full = parts
        want = self._mac("full", head, hashlib.sha256(body).hexdigest())
        if not hmac.compare_digest(full.encode("latin-1", "replace"), want.encode()):
            return "an internal credential that does not verify"
        # a nonce is valid while its stamp is within the window: forget older ones
        oldest = round((time.time() - WINDOW_S) * 1e6)
        while self._seen and next(iter(self._seen.values())) < oldest:
            del self._seen[next(iter(self._seen))]
        if nonce in self._seen or int(stamp) <= self._floor:
            return "an internal credential used before"
        if len(self._seen) >= MAX_NONCES:  # forget the first taken; refuse what it may hide
            self._floor = max(self._floor, self._seen.pop(next(iter(self._seen))))
        self._seen[nonce] = int(stamp)
        return None


def kv_link_secret(key: str) -> bytes:
    """The KV data link's secret: receivers let in only prefill workers that hold it."""
    return derive(key, KV_LINK)
