"""A seeded mix of tasks whose reference answers are known by construction.

Each document is a short municipal report about invented towns. Its facts are drawn from a seeded
generator, so a question's answer is a span of the document and a summary's reference lists the
document's key facts. Filler sentences spread the prompts over a range of input lengths. The
full workload design (token-exact length distributions, more tasks, user files) builds on this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import random

from variantbench.workloads.base import Sample

TASKS = ("generation", "qa", "summarization")
MAX_NEW_TOKENS = {"generation": 64, "qa": 24, "summarization": 64}

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
]


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


@dataclass
class SyntheticLibrary:
    """``n`` samples, tasks drawn from the seed, prompts of ``min_words``-``max_words`` words."""

    n: int
    seed: int = 0
    tasks: tuple[str, ...] = TASKS
    min_words: int = 60
    max_words: int = 420
    name: str = "synthetic"
    _samples: list[Sample] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("a library needs at least one sample")
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise ValueError(f"unknown task(s) {sorted(unknown)}; known: {', '.join(TASKS)}")
        rng = random.Random(self.seed)
        self._samples = [self._make(i, rng) for i in range(self.n)]

    def __len__(self) -> int:
        return len(self._samples)

    def sample(self, index: int) -> Sample:
        return self._samples[index]

    def score(self, sample: Sample, output: str) -> dict[str, float]:
        from variantbench.metrics.quality import sample_scores

        return sample_scores(output, sample.reference)

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "seed": self.seed,
            "n": self.n,
            "tasks": list(self.tasks),
            "words": [self.min_words, self.max_words],
        }

    # ---- generation -------------------------------------------------------------------------

    def _town(self, rng: random.Random) -> Town:
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

    def _document(self, town: Town, rng: random.Random, words: int) -> str:
        sentences = town.facts()
        rng.shuffle(sentences)
        body = list(sentences)
        while sum(len(s.split()) for s in body) < words:
            filler = rng.choice(_FILLER).format(day=rng.choice(_DAYS), topic=rng.choice(_TOPICS))
            body.insert(rng.randint(0, len(body)), filler)
        return " ".join(body)

    def _make(self, index: int, rng: random.Random) -> Sample:
        task = rng.choice(self.tasks)
        town = self._town(rng)
        words = rng.randint(self.min_words, self.max_words)
        sid = f"{self.name}-{self.seed}-{index}"
        if task == "qa":
            doc = self._document(town, rng, words)
            question, answer = rng.choice(
                [
                    (f"What is the main export of {town.name}?", town.export),
                    (f"Who is the mayor of {town.name}?", town.mayor),
                    (f"In which year was {town.name} founded?", str(town.founded)),
                    (f"On which river does {town.name} lie?", f"the {town.river} River"),
                    (f"What is {town.name} known for?", town.famous_for),
                ]
            )
            prompt = (
                "Read the report and answer the question with a short phrase taken from it.\n\n"
                f"Report: {doc}\n\nQuestion: {question}"
            )
            return Sample(sid, task, prompt, answer, MAX_NEW_TOKENS[task])
        if task == "summarization":
            doc = self._document(town, rng, words)
            reference = (
                f"{town.name}, founded in {town.founded} on the {town.river} River, has {town.population:,} "
                f"residents, exports {town.export}, is led by mayor {town.mayor} and is known for {town.famous_for}."
            )
            prompt = f"Summarize the key facts of this report in one or two sentences.\n\nReport: {doc}"
            return Sample(sid, task, prompt, reference, MAX_NEW_TOKENS[task])
        # generation: a short description that should mention the given facts
        context = self._document(town, rng, max(0, words - 40)) if words > 100 else ""
        prompt = (
            (f"Background: {context}\n\n" if context else "")
            + f"Write a short paragraph inviting tourists to visit {town.name}. Mention that it lies on the "
            f"{town.river} River, that it is known for {town.famous_for}, and that its markets sell {town.export}."
        )
        reference = (
            f"Come and visit {town.name}, a welcoming town on the {town.river} River. {town.name} is known for "
            f"{town.famous_for}, and its markets sell fine {town.export}. Visitors enjoy the calm streets and "
            "friendly people."
        )
        return Sample(sid, task, prompt, reference, MAX_NEW_TOKENS[task])
