"""pipeserve: LLM inference for very long prompts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams"]

if TYPE_CHECKING:
    from pipeserve.engine.engine import Engine
    from pipeserve.scheduler.request import SamplingParams


def __getattr__(name: str) -> Any:  # lazy: `import pipeserve` stays cheap (no torch)
    if name == "Engine":
        from pipeserve.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from pipeserve.scheduler.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
