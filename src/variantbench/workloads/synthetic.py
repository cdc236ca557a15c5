"""The embedded default workload: a seeded mix of tasks whose reference answers are known.

Each document is a municipal report about an invented town (or a resident's letter). Its facts are
drawn from a seeded generator, so a question's answer is a span of the document, a summary's
reference lists the document's key facts, and a letter's sentiment is known. Neutral filler
sentences bring every prompt to a length drawn from the length distribution, counted with the
model's own tokenizer: the filler is cut to the largest number of words whose prompt stays within
the drawn number of tokens (a binary search over whole words), so a prompt falls at most a word's
tokens short of its target. The facts sit at seeded positions through the document, not at its start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
import random

from variantbench.workloads.base import (
    MAX_NEW_TOKENS,
    TASKS,
    Sample,
    TokenCounter,
    Workload,
    approximate_counter,
)
from variantbench.workloads.lengths import LengthDistribution

DEFAULT_MIX = {"qa": 0.3, "summarization": 0.3, "generation": 0.2, "classification": 0.2}

_SYLLABLES = [
    "ver",
    "an",
    "dor",
    "mel",
    "ka",
    "ris",
    "to",
    "bel",
    "sun",
    "gar",
    "li",
    "mo",
    "thal",
    "en",
    "vi",
]
_EXPORTS = ["copper", "wool", "timber", "olive oil", "salt", "glassware", "honey", "cotton", "tin", "coffee"]
_FAMOUS = [
    "its stone bridge",
    "a spring festival",
    "clock makers",
    "a lighthouse",
    "its public library",
    "hot springs",
    "a rowing club",
    "painted houses",
    "a night market",
    "an old observatory",
]
_FIRST = [
    "Ana",
    "Tomas",
    "Ingrid",
    "Kofi",
    "Mei",
    "Rafael",
    "Sofia",
    "Yusuf",
    "Elena",
    "Dmitri",
    "Lena",
    "Omar",
]
_LAST = [
    "Novak",
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Tanaka",
    "Silva",
    "Haddad",
    "Kowalski",
    "Brennan",
    "Ortiz",
]
_TOPICS = [
    "road repairs",
    "the school budget",
    "water prices",
    "a new bus line",
    "park lighting",
    "market hours",
    "winter heating",
    "the harbour fees",
    "bicycle lanes",
    "library hours",
]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
_FILLER = [
    "The council met on {day} to discuss {topic}, and the debate ran late into the evening.",
    "Residents wrote several letters about {topic}, most of them asking for a clear timetable.",
    "A committee was formed to study {topic} and will report back before the end of the season.",
    "Local newspapers covered {topic} in detail, quoting shop owners and retired teachers alike.",
    "The weather on {day} was mild, which brought many families to the central square.",
    "Volunteers cleaned the riverbanks on {day}, collecting more rubbish than in any previous year.",
    "Officials noted that questions about {topic} come up at almost every public meeting.",
    "Several visitors said the town was quieter than they expected, especially after sunset.",
    "The records office stayed open an extra hour on {day} so that people could file their forms.",
    "A group of students presented a survey on {topic} to the planning department.",
    "Shopkeepers along the main street repainted their signs during the week before {day}.",
    "The minutes of the meeting on {topic} were posted at the town hall and on the notice board.",
    "An engineer from the regional office inspected the works related to {topic} on {day}.",
    "The evening bus ran late on {day} because of a detour near the old market.",
    "Farmers from nearby villages brought their produce to the square early on {day}.",
    "A public hearing on {topic} is planned for next month, the clerk announced.",
]
_POSITIVE = [
    "I am delighted with the council's plan for {topic}.",
    "The new plan for {topic} is a real improvement for everyone in town.",
    "Thank you for finally taking {topic} seriously; the changes work well.",
    "My neighbours and I are very happy with how {topic} has been handled.",
]
_NEGATIVE = [
    "I am disappointed with the council's plan for {topic}.",
    "The plan for {topic} is a waste of money and of everyone's time.",
    "Nobody asked for these changes to {topic}, and they make things worse.",
    "My neighbours and I are angry about how {topic} has been handled.",
]
LABELS = ("positive", "negative")


@dataclass(frozen=True)
class Town:
    name: str
    population: int
    founded: int
    export: str
    river: str
    mayor: str
    famous_for: str

    def facts(self) -> list[str]:
        return [
            f"{self.name} has a population of {self.population:,}.",
            f"{self.name} was founded in {self.founded}.",
            f"The main export of {self.name} is {self.export}.",
            f"{self.name} lies on the {self.river} River.",
            f"The mayor of {self.name} is {self.mayor}.",
            f"{self.name} is known for {self.famous_for}.",
        ]


def allocate(n: int, mix: Mapping[str, float], rng: random.Random) -> list[str]:
    """Tasks for ``n`` samples in the mix's proportions (largest remainders), in seeded order."""
    quotas = {task: n * weight for task, weight in mix.items()}
    counts = {task: int(q) for task, q in quotas.items()}
    by_remainder = sorted(mix, key=lambda t: (-(quotas[t] - counts[t]), t))
    for task in by_remainder[: n - sum(counts.values())]:
        counts[task] += 1
    tasks = [task for task in sorted(counts) for _ in range(counts[task])]
    rng.shuffle(tasks)
    return tasks


