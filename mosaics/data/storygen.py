"""Procedural children's stories whose endings depend on facts stated earlier.

This is the offline stand-in for BabiStories (which needs a download). Each story draws a
cast (names with pronouns), then narrates two to four *episodes* that each state facts: who
gave what to whom, an object's colour, a pet's name, a count, a day, where a lost thing was
found. Filler sentences re-mention the cast. The story ends with a recall question about one
randomly chosen fact and its answer sentence, e.g.

    ... Who gave Mia the kite? It was Tom.

The answer word is stated only earlier in the same story, so it is (nearly) unpredictable from
word statistics alone and predictable from the context: a model that remembers its context
should beat one that does not. ``context_oracle_report`` measures that on word level.

Everything is driven by ``random.Random(seed)``, whose integer-seeded ``random()``/``choice``
streams are stable across Python versions, so a seed gives the same corpus everywhere.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Story",
    "context_oracle_report",
    "generate_stories",
    "generate_story_records",
    "gift_fact",
    "make_default_corpus",
    "write_story_file",
]


def _w(words: str) -> tuple[str, ...]:
    """Whitespace-separated word list as a tuple."""
    return tuple(words.split())


GIRLS = _w(
    "Mia Lily Emma Zoe Anna Lucy Ella Sara Nora Ruby Ivy Maya Rosa Luna Chloe Hana Jade "
    "Kira Tess Nina Amy Eva Leah Daisy Molly Iris Clara Alice Grace Poppy"
)
BOYS = _w(
    "Tom Ben Sam Max Leo Jack Finn Noah Owen Eli Jake Luke Omar Ravi Theo Ivan Kai Milo "
    "Oscar Hugo Adam Liam Ezra Felix Jonah Caleb Rory Toby Arlo Dev"
)
COLOURS = _w("red blue green yellow purple orange pink brown white black silver golden")
OBJECTS = _w(
    "ball kite hat book box cup drum shell scarf boat car bell lamp key sock bag spoon "
    "rock star flag mask ring kettle train robot puppet blanket jar bucket"
)
PLACES = _w(
    "park beach forest garden lake farm market library hill river zoo school bakery "
    "meadow castle harbor village pond cave playground"
)
FRUITS = _w("apples pears plums cherries berries carrots cookies muffins acorns pebbles")
ANIMALS = _w("dog cat rabbit turtle parrot hamster pony duck goat mouse frog owl")
PET_NAMES = _w(
    "Biscuit Pepper Coco Ziggy Bubbles Muffin Pip Sunny Rocket Button Noodle Maple "
    "Peanut Sprout Waffle Pickles Jelly Bingo Tofu Olive"
)
HIDEOUTS = _w("bed table chair sofa tree bench bush rug stairs door shelf basket fence bridge")
DAYS = _w("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")
NUMBERS = _w("two three four five six seven eight nine ten eleven twelve")
FEELINGS = _w("happy glad excited proud calm cheerful curious brave")
WEATHER = (
    "The sun was warm and bright.",
    "A soft wind blew through the trees.",
    "Little clouds drifted across the sky.",
    "It had rained in the morning, so the grass was wet.",
    "Birds were singing everywhere.",
    "The air smelled of flowers.",
)


@dataclass(frozen=True)
class Story:
    """A story with its recall question.

    Attributes:
        text: the full story.
        answer: the word that answers the recall question (the story's last content word).
        answer_start: character offset of the answer in ``text`` (inside the last sentence).
        question_start: character offset where the recall question begins.
        kind: which fact the question is about ("giver", "colour", "pet", "count", ...).
    """

    text: str
    answer: str
    answer_start: int
    question_start: int
    kind: str


class _Person:
    def __init__(self, name: str, girl: bool):
        self.name = name
        self.he = "she" if girl else "he"
        self.him = "her" if girl else "him"
        self.his = "her" if girl else "his"


def _cast(rng: random.Random, n: int) -> list[_Person]:
    people: list[_Person] = []
    used: set[str] = set()
    while len(people) < n:
        girl = rng.random() < 0.5
        name = rng.choice(GIRLS if girl else BOYS)
        if name not in used:
            used.add(name)
            people.append(_Person(name, girl))
    return people


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


@dataclass
class _Tale:
    """What a story has established so far."""

    people: list[_Person]
    facts: list[tuple[str, str, str, str]] = field(default_factory=list)  # kind, q, lead, answer
    used: set[str] = field(default_factory=set)  # objects, animals, ... already in the story
    callbacks: list[str] = field(default_factory=list)  # later sentences restating facts

    def fresh(self, rng: random.Random, pool: Sequence[str]) -> str:
        word = rng.choice([w for w in pool if w not in self.used])
        self.used.add(word)
        return word


def _filler(rng: random.Random, people: Sequence[_Person], place: str) -> str:
    a, b = rng.sample(list(people), 2)
    options = (
        f"{a.name} laughed and ran around the {place}.",
        f"{a.name} and {b.name} sat down to rest for a while.",
        f"{_cap(a.he)} felt {rng.choice(FEELINGS)}.",
        f"{a.name} told {b.name} a funny joke, and {b.he} giggled.",
        f"Then {a.name} sang a little song.",
        f"{a.name} waved at a bird in the sky.",
        f"{b.name} shared a snack with {a.name}.",
        rng.choice(WEATHER),
        f"After a while, {a.name} wanted to play a game with {b.name}.",
        f"{a.name} held {b.name}'s hand.",
        f'"Look, {b.name}!" said {a.name}. "This is fun!"',
        f"{a.name} jumped over a big puddle, and {b.name} clapped.",
        f"{a.name} drew a picture of {b.name} and gave it to {b.him}.",
        f'"I am {rng.choice(FEELINGS)} today," said {a.name}.',
    )
    return rng.choice(options)


def _episode_gift(rng: random.Random, tale: _Tale) -> tuple[str, str | None]:
    giver, taker = rng.sample(tale.people, 2)
    obj = tale.fresh(rng, OBJECTS)
    colour = rng.choice(COLOURS)
    place = rng.choice(PLACES)
    size = rng.choice(("", "", "big ", "little ", "shiny ", "soft "))
    s = rng.choice(
        (
            f"At the {place}, {giver.name} gave {taker.name} a {size}{colour} {obj}.",
            f"One day {giver.name} found a {size}{colour} {obj} at the {place} and gave it "
            f"to {taker.name}.",
            f"{giver.name} had a {size}{colour} {obj}. At the {place}, {giver.he} gave it to "
            f"{taker.name} as a present.",
        )
    )
    s += " " + rng.choice(
        (
            f"{taker.name} said thank you and hugged {giver.name}.",
            f"{taker.name} smiled and held the {obj} tightly.",
            f"{_cap(taker.he)} loved the {obj} very much.",
        )
    )
    tale.facts.append(("giver", f"Who gave {taker.name} the {obj}?", "It was", giver.name))
    tale.facts.append(("colour", f"What color was the {obj}?", f"The {obj} was", colour))
    tale.facts.append(("place", f"Where did {taker.name} get the {obj}?", "At the", place))
    tale.callbacks += [
        f"{taker.name} played with the {colour} {obj} all afternoon.",
        f'"I love my {colour} {obj}," said {taker.name}.',
        f"{giver.name} was glad that {taker.name} liked the {obj}.",
    ]
    return s, place


def _episode_pet(rng: random.Random, tale: _Tale) -> tuple[str, str | None]:
    owner = rng.choice(tale.people)
    animal = tale.fresh(rng, ANIMALS)
    pet = tale.fresh(rng, PET_NAMES)
    s = rng.choice(
        (
            f"{owner.name} had a little {animal} named {pet}.",
            f"{owner.name} had a pet {animal}. The {animal} was called {pet}.",
            f"{owner.name} took {owner.his} {animal}, {pet}, everywhere {owner.he} went.",
        )
    )
    s += " " + rng.choice(
        (
            f"{pet} liked to jump and play.",
            f"{pet} was a very good {animal}.",
            f"Everyone loved {pet}.",
        )
    )
    tale.facts.append(("pet", f"What was the name of {owner.name}'s {animal}?", "It was", pet))
    tale.facts.append(("owner", f"Whose {animal} was {pet}?", "It belonged to", owner.name))
    tale.callbacks += [
        f"{pet} the {animal} ran after {owner.name}.",
        f"{owner.name} gave {pet} some water.",
        f"{pet} sat next to {owner.name} happily.",
    ]
    return s, None


def _episode_count(rng: random.Random, tale: _Tale) -> tuple[str, str | None]:
    who = rng.choice(tale.people)
    thing = tale.fresh(rng, FRUITS)
    n = rng.choice(NUMBERS)
    place = rng.choice(PLACES)
    s = rng.choice(
        (
            f"At the {place}, {who.name} picked {n} {thing}.",
            f"{who.name} found {n} {thing} near the {place}.",
            f"{who.name} counted {n} {thing} in a basket at the {place}.",
        )
    )
    s += " " + rng.choice(
        (
            f"{_cap(who.he)} put them in {who.his} pocket.",
            f"{_cap(who.he)} was very proud of them.",
            f"{_cap(who.he)} wanted to keep them for later.",
        )
    )
    tale.facts.append(("count", f"How many {thing} did {who.name} have?", f"{who.name} had", n))
    tale.callbacks += [
        f"{who.name} looked at {who.his} {n} {thing} again.",
        f'"I have {n} {thing}!" said {who.name}.',
    ]
    return s, place


def _episode_lost(rng: random.Random, tale: _Tale) -> tuple[str, str | None]:
    who, helper = rng.sample(tale.people, 2)
    obj = tale.fresh(rng, OBJECTS)
    spot = rng.choice(HIDEOUTS)
    wrong = rng.choice([h for h in HIDEOUTS if h != spot])
    s = (
        f"Oh no! {who.name} lost {who.his} {obj}. "
        f"{who.name} and {helper.name} looked behind the {wrong}, but it was not there. "
        + rng.choice(
            (
                f"At last {helper.name} found the {obj} under the {spot}.",
                f"Then {helper.name} looked under the {spot} and found the {obj}.",
            )
        )
    )
    tale.facts.append(("hideout", f"Where was the {obj}?", "It was under the", spot))
    tale.facts.append(("finder", f"Who found the {obj}?", "It was", helper.name))
    tale.callbacks += [
        f"{who.name} thanked {helper.name} for finding the {obj}.",
        f"{who.name} held the {obj} tightly so {who.he} would not lose it again.",
    ]
    return s, None


def _episode_day(rng: random.Random, tale: _Tale) -> tuple[str, str | None]:
    a, b = rng.sample(tale.people, 2)
    day = rng.choice(DAYS)
    place = rng.choice(PLACES)
    s = rng.choice(
        (
            f"On {day}, {a.name} and {b.name} went to the {place}.",
            f"{a.name} took {b.name} to the {place} on {day}.",
        )
    )
    q = f"On which day did {a.name} and {b.name} go to the {place}?"
    tale.facts.append(("day", q, "On", day))
    tale.facts.append(("trip", f"Where did {a.name} and {b.name} go on {day}?", "To the", place))
    tale.callbacks += [
        f"{a.name} and {b.name} had fun at the {place}.",
        f"On the way home from the {place}, {b.name} sang a song.",
    ]
    return s, place


def gift_fact(rng: random.Random, exclude_objects: Iterable[str] = (),
              exclude_colours: Iterable[str] = ()) -> tuple[str, str, str, str]:
    """One gift episode in the corpus's own phrasing, about an object and a colour not in the
    exclusions: (text, object, colour, question), the question ending before the colour,
    e.g. ``"What color was the kite? The kite was"``."""
    used, banned = set(exclude_objects), set(exclude_colours)
    if not set(OBJECTS) - used or not set(COLOURS) - banned:
        raise ValueError("every object or every colour is excluded; a fact needs one of each")
    while True:
        tale = _Tale(_cast(rng, 2), used=set(used))
        text, _ = _episode_gift(rng, tale)
        _, question, lead, colour = next(f for f in tale.facts if f[0] == "colour")
        if colour not in banned:
            obj = question.split()[-1].rstrip("?")
            return text, obj, colour, f"{question} {lead}"


def question_lead(rng: random.Random) -> str:
    """A lead-in the corpus puts before its recall question ("", "Think back. ", ...)."""
    return rng.choice(_QUESTION_LEADS)


_EPISODES = (_episode_gift, _episode_pet, _episode_count, _episode_lost, _episode_day)
_OPENINGS = (
    "Once upon a time, there were {n} friends: {names}.",
    "There once lived {n} friends named {names}.",
    "In a small town, {names} were {n} good friends.",
    "{names} were {n} friends who liked to play together.",
)
_QUESTION_LEADS = ("", "", "Do you remember? ", "Here is a question. ", "Think back. ")
_ENDINGS = (
    "It was a wonderful day.",
    "Everyone went home happy.",
    "The friends could not wait to play again.",
    "That night, they all slept well.",
)
_NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}


def _join_names(names: Sequence[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1]


def _one_story(rng: random.Random) -> Story:
    people = _cast(rng, rng.choice((2, 3, 3, 4)))
    sentences = [
        rng.choice(_OPENINGS).format(
            n=_NUMBER_WORDS[len(people)], names=_join_names([p.name for p in people])
        )
    ]
    tale = _Tale(people)
    episodes = rng.sample(_EPISODES, rng.choice((2, 3, 3, 4)))
    place = rng.choice(PLACES)
    for episode in episodes:
        text, where = episode(rng, tale)
        place = where or place
        if rng.random() < 0.3:  # a paragraph break, as in BabiStories
            sentences[-1] += "\n\n"
        sentences.append(text)
        for _ in range(rng.choice((0, 1, 1, 2))):
            if tale.callbacks and rng.random() < 0.5:
                sentences.append(tale.callbacks.pop(rng.randrange(len(tale.callbacks))))
            else:
                sentences.append(_filler(rng, people, place))
    sentences.append(rng.choice(_ENDINGS))
    kind, question, lead, answer = rng.choice(tale.facts)
    body = " ".join(sentences).replace("\n\n ", "\n\n")
    opener = f"{body} {rng.choice(_QUESTION_LEADS)}"
    prefix = f"{opener}{question} {lead} "
    return Story(
        text=f"{prefix}{answer}.",
        answer=answer,
        answer_start=len(prefix),
        question_start=len(opener),
        kind=kind,
    )


def generate_story_records(num_stories: int, seed: int = 0) -> list[Story]:
    """``num_stories`` stories with their recall answers; the same seed gives the same list."""
    if num_stories < 0:
        raise ValueError(f"num_stories must be >= 0, got {num_stories}")
    rng = random.Random(seed)
    return [_one_story(rng) for _ in range(num_stories)]


def generate_stories(num_stories: int, seed: int = 0) -> list[str]:
    """``num_stories`` story texts (deterministic in ``seed``)."""
    return [s.text for s in generate_story_records(num_stories, seed)]


def write_story_file(path: str | os.PathLike, stories: Iterable[str]) -> Path:
    """Write stories in BabiStories format (one JSON-encoded string per line), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for story in stories:
                if not isinstance(story, str):
                    raise TypeError(f"stories must be str, got {type(story).__name__}")
                f.write(json.dumps(story, ensure_ascii=False))
                f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


MANIFEST = "storygen.json"
GENERATOR_VERSION = 3


def make_default_corpus(
    out_dir: str | os.PathLike, num_train: int = 20000, num_val: int = 1000, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``out_dir/traindataset.txt`` and ``valdataset.txt`` (BabiStories format).

    Train stories use ``seed``, validation stories an independent stream (``seed`` + 1_000_003).
    A manifest (counts, seed, generator version) is written last; when it matches, the files
    are reused instead of regenerated. Returns (train_path, val_path).
    """
    out = Path(out_dir).expanduser()
    train, val = out / "traindataset.txt", out / "valdataset.txt"
    want = {
        "generator": "mosaics.data.storygen",
        "version": GENERATOR_VERSION,
        "seed": seed,
        "num_train": num_train,
        "num_val": num_val,
    }
    manifest = out / MANIFEST
    if manifest.is_file() and train.is_file() and val.is_file():
        try:
            if json.loads(manifest.read_text()) == want:
                return train, val
        except json.JSONDecodeError:
            pass
    out.mkdir(parents=True, exist_ok=True)
    manifest.unlink(missing_ok=True)
    write_story_file(train, generate_stories(num_train, seed))
    write_story_file(val, generate_stories(num_val, seed + 1_000_003))
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{MANIFEST}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(want, f)
    os.replace(tmp, manifest)
    return train, val


# ---------------------------------------------------------------- in-context memory measurement

_WORD = re.compile(r"\w+|[^\w\s]")


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


_FUNCTION_WORDS = frozenset(
    _w(
        "who what where how many which whose did was were the a an of to on go get have had name "
        "color it do you remember here is question think back and at in"
    )
)


def _sentences(text: str) -> list[set[str]]:
    return [set(_words(x)) for x in re.split(r"(?<=[.!?])\s+", text) if x]


def context_oracle_report(train: Sequence[Story], test: Sequence[Story]) -> dict[str, float]:
    """How much the story context helps to predict the recall answer (word level).

    Three predictors of the answer word ``w``; ``q`` is the question's first word (Who, What,
    Where, ...) and ``p`` the word before the answer:

    - *global* (no memory): P(w | q, p) counted over the answers of the ``train`` stories,
      add-one smoothed over the train vocabulary V: (c(q, p, w) + 1) / (c(q, p) + |V|). It
      knows the question type perfectly (a name, a colour, a number...) but not the story.
    - *context*: the same prior renormalised over the words of the story before the
      question: P(w | q, p, ctx) = P(w | q, p) 1[w in ctx] / Z.
    - *assoc* (associative recall): additionally weights each context word by 4^m, with m the
      largest number of the question's content words found in one earlier sentence that also
      holds ``w`` (question words are keys, the sentence that matches them the value).

    Returns {name}_acc (argmax == answer) and {name}_nll (mean negative log-likelihood, nats)
    over ``test``, the fraction of answers found in the story before the question, and
    num_test. A gap between "global" and the others is what in-context memory can win.
    """
    vocab = sorted({w for s in train for w in _words(s.text)})
    v = len(vocab)
    slot: dict[tuple[str, str], Counter[str]] = {}
    for s in train:
        slot.setdefault(_slot_key(s), Counter())[s.answer] += 1
    res: Counter[str] = Counter()
    in_story = 0
    for s in test:
        counts = slot.get(_slot_key(s), Counter())
        denom = sum(counts.values()) + v

        def prob(w: str, counts=counts, denom=denom) -> float:
            return (counts.get(w, 0) + 1) / denom

        body = s.text[: s.question_start]
        keys = set(_words(s.text[s.question_start : s.answer_start]))
        keys = {w for w in keys if w.lower() not in _FUNCTION_WORDS and w.isalnum()}
        sentences = _sentences(body)
        cands = sorted(set(_words(body)))
        in_story += s.answer in cands

        def assoc(w: str, keys=keys, sentences=sentences) -> float:
            m = max((len((keys - {w}) & sent) for sent in sentences if w in sent), default=0)
            return 4.0**m

        scorers = {
            "global": (vocab, prob),
            "context": (cands, prob),
            "assoc": (cands, lambda w, prob=prob, assoc=assoc: prob(w) * assoc(w)),
        }
        for name, (support, score) in scorers.items():
            scores = {w: score(w) for w in support}
            z = sum(scores.values())
            best = max(support, key=lambda w, scores=scores: (scores[w], w))
            res[f"{name}_acc"] += best == s.answer
            p_answer = scores.get(s.answer, 0.0) / z
            res[f"{name}_nll"] += -math.log(p_answer) if p_answer > 0 else math.inf
    n = max(len(test), 1)
    out = {k: res[k] / n for k in sorted(res)}
    out["answer_in_story"] = in_story / n
    out["num_test"] = float(len(test))
    return out


def _slot_key(s: Story) -> tuple[str, str]:
    """(first word of the question, word before the answer)."""
    return _words(s.text[s.question_start :])[0], _words(s.text[: s.answer_start])[-1]


if __name__ == "__main__":  # python -m mosaics.data.storygen
    import time

    t0 = time.perf_counter()
    recs = generate_story_records(20000, seed=0)
    dt = time.perf_counter() - t0
    chars = sum(len(r.text) for r in recs)
    print(f"generated 20000 stories ({chars / 1e6:.2f}M chars) in {dt:.2f} s")
    print(recs[0].text)
    report = context_oracle_report(recs, generate_story_records(2000, seed=1))
    for key, val in report.items():
        print(f"{key:>18}: {val:.4f}")
