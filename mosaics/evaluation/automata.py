"""Random partial DFAs for RegBench: generation, minimisation, canonical form.

An automaton is a tuple of per-state transition maps ``delta[q] = {symbol: destination}``
over symbols 0..17 (the letters a..r), start state 0, every state accepting. A missing
transition rejects. Its language is the set of symbol strings readable from the start.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass

import numpy as np

N_LETTERS = 18  # a..r


@dataclass(frozen=True)
class DFA:
    """Partial DFA with start state 0 and all states accepting.

    ``delta[q]`` maps a symbol (0..17) to the destination state of ``q``.
    """

    delta: tuple[dict[int, int], ...]

    @property
    def n_states(self) -> int:
        return len(self.delta)

    def symbols(self, state: int) -> list[int]:
        """Sorted outgoing symbols of ``state`` (the legal next symbols)."""
        return sorted(self.delta[state])

    def accepts(self, word: list[int] | tuple[int, ...]) -> bool:
        """True if ``word`` can be read from the start (all states accept)."""
        q = 0
        for a in word:
            if a not in self.delta[q]:
                return False
            q = self.delta[q][a]
        return True

    def run(self, word: list[int] | tuple[int, ...]) -> int:
        """State reached after reading ``word``; raises ``ValueError`` if it is rejected."""
        q = 0
        for a in word:
            if a not in self.delta[q]:
                raise ValueError(f"symbol {a} is not legal in state {q}")
            q = self.delta[q][a]
        return q


def random_dfa(rng: np.random.Generator, min_states: int = 4, max_states: int = 12,
               min_alpha: int = 4, max_alpha: int = N_LETTERS) -> tuple[DFA, list[int]]:
    """RegBench's raw automaton (before minimisation) and its alphabet.

    n_states ~ U{min_states..max_states}; alphabet = n_alpha ~ U{min_alpha..max_alpha}
    distinct letters of a..r; each state gets out-degree ~ U{1,2,3} (capped by the alphabet
    size and by the n_states - 1 other states) with distinct symbols and distinct destinations,
    never itself.
    """
    n_states = int(rng.integers(min_states, max_states + 1))
    n_alpha = int(rng.integers(min_alpha, max_alpha + 1))
    alphabet = sorted(int(a) for a in rng.choice(N_LETTERS, size=n_alpha, replace=False))
    delta: list[dict[int, int]] = []
    for q in range(n_states):
        degree = min(int(rng.integers(1, 4)), n_alpha, n_states - 1)
        syms = rng.choice(alphabet, size=degree, replace=False)
        others = [s for s in range(n_states) if s != q]
        dests = rng.choice(others, size=degree, replace=False)
        delta.append({int(a): int(d) for a, d in zip(syms, dests)})
    return DFA(tuple(delta)), alphabet


def reachable(dfa: DFA) -> list[int]:
    """States reachable from the start, in BFS order with sorted symbols."""
    seen = {0}
    order = [0]
    queue = deque([0])
    while queue:
        q = queue.popleft()
        for a in sorted(dfa.delta[q]):
            d = dfa.delta[q][a]
            if d not in seen:
                seen.add(d)
                order.append(d)
                queue.append(d)
    return order


def minimize(dfa: DFA) -> DFA:
    """Minimal partial DFA of the same language, reachable part only, canonically labelled.

    Partition refinement (Moore): start with all states in one block (all accept; the
    implicit dead state is the only rejecting one) and split blocks by the signature
    {symbol: block of destination} until stable. The quotient is then relabelled by
    :func:`canonical_relabel`, so equal languages give identical ``delta``.
    """
    block = [0] * dfa.n_states
    n_blocks = 1
    while True:
        signatures = [
            (block[q], tuple(sorted((a, block[d]) for a, d in dfa.delta[q].items())))
            for q in range(dfa.n_states)
        ]
        ids: dict[tuple, int] = {}
        new_block = [ids.setdefault(sig, len(ids)) for sig in signatures]
        if len(ids) == n_blocks:
            break
        block, n_blocks = new_block, len(ids)
    quotient: list[dict[int, int]] = [{} for _ in range(n_blocks)]
    for q in range(dfa.n_states):
        quotient[block[q]] = {a: block[d] for a, d in dfa.delta[q].items()}
    start = block[0]
    if start != 0:  # move the start block to label 0
        perm = list(range(n_blocks))
        perm[0], perm[start] = start, 0
        inv = {old: new for new, old in enumerate(perm)}
        quotient = [{a: inv[d] for a, d in quotient[old].items()} for old in perm]
    return canonical_relabel(DFA(tuple(quotient)))


def canonical_relabel(dfa: DFA) -> DFA:
    """Keep the reachable part and number states in BFS order from the start (sorted symbols)."""
    order = reachable(dfa)
    new = {old: i for i, old in enumerate(order)}
    return DFA(tuple({a: new[d] for a, d in sorted(dfa.delta[old].items())} for old in order))


def canonical_hash(dfa: DFA) -> str:
    """SHA-1 of the canonical minimal form: equal iff the two languages are equal."""
    canon = minimize(dfa)
    text = ";".join(",".join(f"{a}>{d}" for a, d in sorted(t.items())) for t in canon.delta)
    return hashlib.sha1(text.encode()).hexdigest()


def words_up_to(dfa: DFA, max_len: int, n_symbols: int = N_LETTERS) -> set[tuple[int, ...]]:
    """All accepted words of length <= ``max_len`` (brute force over the reachable tree)."""
    out: set[tuple[int, ...]] = {()}
    frontier: list[tuple[tuple[int, ...], int]] = [((), 0)]
    for _ in range(max_len):
        nxt = []
        for word, q in frontier:
            for a in range(n_symbols):
                if a in dfa.delta[q]:
                    w = word + (a,)
                    out.add(w)
                    nxt.append((w, dfa.delta[q][a]))
        frontier = nxt
    return out