def build_synthetic(
    n: int,
    seed: int = 0,
    mix: Mapping[str, float] | None = None,
    lengths: LengthDistribution | None = None,
    counter: TokenCounter | None = None,
    counted_with: str | None = None,
    max_new_tokens: Mapping[str, int] | None = None,
    passes: int = 1,
) -> Workload:
    """``n`` samples a pass, ``passes`` passes (each its own samples, in the mix's proportions);
    deterministic for the seed (and the tokenizer that counts the lengths). The first pass does not
    depend on ``passes``: a run of one pass measures the samples a run of three starts with."""
    if n < 1:
        raise ValueError("a workload needs at least one sample")
    mix = dict(mix or DEFAULT_MIX)
    unknown = set(mix) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown task(s) {sorted(unknown)}; known: {', '.join(TASKS)}")
    lengths = lengths or LengthDistribution()
    count = counter or approximate_counter
    caps = {**MAX_NEW_TOKENS, **(max_new_tokens or {})}
    rng = random.Random(seed)
    samples = []
    for _ in range(passes):
        for task in allocate(n, mix, rng):
            target = lengths.draw(rng)
            samples.append(_make(task, f"synthetic-{seed}-{len(samples)}", target, rng, count, caps[task]))
    info = {
        "source": "synthetic",
        "mix": {k: round(v, 4) for k, v in sorted(mix.items())},
        "length_distribution": lengths.describe(),
        "counted_with": counted_with or ("tokenizer" if counter else "approximate (4/3 tokens per word)"),
        "max_new_tokens": {t: caps[t] for t in sorted(mix)},
    }
    return Workload(name="synthetic", seed=seed, samples=tuple(samples), info=info,
                    pass_size=n if passes > 1 else None)  # fmt: skip


def SyntheticLibrary(  # noqa: N802 - the name tests and tools have used since the first issue
    n: int, seed: int = 0, tokens: int | tuple[int, int] = (128, 512), **kwargs: object
) -> Workload:
    """A small synthetic workload with approximate lengths (tests, the self-test)."""
    low, high = (tokens, tokens) if isinstance(tokens, int) else tokens
    kind = "fixed" if low == high else "uniform"
    return build_synthetic(n, seed, lengths=LengthDistribution(kind, low, high), **kwargs)  # type: ignore[arg-type]


# ---- one sample -------------------------------------------------------------------------------


def _town(rng: random.Random) -> Town:
    name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
    river = "".join(rng.choice(_SYLLABLES) for _ in range(2)).capitalize()
    return Town(
        name=name,
        population=rng.randint(2_000, 250_000),
        founded=rng.randint(1200, 1950),
        export=rng.choice(_EXPORTS),
        river=river,
        mayor=f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
        famous_for=rng.choice(_FAMOUS),
    )


