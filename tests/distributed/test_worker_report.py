"""What a failing worker tells the scheduler: a start-up check refusing the settings (a
SettingsError or a plain ValueError, before the worker is ready) as its message alone, with
exit code 2 and no traceback; anything else, and any failure after start-up (a ValueError of
a running step included), as a traceback. Either way the channels close with a linger, so
the message leaves before the process ends."""

from __future__ import annotations

import pytest

from pipeserve.config import SettingsError
from pipeserve.distributed.messages import Failed, Refused, StatusBody
from pipeserve.distributed.wire import WireError
from pipeserve.distributed.worker import LAST_WORDS_MS, report_failure


class Channels:
    def __init__(self) -> None:
        self.sent: list[StatusBody] = []
        self.linger_ms: int | None = None

    def send_status(self, body: StatusBody) -> None:
        self.sent.append(body)

    def close(self, linger_ms: int = 0) -> None:
        self.linger_ms = linger_ms


def failed(exc: BaseException, started: bool) -> tuple[bool, Channels]:
    channels = Channels()
    try:
        raise exc
    except BaseException as caught:
        return report_failure(channels, caught, started, rank=3), channels


@pytest.mark.parametrize(
    "exc",
    [ValueError("--tp-size 3 does not divide 4 heads"), SettingsError("--page-size 3 ...")],
)
def test_a_check_refusing_at_start_up_is_sent_as_its_message(exc: BaseException) -> None:
    refused, channels = failed(exc, started=False)
    assert refused
    assert channels.sent == [Refused(str(exc))]
    assert channels.linger_ms == LAST_WORDS_MS > 0


@pytest.mark.parametrize(
    ("exc", "started"),
    [
        (ValueError("a batch carries cache-tier copies but HiCache is off here"), True),
        (WireError("malformed batch"), False),  # a ValueError subclass: a fault
        (RuntimeError("gloo: connection closed"), False),
    ],
)
def test_other_failures_are_sent_with_their_traceback(exc: BaseException, started: bool):
    refused, channels = failed(exc, started)
    assert not refused
    [failure] = channels.sent
    assert isinstance(failure, Failed)
    text = failure.text
    assert text.startswith("Traceback (most recent call last):")
    assert text.rstrip().endswith(f"{type(exc).__name__}: {exc}")
    assert channels.linger_ms == LAST_WORDS_MS
