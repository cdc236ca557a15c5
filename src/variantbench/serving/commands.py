"""The bodies of ``variantbench serve`` and ``variantbench route``, read from a plan.

Each takes the plan (``serve``, ``router``, ``model`` and ``cost`` sections) and callbacks for what it
says; the command line parses and renders only (``cli.py``). Bad input is a ``UserError`` before
anything is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from variantbench.errors import UserError
from variantbench.plan import Plan
from variantbench.serving.guard import LOOPBACK
from variantbench.serving.host import (
    ServeOptions,
    build_router,
    calibration_samples,
    close_models,
    load_models,
    router_pair,
    run_server,
    serve_access,
    serve_limits,
)

Say = Callable[[str], None]


def serve(plan: Plan, say: Say, announce: Say, warn: Say) -> None:
    """Load ``serve.variants`` (and the tiered router over ``router.tiers``), then serve until Ctrl-C."""
    import os

    from variantbench.models import parse_model, prepare_model
    from variantbench.serving.app import make_app
    from variantbench.variants import parse_variant

    s, r = plan.serve, plan.router
    pair = router_pair(r.tiers) if r.tiers else None
    for name in s.variants:
        parse_variant(name)
    options = ServeOptions.from_plan(s)
    access = serve_access(s, dict(os.environ))
    limits = serve_limits(s)
    base = str(prepare_model(parse_model(plan.model.source), status=say))
    models = load_models(base, list(s.variants), options, device=plan.model.device, threads=plan.model.threads,
                         say=say)  # fmt: skip
    try:
        tiered = None
        if pair:
            prompts = calibration_samples(base, r.calibration_prompts, r.seed, r.input_lengths)
            tiered = build_router(models, pair[0], pair[1], r.standard_share, prompts, name=r.name, say=say)
            c = tiered.calibration
            say(f"router {r.name!r}: {pair[0]} below complexity {c.threshold:.3f}, else {pair[1]} "
                f"(calibrated on {c.prompts} prompts for a {c.share:g} standard share)")  # fmt: skip
        if s.host not in LOOPBACK:
            warn(f"binding {s.host}: reachable from other machines"
                 + ("" if access.keys else ", and with no API key (--allow-unauthenticated)"))  # fmt: skip
        served = ", ".join([*s.variants, *([r.name] if pair else [])])
        keyed = f"; {len(access.keys)} API key(s) required" if access.keys else ""
        announce(f"serving {served} on http://{s.host}:{s.port}/v1{keyed} (Ctrl-C drains and stops)")
        app = make_app(models, tiered, access=access, limits=limits, max_request_s=s.max_request_s)
        run_server(app, s.host, s.port, header_timeout_s=s.header_timeout_s, keep_alive_s=s.keep_alive_s)
    finally:
        close_models(models)


def route(plan: Plan, say: Say, progress: Callable[[int, int], None]) -> tuple[dict[str, Any], Any]:
    """Calibrate the router over ``router.tiers`` (default int8,fp32) on half of ``router.tasks``
    synthetic samples and answer the other half with both variants: (the evaluation, the router)."""
    from variantbench.backends.base import GenerationRequest, encode_request
    from variantbench.models import parse_model, prepare_model
    from variantbench.serving.router import evaluate, split

    r = plan.router
    light, standard = router_pair(r.tiers or "int8,fp32")
    if r.tasks < 4:
        raise UserError(f"router.tasks must be at least 4 (half calibrate, half are held out), got {r.tasks}")
    models: dict = {}
    try:
        base = str(prepare_model(parse_model(plan.model.source), status=say))
        samples = calibration_samples(base, r.tasks, r.seed, r.route_input_lengths)
        models = load_models(base, [light, standard], ServeOptions(max_batch_size=1), threads=plan.model.threads,
                             say=say)  # fmt: skip
        cal_idx, held_idx = split(len(samples), r.seed)
        tiered = build_router(
            models, light, standard, r.standard_share, [samples[i] for i in cal_idx], say=say
        )
        tok = models[light].tokenizer

        def encode(s: Any) -> list[int]:
            return encode_request(tok, GenerationRequest(s.sample_id, prompt=s.prompt, messages=s.messages))

        result = evaluate(models[light].backend, models[standard].backend, [samples[i] for i in held_idx], tiered,
                          encode, cost_per_hour=plan.cost.per_hour, seed=r.seed,
                          progress=lambda d, t: progress(d, len(held_idx)))  # fmt: skip
    finally:
        close_models(models)
    return result, tiered