class _Document:
    """Key sentences at seeded fractions of a neutral filler text cut to ``k`` words."""

    def __init__(self, key: list[str], rng: random.Random, max_words: int) -> None:
        self.key = key
        self.where = sorted(rng.random() for _ in key)
        words: list[str] = []
        while len(words) < max_words:
            words += rng.choice(_FILLER).format(day=rng.choice(_DAYS), topic=rng.choice(_TOPICS)).split()
        self.filler = words

    def text(self, k: int) -> str:
        sentences: list[str] = []
        current: list[str] = []
        for word in self.filler[:k]:
            current.append(word)
            if word.endswith("."):
                sentences.append(" ".join(current))
                current = []
        if current:  # the cut fell inside a sentence: end it there
            sentences.append(" ".join(current).rstrip(",;") + ".")
        out = list(sentences)
        for offset, (fraction, sentence) in enumerate(zip(self.where, self.key, strict=True)):
            out.insert(round(fraction * len(sentences)) + offset, sentence)
        return " ".join(out)


def _fit(build: Callable[[int], str], target: int, most: int, count: TokenCounter) -> str:
    """The prompt with the most filler words whose token count stays within ``target``."""
    lo, hi = 0, most
    if count(build(0)) >= target:
        return build(0)  # the instruction and facts alone reach the target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


def _make(task: str, sid: str, target: int, rng: random.Random, count: TokenCounter, cap: int) -> Sample:
    town = _town(rng)
    alternatives: tuple[str, ...] = ()
    if task == "classification":
        label = rng.choice(LABELS)
        topic = rng.choice(_TOPICS)
        pool = _POSITIVE if label == "positive" else _NEGATIVE
        key = [s.format(topic=topic) for s in rng.sample(pool, 2)]
        head = "Read the letter a resident sent to the council.\n\nLetter: "
        tail = (
            f"\n\nIs the writer's opinion of the plan for {topic} positive or negative? "
            "Answer with one word: positive or negative."
        )
        reference = label
    elif task == "qa":
        key = town.facts()
        rng.shuffle(key)
        question, reference = rng.choice(
            [
                (f"What is the main export of {town.name}?", town.export),
                (f"Who is the mayor of {town.name}?", town.mayor),
                (f"In which year was {town.name} founded?", str(town.founded)),
                (f"On which river does {town.name} lie?", f"the {town.river} River"),
                (f"What is {town.name} known for?", town.famous_for),
            ]
        )
        if reference.startswith("the "):
            alternatives = (reference.removeprefix("the "),)
        head = "Read the report and answer the question with a short phrase taken from it.\n\nReport: "
        tail = f"\n\nQuestion: {question}"
    elif task == "summarization":
        key = town.facts()
        rng.shuffle(key)
        reference = (
            f"{town.name}, founded in {town.founded} on the {town.river} River, has {town.population:,} "
            f"residents, exports {town.export}, is led by mayor {town.mayor} and is known for {town.famous_for}."
        )
        head = "Summarize the key facts of this report in one or two sentences.\n\nReport: "
        tail = ""
    else:  # generation: a short text that should use the given facts
        key = town.facts()
        rng.shuffle(key)
        head = "Background: "
        tail = (
            f"\n\nWrite a short paragraph inviting tourists to visit {town.name}. Mention that it lies on "
            f"the {town.river} River, that it is known for {town.famous_for}, and that its markets sell "
            f"{town.export}."
        )
        reference = (
            f"Come and visit {town.name}, a welcoming town on the {town.river} River. {town.name} is known "
            f"for {town.famous_for}, and its markets sell fine {town.export}. Visitors enjoy the calm "
            "streets and friendly people."
        )
    doc = _Document(key, rng, max_words=target)  # a word is at least one token: target words suffice

    def build(k: int) -> str:
        return head + doc.text(k) + tail

    prompt = _fit(build, target, len(doc.filler), count)
    return Sample(sid, task, prompt, reference, cap, alternatives=alternatives, input_tokens=count(prompt))
