"""RegBench automata: generator ranges, minimisation, canonical hashing."""

import numpy as np
import pytest

from mosaics.evaluation.automata import (
    DFA,
    N_LETTERS,
    canonical_hash,
    minimize,
    random_dfa,
    reachable,
    words_up_to,
)


def _raw(n: int = 300):
    rng = np.random.default_rng(123)
    return [random_dfa(rng) for _ in range(n)]


def test_generator_ranges_and_shape():
    raws = _raw()
    n_states = [d.n_states for d, _ in raws]
    n_alpha = [len(a) for _, a in raws]
    degrees = [len(t) for d, _ in raws for t in d.delta]
    assert min(n_states) == 4 and max(n_states) == 12
    assert min(n_alpha) == 4 and max(n_alpha) == N_LETTERS
    assert set(degrees) == {1, 2, 3}
    for dfa, alphabet in raws:
        assert len(set(alphabet)) == len(alphabet) and set(alphabet) <= set(range(N_LETTERS))
        for q, trans in enumerate(dfa.delta):
            assert set(trans) <= set(alphabet)
            dests = list(trans.values())
            assert len(set(dests)) == len(dests), "destinations must be distinct"
            assert q not in dests, "no self-loops"
            assert all(0 <= d < dfa.n_states for d in dests)


def _equivalent(dfa: DFA, p: int, q: int) -> bool:
    """Same language from p and q: no reachable pair in the product has different symbols."""
    seen = {(p, q)}
    stack = [(p, q)]
    while stack:
        x, y = stack.pop()
        if set(dfa.delta[x]) != set(dfa.delta[y]):
            return False
        for a, dx in dfa.delta[x].items():
            pair = (dx, dfa.delta[y][a])
            if pair not in seen:
                seen.add(pair)
                stack.append(pair)
    return True


def test_minimised_accepts_the_same_strings():
    for raw, _ in _raw(60):
        small = minimize(raw)
        assert small.n_states <= raw.n_states
        assert words_up_to(small, 6) == words_up_to(raw, 6)
        for w in list(words_up_to(raw, 4))[:50]:
            assert small.accepts(w)


def test_minimised_is_minimal_reachable_and_idempotent():
    for raw, _ in _raw(40):
        small = minimize(raw)
        assert sorted(reachable(small)) == list(range(small.n_states))
        for p in range(small.n_states):
            for q in range(p + 1, small.n_states):
                assert not _equivalent(small, p, q), "two states accept the same language"
        merged = [q for q in range(raw.n_states) if q in reachable(raw)]
        assert small.n_states == len({min(r for r in merged if _equivalent(raw, q, r))
                                      for q in merged})
        assert minimize(small) == small


def test_canonical_hash_ignores_labels_and_unreachable_states():
    rng = np.random.default_rng(5)
    for _ in range(30):
        raw, _ = random_dfa(rng)
        n = raw.n_states
        perm = [0] + list(rng.permutation(np.arange(1, n)) if n > 1 else [])
        relabelled = [dict() for _ in range(n)]
        for q, t in enumerate(raw.delta):
            relabelled[perm[q]] = {a: int(perm[d]) for a, d in t.items()}
        relabelled.append({0: 0})  # an unreachable extra state
        assert canonical_hash(DFA(tuple(relabelled))) == canonical_hash(raw)


def test_canonical_hash_sees_equal_languages_through_duplicated_states():
    rng = np.random.default_rng(6)
    for _ in range(30):
        raw, _ = random_dfa(rng)
        delta = [dict(t) for t in raw.delta]
        q = int(rng.integers(raw.n_states))
        copy = len(delta)
        delta.append(dict(delta[q]))  # same outgoing edges: same language as q
        for t in delta[:copy]:
            for a, d in t.items():
                if d == q and rng.random() < 0.5:
                    t[a] = copy
        twin = DFA(tuple(delta))
        assert words_up_to(twin, 5) == words_up_to(raw, 5)
        assert canonical_hash(twin) == canonical_hash(raw)


def test_hash_equality_matches_language_equality():
    raws = [d for d, _ in _raw(200)]
    by_hash: dict[str, DFA] = {}
    collisions = 0
    for d in raws:
        h = canonical_hash(d)
        if h in by_hash:
            collisions += 1
            assert words_up_to(by_hash[h], 7) == words_up_to(d, 7)
        by_hash[h] = d
    assert collisions < len(raws)
    langs = [frozenset(words_up_to(d, 8)) for d in list(by_hash.values())[:60]]
    assert len(set(langs)) == len(langs), "distinct hashes must mean distinct languages"


def test_run_rejects_illegal_symbols():
    dfa = DFA(({0: 1}, {1: 0}))
    assert dfa.run([0, 1, 0]) == 1
    assert not dfa.accepts([1])
    with pytest.raises(ValueError, match="not legal"):
        dfa.run([1])
