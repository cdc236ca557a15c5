"""The tiered router: each request goes to the light or the standard variant by a complexity score.

The score needs no training. Two features of the prompt, each standardized on calibration prompts:

* its length (log of the token count): long inputs are where a light model's errors compound;
* its perplexity under the light model (mean negative log-likelihood of the prompt's last
  ``window`` tokens, one prefill of the light model): text the light model finds surprising is
  text it is likely to answer badly.

complexity = z(log length) + z(mean NLL). The threshold is the (1 - share) quantile of the
calibration prompts' scores, so that a target share of requests (``--standard-share``) goes to the
standard variant. ``evaluate`` measures, on held-out samples with references, the quality and cost
of the router against always-light, always-standard and a random router at the same share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
import math
import random
import time
from typing import Any

WINDOW = 128  # prompt tokens scored under the light model


def prompt_features(log_probs: Callable[[list[int]], Any], ids: Sequence[int], window: int = WINDOW) -> tuple[float, float]:  # fmt: skip
    """(log prompt length, mean NLL of its last ``window`` tokens under the light model)."""
    tail = list(ids[-window:])
    if len(tail) < 2:
        return math.log(max(1, len(ids))), 0.0
    lp = log_probs(tail)  # [n, vocab]: next-token log-probabilities at each position
    nll = [-float(lp[i, tail[i + 1]]) for i in range(len(tail) - 1)]
    return math.log(len(ids)), sum(nll) / len(nll)


@dataclass(frozen=True)
class Calibration:
    share: float  # target share of requests sent to the standard variant
    threshold: float
    mean_len: float
    std_len: float
    mean_nll: float
    std_nll: float
    prompts: int

    def score(self, features: tuple[float, float]) -> float:
        log_len, nll = features
        return (log_len - self.mean_len) / self.std_len + (nll - self.mean_nll) / self.std_nll


def calibrate(features: Sequence[tuple[float, float]], share: float) -> Calibration:
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the standard share must lie in [0, 1], got {share}")
    if len(features) < 2:
        raise ValueError("calibration needs at least 2 prompts")

    def stats(values: list[float]) -> tuple[float, float]:
        m = sum(values) / len(values)
        sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
        return m, sd if sd > 1e-9 else 1.0

    ml, sl = stats([f[0] for f in features])
    mn, sn = stats([f[1] for f in features])
    cal = Calibration(share, 0.0, ml, sl, mn, sn, len(features))
    scores = sorted(cal.score(f) for f in features)
    if share <= 0:
        threshold = math.inf
    elif share >= 1:
        threshold = -math.inf
    else:  # the (1 - share) quantile, between two calibration scores
        pos = (1.0 - share) * (len(scores) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(scores) - 1)
        threshold = scores[lo] + (scores[hi] - scores[lo]) * (pos - lo)
    return Calibration(share, threshold, ml, sl, mn, sn, len(features))


class TieredRouter:
    """Picks ``standard`` when a prompt's complexity is above the calibrated threshold, else ``light``."""

    def __init__(self, light: str, standard: str, log_probs: Callable[[list[int]], Any], calibration: Calibration,
                 name: str = "tiered", window: int = WINDOW) -> None:  # fmt: skip
        self.light, self.standard, self.name = light, standard, name
        self.log_probs = log_probs
        self.calibration = calibration
        self.window = window

    def score(self, ids: Sequence[int]) -> float:
        return self.calibration.score(prompt_features(self.log_probs, ids, self.window))

    def route(self, ids: Sequence[int]) -> tuple[str, float]:
        s = self.score(ids)
        return (self.standard if s > self.calibration.threshold else self.light), s

    def describe(self) -> dict[str, Any]:
        """JSON-safe: a share of 0 or 1 calibrates an infinite threshold (every prompt to one tier),
        which ``GET /v1/models`` could not encode (issue 41: every call a 500); it is null, and
        ``always`` names the tier."""
        calibration = asdict(self.calibration)
        always = None
        if not math.isfinite(self.calibration.threshold):
            always = self.light if self.calibration.threshold > 0 else self.standard
            calibration["threshold"] = None
        return {"light": self.light, "standard": self.standard, "window": self.window,
                "calibration": calibration, "always": always}  # fmt: skip


def split(n: int, seed: int, calibration_fraction: float = 0.5) -> tuple[list[int], list[int]]:
    """Sample indices for calibration and for the held-out evaluation, disjoint, seeded."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = max(2, min(n - 1, round(n * calibration_fraction)))
    return sorted(order[:k]), sorted(order[k:])


def evaluate(light: Any, standard: Any, samples: Sequence[Any], router: TieredRouter, encode: Callable[[Any], list[int]],
             cost_per_hour: float = 1.0, seed: int = 0,
             progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Quality and cost of router vs always-light vs always-standard on ``samples`` (held out).

    Every sample is answered once by each variant (in-process ``generate``, one at a time, timed);
    each policy's quality is the composite score of the answers it would have served, and its cost
    the measured compute seconds it would have spent (the router's includes its scoring prefill),
    priced at ``cost_per_hour``. A random router with the same number of standard calls (mean of 20 draws) is the chance baseline.
    """
    from variantbench.backends.base import GenerationRequest
    from variantbench.metrics.quality import Scored, summarize_quality

    rows = []
    for i, s in enumerate(samples):
        request = GenerationRequest(
            s.sample_id, prompt=s.prompt, messages=s.messages, max_new_tokens=s.max_new_tokens
        )
        t0 = time.perf_counter()
        target, score = router.route(encode(s))
        route_s = time.perf_counter() - t0
        answers = {}
        for name, backend in ((router.light, light), (router.standard, standard)):
            t0 = time.perf_counter()
            result = backend.generate([request])[0]
            answers[name] = (result.text if result.status == "ok" else "", time.perf_counter() - t0)
        rows.append((s, target, score, route_s, answers))
        if progress:
            progress(i + 1, len(samples))

    def policy(pick: Callable[[int, Any], str], include_routing: bool) -> dict[str, Any]:
        items, seconds, to_std = [], 0.0, 0
        for i, (s, target, _, route_s, answers) in enumerate(rows):
            name = pick(i, target)
            text, t = answers[name]
            items.append(Scored(s.task, text, s.reference, tuple(s.alternatives)))
            seconds += t + (route_s if include_routing else 0.0)
            to_std += name == router.standard
        q = summarize_quality(items)
        per_request = seconds / len(rows)
        return {"quality": q["composite"], "standard_share": to_std / len(rows), "compute_s_per_request": per_request,
                "cost_per_1k_requests": per_request * cost_per_hour / 3600 * 1000}  # fmt: skip

    realized = sum(r[1] == router.standard for r in rows) / len(rows)
    rng = random.Random(seed)
    k = round(realized * len(rows))
    draws = []  # the chance baseline: the same number of standard calls on random samples, 20 draws
    for _ in range(20):
        chosen = set(rng.sample(range(len(rows)), k))
        draws.append(policy(lambda i, t, c=chosen: router.standard if i in c else router.light, False))
    chance = {key: (None if any(d[key] is None for d in draws) else sum(d[key] for d in draws) / len(draws))
              for key in draws[0]}  # fmt: skip
    return {
        "held_out": len(rows),
        "target_share": router.calibration.share,
        "realized_share": realized,
        "routing_s_per_request": sum(r[3] for r in rows) / len(rows),
        "cost_per_hour": cost_per_hour,
        "policies": {
            "router": policy(lambda i, t: t, True),
            "always-light": policy(lambda i, t: router.light, False),
            "always-standard": policy(lambda i, t: router.standard, False),
            "random-at-share": chance,
        },
    }
