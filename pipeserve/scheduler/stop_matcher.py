"""Stop strings found incrementally: an Aho–Corasick automaton over the characters of a
request's stop strings, fed each newly decoded piece of text exactly once.

The work per character is amortized O(1) whatever the number of stop strings: a state's
depth grows by at most one per character and every failure link followed shrinks it.
`StopMatcher.steps` counts that work (transitions tried plus failure links followed).

Which stop string is reported: the one that ends earliest in the text; of those ending at
the same character, the longest (it starts earliest, so the least text is emitted).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache


class StopAutomaton:
    """The trie of the stop strings with failure links; read-only once built. State 0 is
    the root; a state stands for the prefix of some stop string that leads to it."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.fail: list[int] = [0]
        self.depth: list[int] = [0]
        self.out: list[str | None] = [None]  # longest stop string ending at this state
        for stop in stops:
            self._insert(stop)
        self._link()

    @property
    def num_states(self) -> int:
        return len(self.goto)

    def _insert(self, stop: str) -> None:
        state = 0
        for ch in stop:
            nxt = self.goto[state].get(ch)
            if nxt is None:
                nxt = self._new_state(self.depth[state] + 1)
                self.goto[state][ch] = nxt
            state = nxt
        self.out[state] = stop

    def _new_state(self, depth: int) -> int:
        self.goto.append({})
        self.fail.append(0)
        self.depth.append(depth)
        self.out.append(None)
        return len(self.goto) - 1

    def _link(self) -> None:
        """Failure links in breadth-first order, so a state's link is set before its
        children's; `out` inherits the longest stop string that is a proper suffix."""
        queue = deque(self.goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, child in self.goto[state].items():
                self.fail[child] = self._fail_target(state, ch)
                if self.out[child] is None:
                    self.out[child] = self.out[self.fail[child]]
                queue.append(child)

    def _fail_target(self, parent: int, ch: str) -> int:
        if parent == 0:
            return 0
        state = self.fail[parent]
        while state and ch not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(ch, 0)


@lru_cache(maxsize=64)
def automaton_for(stops: tuple[str, ...]) -> StopAutomaton:
    """One automaton per distinct tuple of stop strings (requests often share them)."""
    return StopAutomaton(stops)


@dataclass(frozen=True)
class StopMatch:
    stop: str
    end: int  # index just past the stop string's last character, in the text fed so far

    @property
    def start(self) -> int:
        return self.end - len(self.stop)


class StopMatcher:
    """One request's position in the automaton. After the first match it stays matched."""

    def __init__(self, automaton: StopAutomaton) -> None:
        self.automaton = automaton
        self.state = 0
        self.fed = 0  # characters fed so far
        self.steps = 0  # transitions tried + failure links followed
        self.match: StopMatch | None = None

    @property
    def held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string:
        what a stream must hold back until it is known not to become one."""
        return self.automaton.depth[self.state]

    def feed(self, text: str) -> StopMatch | None:
        """Advance over `text` (the characters after those fed before); the first match."""
        out = self.automaton.out
        for ch in text:
            if self.match is not None:
                return self.match
            self.state = self._next(ch)
            self.fed += 1
            stop = out[self.state]
            if stop is not None:
                self.match = StopMatch(stop, self.fed)
        return self.match

    def _next(self, ch: str) -> int:
        goto, fail, state = self.automaton.goto, self.automaton.fail, self.state
        while True:
            self.steps += 1
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]
