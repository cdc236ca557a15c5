"""The ``variantbench`` command: thin; parses, calls the library, renders."""

from __future__ import annotations

from pathlib import Path
import sys
from typing import TYPE_CHECKING, Annotated, Any

from rich.console import Console
import typer

from variantbench.cli_args import MONITOR_FLAGS, ROUTE_FLAGS, SEARCH_FLAGS, SERVE_FLAGS, FlagTable
from variantbench.errors import UserError

if TYPE_CHECKING:
    from variantbench.cli_args import RunArgs
    from variantbench.plan import Plan
    from variantbench.report.schema import Report

app = typer.Typer(
    name="variantbench",
    help="Which variant of my model should I deploy for this scenario, and why?",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _fail(message: str, code: int = 2) -> None:
    from rich.markup import escape

    Console(stderr=True).print(
        f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True
    )
    raise typer.Exit(code)


def _need(extra: str, what: str) -> None:
    from variantbench.extras import require

    try:
        require(extra, what)
    except UserError as exc:
        _fail(str(exc))


def _flags_epilog(table: FlagTable | None = None) -> str:
    from variantbench.cli_args import flag_help

    rows = "\n".join(f"{flag} ({key}): {desc}" for flag, key, desc in flag_help(table))
    return (
        "Any setting of the plan: --set KEY.PATH=VALUE (repeatable; 'variantbench plan' shows them all).\n"
        "Everyday flags, each a shortcut for --set KEY.PATH (defaults come from the plan):\n\n" + rows
    )


_FLAGS_EPILOG = _flags_epilog()
_SERVE_EPILOG = _flags_epilog(SERVE_FLAGS)
_ROUTE_EPILOG = _flags_epilog(ROUTE_FLAGS)
_MONITOR_EPILOG = _flags_epilog(MONITOR_FLAGS)
_SEARCH_EPILOG = _flags_epilog(SEARCH_FLAGS)
_PLAN_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": ["--help", "-h"]}


def _resolve_plan(tokens: list[str], switches: tuple[str, ...] = (), table: FlagTable | None = None,
                  command: str = "run") -> tuple[Plan, RunArgs]:  # fmt: skip
    """(the plan, the parsed arguments) from ``[PLAN.yaml] [--set k=v] [--flag v]``, with the
    command's own flags (``table``; run's by default)."""
    from variantbench.cli_args import RUN_FLAGS, parse_run_args
    from variantbench.plan_file import load_plan

    table = table or RUN_FLAGS
    args = parse_run_args(tokens, switches, table, command)
    hints = {loc: flag for flag, loc in table.flags.items()}
    return load_plan(args.plan_file, args.overrides, args.flag_of, hints), args


def _replay_folder(plan_file: Path | None, plan: Plan, args: RunArgs) -> Path | None:
    """Replaying OUT/plan.yaml into OUT would overwrite the run it came from: a sibling folder instead."""
    if plan_file is None or args.sets(("out",)):
        return None
    out = plan.out
    if plan_file.resolve().parent != out.resolve() or not (out / "report.json").exists():
        return None
    n = 1
    while Path(f"{out}-replay-{n}").exists():
        n += 1
    return Path(f"{out}-replay-{n}")


def _take_resume(tokens: list[str]) -> tuple[list[str], Path | None]:
    """``--resume DIR`` (the whole command line: the plan is the folder's own)."""
    for i, token in enumerate(tokens):
        name, eq, inline = token.partition("=")
        if name != "--resume":
            continue
        folder = inline if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)
        rest = tokens[:i] + tokens[i + (1 if eq else 2) :]
        if not folder:
            raise UserError("--resume takes the folder of the run to continue")
        if rest:
            raise UserError(f"--resume continues the run as its plan.yaml says: drop {' '.join(rest)}")
        return [], Path(folder)
    return tokens, None


@app.command(context_settings=_PLAN_ARGS, epilog=_FLAGS_EPILOG, rich_help_panel=None)
def run(ctx: typer.Context) -> None:
    """Build the variants, measure them side by side, print the comparison and write the report.

    variantbench run [PLAN.yaml] [--set key.path=value ...] [--variants fp32,int8] [--tasks N] [--out DIR] ...
    variantbench run --resume DIR   continues a run that was killed or failed halfway
    """
    from variantbench.pipeline.run import execute, resume_run

    console = Console(stderr=True)
    try:
        tokens, folder = _take_resume(list(ctx.args))
        if folder is not None:
            from variantbench.plan import Plan

            report = resume_run(folder, console)
            render_run(report, Plan.model_validate(report.plan), console)
            return
        plan, args = _resolve_plan(tokens)
        replay = _replay_folder(args.plan_file, plan, args)
        if replay is not None:
            console.print(
                f"[dim]replaying {args.plan_file} into {replay} (the original run stays as it is)[/dim]"
            )
            plan = plan.model_copy(update={"out": replay})
        report = execute(plan, console)
    except UserError as exc:
        _fail(str(exc))
        return
    render_run(report, plan, console)


def render_run(report: Report, plan: Plan, console: Console) -> None:
    """The console end of a run: the tables, the decision, warnings; exit 1 if a variant failed."""
    from variantbench.report.console import comparison_table, quality_table, task_table

    stdout = Console()
    if not stdout.is_terminal:
        stdout = Console(width=160)  # a file or pipe: don't squeeze the table to 80 columns
    timed = plan.is_timed
    if timed:
        stdout.print(comparison_table(report))
    stdout.print(quality_table(report))
    stdout.print(task_table(report, timed=timed))
    show_decision(stdout, report, plan.decision.profile)
    out = plan.out
    console.print(
        f"wrote {out / 'report.html'}, {out / 'report.json'}, {out / 'report.md'}, {out / 'report.csv'}, "
        f"{out / 'queries.jsonl'} and {out / 'plan.yaml'}"
    )
    for r in report.runs:
        if r.peak is not None:
            peak = f"{r.peak.peak_qps:.3g} queries/s" if r.peak.peak_qps else "none of the rates tried passed"
            console.print(f"{r.variant}: peak rate meeting the targets: {peak} ({len(r.peak.trials)} trials)")
        if r.status == "ok" and r.validity.verdict != "VALID":
            console.print(
                f"[yellow]{r.variant}: INVALID[/yellow] - {'; '.join(r.validity.reasons)}", highlight=False
            )
        if r.status == "ok" and r.target_qps is not None and (r.late_share or 0) > 0.01:
            console.print(
                f"[yellow]warning:[/yellow] {r.variant}: {r.late_share:.1%} of queries issued more than 1 ms late",
                highlight=False,
            )
    failed = [r for r in report.runs if r.status != "ok"]
    if failed:
        for r in failed:
            console.print(f"[red]{r.variant} failed:[/red] {r.error}", highlight=False)
        raise typer.Exit(1)


@app.command(context_settings=_PLAN_ARGS, epilog=_SEARCH_EPILOG)
def search(ctx: typer.Context) -> None:
    """Search recipe chains for the variants worth deploying: the Pareto front of the objectives.

    variantbench search [PLAN.yaml] --space SPACE.yaml [--objectives quality,tokens_per_s,peak_rss] [--budget N]
    [--out DIR] [plan flags: --tasks, --executor ray, ...]; every setting is the plan's search section
    """
    from variantbench.search.loop import run_search

    console = Console(stderr=True)
    try:
        plan, args = _resolve_plan(list(ctx.args), table=SEARCH_FLAGS, command="search")
        if not args.sets(("out",)) and args.plan_file is None:
            plan = plan.model_copy(update={"out": Path("variantbench-search")})
        outcome = run_search(plan, console)
    except UserError as exc:
        _fail(str(exc))
        return
    from variantbench.search.console import search_table

    stdout = Console() if Console().is_terminal else Console(width=160)
    stdout.print(search_table(outcome))
    front = outcome.front
    stdout.print(f"Pareto front ({len(front)}): " + (", ".join(t.variant for t in front) or "none yet"),
                 highlight=False, soft_wrap=True)  # fmt: skip
    console.print(f"wrote {outcome.out / 'search.html'}, {outcome.out / 'front.yaml'} (the front as a plan), "
                  f"{outcome.out / 'search.json'}, {outcome.out / 'search.journal'} (resumes) and the trials' "
                  f"report in {outcome.out}")  # fmt: skip


@app.command("plan", context_settings=_PLAN_ARGS, epilog=_FLAGS_EPILOG)
def plan_command(ctx: typer.Context) -> None:
    """Print the resolved plan (every default spelled out) without running it.

    variantbench plan [PLAN.yaml] [--set key.path=value ...] [--FLAG VALUE ...] [--show]
    """
    from variantbench.plan_file import dump_plan

    try:
        plan, _ = _resolve_plan(list(ctx.args), switches=("--show",))
    except UserError as exc:
        _fail(str(exc))
        return
    typer.echo(dump_plan(plan), nl=False)


def show_decision(out: Console, report: Report, profile: str | None) -> None:
    """The end of a run: the diagnosis of slower variants and the recommendation per profile."""
    from variantbench.report.markdown import summary_lines

    lines = [ln for ln in summary_lines(report) if ln.strip() and not ln.startswith("## ")]
    if profile and profile in report.recommendations:
        lines.append(f"chosen profile -> {report.recommendations[profile].summary}")
    for line in lines:
        out.print(line.replace("**", ""), highlight=False, soft_wrap=True)


@app.command()
def report(
    folder: Annotated[Path, typer.Argument(help="a run's output folder (report.json, queries.jsonl, raw/)")],
) -> None:
    """Recompute report.json and report.md from a run's query log and raw data alone."""
    from variantbench.pipeline.run import rebuild_report

    try:
        rebuilt = rebuild_report(folder)
    except UserError as exc:
        _fail(str(exc))
        return
    show_decision(Console(), rebuilt, (rebuilt.plan.get("decision") or {}).get("profile"))
    stopped = rebuilt.stopped()
    if stopped:
        Console(stderr=True).print("[yellow]the run did not finish (variantbench run --resume "
                                   f"{folder} goes on):[/yellow]\n  " + "\n  ".join(stopped), soft_wrap=True)  # fmt: skip
    Console(stderr=True).print(
        f"wrote {folder / 'report.html'}, {folder / 'report.json'}, {folder / 'report.md'} and "
        f"{folder / 'report.csv'}"
    )


def _ci(c: object) -> str:
    ratio, lo, hi = getattr(c, "ratio"), getattr(c, "ci_low"), getattr(c, "ci_high")  # noqa: B009
    if ratio is None:
        return "-"
    return f"{ratio:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else "")


def _compared(a: str, b: str, strict: bool, history: Path | None = None) -> Any:
    """B against A (run folders or history ids), or one line and exit; a loud warning when the
    machines differ."""
    from variantbench.compare import compare_runs, resolve

    try:
        (folder_a, variant_a), (folder_b, variant_b) = resolve(a, history), resolve(b, history)
        cmp = compare_runs(folder_a, folder_b, strict=strict, variant_a=variant_a, variant_b=variant_b)
    except UserError as exc:
        _fail(str(exc))
    if cmp.machine_differs:
        changed = sorted(k for k in cmp.machine_a if cmp.machine_a.get(k) != cmp.machine_b.get(k))
        Console(stderr=True).print(f"[bold red]WARNING: the runs were made on different machines ({', '.join(changed)} "
                                   "differ): their ratios mix the machines with the change[/bold red]", soft_wrap=True)  # fmt: skip
    return cmp


def _write_page(text: str, path: Path) -> None:
    """An HTML page written, or one line and exit."""
    from variantbench.report.pages import write_page

    try:
        write_page(text, path)
    except OSError as exc:
        _fail(f"cannot write {path}: {exc.strerror or exc}")
    Console(stderr=True).print(f"wrote {path}")


HISTORY_OPTION = typer.Option(
    "--history", help="the history file for history ids (default: <cache>/history.db)"
)


@app.command()
def compare(
    a: Annotated[str, typer.Argument(help="the baseline: a run folder or a history id")],
    b: Annotated[str, typer.Argument(help="compared with it: a run folder or a history id")],
    strict: Annotated[bool, typer.Option(help="refuse runs made on different machines")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the comparison here")] = None,
    html: Annotated[
        Path | None, typer.Option(help="write the HTML page here (default: B's folder/compare.html)")
    ] = None,
    history: Annotated[Path | None, HISTORY_OPTION] = None,
) -> None:
    """B against A, variant by variant: ratios B/A with 95% intervals, paired by sample; printed, and
    written as an HTML page with a forest plot."""
    from rich.table import Table

    from variantbench.compare import METRICS, write_json
    from variantbench.report.compare_page import render

    cmp = _compared(a, b, strict, history)
    table = Table(title=f"{cmp.b} against {cmp.a} (B/A)", title_justify="left")
    for col in ("variant", "metric", "B/A [95% CI]", "pairs", "verdict"):
        table.add_column(col)
    for c in cmp.changes:
        table.add_row(c.variant, c.metric, _ci(c), str(c.pairs), c.verdict)
    Console().print(table)
    Console().print("; ".join(f"{k}: {what}" for k, (what, _) in METRICS.items()), style="dim")
    if json_out is not None:
        write_json(cmp, json_out)
    _write_page(render(cmp.to_json()), html or Path(cmp.b) / "compare.html")


@app.command()
def check(
    b: Annotated[str, typer.Argument(help="the run to check: a run folder or a history id")],
    baseline: Annotated[str, typer.Option(help="the baseline: a run folder or a history id")],
    max_regression: Annotated[
        str, typer.Option(help="METRIC=PCT% per gated metric: latency, p99, tokens_per_s, quality")
    ] = "p99=5%,tokens_per_s=5%,quality=1%",  # fmt: skip
    strict: Annotated[bool, typer.Option(help="refuse runs made on different machines")] = False,
    history: Annotated[Path | None, HISTORY_OPTION] = None,
) -> None:
    """The CI gate: exit 1 when a metric of B regressed against the baseline beyond its threshold,
    its whole interval past it; 0 otherwise. One line per variant and metric."""
    from variantbench.compare import gate, parse_thresholds

    try:
        thresholds = parse_thresholds(max_regression)
    except UserError as exc:
        _fail(str(exc))
        return
    cmp = _compared(baseline, b, strict, history)
    rows = gate(cmp, thresholds)
    for c, limit, regressed in rows:
        word = "REGRESSED" if regressed else "ok"
        typer.echo(f"{word:9s} {c.variant} {c.metric}: B/A {_ci(c)} (threshold {limit:.0%})")
    failed = [c for c, _, regressed in rows if regressed]
    typer.echo(f"{len(failed)} of {len(rows)} gated metrics regressed" if rows else "nothing to gate")
    if failed:
        raise typer.Exit(1)


@app.command()
def history(
    model: Annotated[str | None, typer.Option(help="only this model (its name in the report)")] = None,
    variant: Annotated[str | None, typer.Option(help="only this variant")] = None,
    db: Annotated[
        Path | None, typer.Option("--history", help="the history file (default: <cache>/history.db)")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="at most this many rows, oldest first")] = None,
    plot: Annotated[bool, typer.Option(help="also write an HTML trend chart per metric")] = False,
    plot_out: Annotated[Path, typer.Option(help="where --plot writes")] = Path("history.html"),
) -> None:
    """List the recorded runs: one row per variant run, with its headline metrics and intervals;
    with --plot, a trend chart per metric as an HTML page."""
    from rich.table import Table

    from variantbench.history import History

    if db is not None and not db.is_file():
        _fail(f"no history at {db}")
    try:
        with History(db) as h:
            rows = h.rows(model=model, variant=variant, limit=limit)
            where = h.path
    except UserError as exc:
        _fail(str(exc))
        return
    table = Table(title=f"history: {where}", title_justify="left")
    for col in ("id", "time (UTC)", "model", "variant", "scenario", "p50 ms", "p99 ms", "tok/s per query [95% CI]",
                "quality", "machine", "code", "folder"):  # fmt: skip
        table.add_column(col, overflow="fold")

    def num(m: dict, key: str, fmt: str = ",.0f") -> str:
        v = (m.get(key) or {}).get("value")
        return "-" if v is None else format(v, fmt)

    for r in rows:
        m = r["metrics"]
        t = m.get("tokens_per_s_per_query") or {}
        tput = "-" if t.get("value") is None else f"{t['value']:.1f}" + (
            f" [{t['ci_low']:.1f}, {t['ci_high']:.1f}]" if t.get("ci_low") is not None else "")  # fmt: skip
        table.add_row(str(r["id"]), r["created_utc"], r["model_name"] or "-", r["variant"], r["scenario"] or "-",
                      num(m, "latency_p50_ms"), num(m, "latency_p99_ms"), tput, num(m, "quality_composite", ".3f"),
                      r["machine_fingerprint"], r["code_version"], r["folder"])  # fmt: skip
    Console().print(table)
    if not rows:
        Console(stderr=True).print("no runs recorded" + (" for that filter" if model or variant else ""))
    elif plot:
        from variantbench.report.trends import render

        _write_page(render(rows, str(where)), plot_out)


@app.command(context_settings=_PLAN_ARGS, epilog=_MONITOR_EPILOG)
def monitor(ctx: typer.Context) -> None:
    """Watch a live OpenAI-compatible server: a small probe run every --every seconds, its /metrics
    scraped, and a change-point detector (CUSUM) per metric that prints an ALERT line when one shifts.

    variantbench monitor URL [PLAN.yaml] [--every S] [--probes N] [--threshold ...]; the plan's monitor section
    """
    from variantbench.monitor.watch import Monitor

    try:
        plan, _ = _resolve_plan(list(ctx.args), table=MONITOR_FLAGS, command="monitor")
        mon = Monitor.from_plan(plan)
    except (UserError, OSError) as exc:
        _fail(str(exc))
        return
    url, every, baseline = mon.settings.url, mon.settings.every_s, mon.settings.baseline_probes
    console = Console(stderr=True)
    if mon.exporter.port is not None:
        console.print(f"the monitor's /metrics: http://127.0.0.1:{mon.exporter.port}/metrics")
    console.print(
        f"watching {url} every {every:g} s; the first {baseline} probes set the baseline; log: {mon.log}"
    )
    try:
        alerts = mon.watch()
    except KeyboardInterrupt:
        alerts = mon.alerts
    console.print(f"{len(alerts)} alert(s) over the watch; every probe is in {mon.log}")


@app.command()
def selftest(
    queries: Annotated[int, typer.Option(help="in-process queries through the null system")] = 200_000,
    seconds: Annotated[float, typer.Option(help="seconds per HTTP rate step")] = 3.0,
    http: Annotated[bool, typer.Option(help="also measure over HTTP against a local no-op server")] = True,
    senders: Annotated[
        int | None, typer.Option(help="sender processes over HTTP (default: the cores)")
    ] = None,
) -> None:
    """Measure the harness itself: in-process against an instant system, and over HTTP on 127.0.0.1."""
    from variantbench import selftest as st

    if queries < 1 or seconds <= 0:
        _fail("--queries and --seconds must be positive")
    out = Console()
    res = st.in_process(queries)
    out.print(
        f"in-process, null system, offline: {res.queries} queries at {res.queries_per_s:,.0f} queries/s "
        f"({res.overhead_us_per_query:.1f} us of harness per query)"
    )
    if not http:
        return
    from variantbench.loadgen.noop_server import ProcessServer

    def show(r: st.RateResult) -> None:
        out.print(
            f"  HTTP target {r.target_qps:>6.0f}/s: achieved {r.achieved_qps or 0:8.1f}/s, dispatch lag p99 "
            f"{r.lag_p99_ms or 0:7.3f} ms, late {r.late_share or 0:6.2%}, errors {r.errors}, latency p99 "
            f"{r.latency_p99_ms or 0:8.1f} ms -> {'sustained' if r.sustained else 'not sustained'}",
            highlight=False,
        )

    from variantbench.environment import usable_cores

    if senders is not None and senders < 1:
        _fail("--senders must be at least 1")
    with ProcessServer() as server:
        pinned = st.pin_apart(server.proc.pid)
        # the senders get the harness's cores (all but the server's)
        n = senders or usable_cores()
        out.print(f"{pinned}; {n} sender process(es)", highlight=False)
        j = st.host_jitter(seconds)
        out.print(
            f"host jitter on the harness's cores, a bare loop for {j.seconds:g} s: {j.stalls_over_1ms} stalls over "
            f"1 ms, {j.stalls_over_05ms} over 0.5 ms, longest {j.longest_ms:.2f} ms (the floor under dispatch lag)",
            highlight=False,
        )
        best, results = st.sustained_rate(server.url, seconds=seconds, report=show, senders=n)
    under5 = max((r.target_qps for r in results if st.held(r, 5.0)), default=None)
    out.print(
        "over HTTP (no-op OpenAI server on 127.0.0.1, streamed): highest sustained Poisson rate "
        + (f"{best:,.0f} queries/s" if best else "none of the rates tried")
        + " (achieved within 1% of target, p99 dispatch lag < 1 ms, no errors); with p99 lag < 5 ms: "
        + (f"{under5:,.0f} queries/s" if under5 else "none")
    )


@app.command("variants")
def list_variants(
    model: Annotated[
        str | None,
        typer.Option("--model", help="a Hugging Face folder or GGUF file: which recipes apply to it"),
    ] = None,
) -> None:
    """List the variant kinds that recipes can build, and the variants already built."""
    from variantbench.variants import known_kinds
    from variantbench.variants.build import list_built

    kinds = known_kinds()
    if model is not None:
        from variantbench.models import parse_model, prepare_model
        from variantbench.variants.support import describe_model, kinds_for

        folder = prepare_model(parse_model(model), status=lambda msg: typer.echo(msg, err=True))
        model_type, family = describe_model(folder)
        yes, no = kinds_for(family)
        backend = (f"our engine (family {family})" if family else
                   "the transformers fallback (no engine family: transformers' own generate, one request at a time)")  # fmt: skip
        typer.echo(f"{model}: model type {model_type}, run by {backend}")
        typer.echo("recipes that apply:")
        for kind in yes:
            typer.echo(f"  {kind:12s} {kinds[kind]}")
        typer.echo("recipes that do not apply: " + (", ".join(no) or "none"))
        return
    for kind, summary in kinds.items():
        typer.echo(f"{kind:12s} {summary}")
    built = list_built()
    typer.echo(f"\nbuilt ({len(built)}):" if built else "\nbuilt: none yet (variantbench build RECIPE)")
    for m in built:
        params = (
            f"{m['parameters'] / 1e6:7.1f}M params" if m.get("parameters") else f"{'(engine export)':>14s}"
        )
        typer.echo(
            f"  {m.get('name', '?'):40s} {params} {m.get('bytes_on_disk', 0) / 1e6:7.1f} MB "
            f"built in {m.get('build_s', 0):.0f} s  {m['path']}"
        )


@app.command()
def clean(
    everything: Annotated[
        bool, typer.Option("--all", help="also every built variant, fidelity reference and converted model")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list what would go, remove nothing")] = False,
) -> None:
    """Free cache space: interrupted builds and variants built with other library versions (--all: more)."""
    from variantbench.paths import cache_root
    from variantbench.variants.build import remove_entries, stale_entries

    entries = stale_entries(everything=everything)
    for path, size, why in entries:
        typer.echo(f"{'would remove' if dry_run else 'removing'} {path} ({size / 1e6:.1f} MB): {why}")
    total = sum(size for _, size, _ in entries)
    if dry_run:
        typer.echo(
            f"{len(entries)} entries, {total / 1e6:.1f} MB in {cache_root()} (dry run: nothing removed)"
        )
        return
    freed = remove_entries(entries)
    typer.echo(f"freed {freed / 1e6:.1f} MB in {cache_root()} ({len(entries)} entries)")


@app.command()
def build(
    recipes: Annotated[
        list[str], typer.Argument(help="variant chains, e.g. prune-heads:0.3+drop-layers:15+distill")
    ],
    model: Annotated[
        str | None, typer.Option(help="Hugging Face folder or .gguf file (default: bundled)")
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of the calibration and distillation text")] = 0,
) -> None:
    """Build variants into the cache without benchmarking them."""
    _need("local", "building variants")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from variantbench.models import parse_model, prepare_model
    from variantbench.paths import bytes_under
    from variantbench.variants.spec import VariantSpec, build_variant

    console = Console(stderr=True)

    def say(message: str) -> None:
        console.print(f"[dim]{message}[/dim]")

    try:
        specs = [VariantSpec.parse(name) for name in recipes]
        base = str(prepare_model(parse_model(model), status=say))
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:  # fmt: skip
            for spec in specs:
                if not spec.needs_build:
                    console.print(f"{spec.name}: applied when loaded (nothing to build)")
                    continue
                task = progress.add_task(f"{spec.name}: building", total=None)

                def tick(phase: str, done: int, total: int, task: int = task, name: str = spec.name) -> None:
                    progress.update(task, description=f"{name}: {phase}", completed=done, total=total)

                art = build_variant(base, spec, seed=seed, say=say, progress=tick)
                progress.update(task, description=f"{spec.name}: built", completed=1, total=1)
                how = f"built in {art.build_s:.0f} s" + (
                    "" if art.built_now else " (earlier; from the cache)"
                )
                if art.engine_path:  # an export for another engine (of the built model, if any)
                    size = bytes_under(Path(art.engine_path))
                    console.print(f"{spec.name}: {size / 1e6:.1f} MB, {how} -> {art.engine_path}", highlight=False,
                                  soft_wrap=True)  # fmt: skip
                    continue
                m = art.manifest or {}
                at_load = "+".join(r.spec() for r in spec.load_chain)
                extra = f" (+ {at_load} at load)" if at_load else ""
                console.print(
                    f"{m['name']}{extra}: {m['parameters'] / 1e6:.1f}M params (from {m['parameters_before'] / 1e6:.1f}M), "
                    f"{m['bytes_on_disk'] / 1e6:.1f} MB, {how} -> {art.source_dir}",
                    highlight=False, soft_wrap=True,
                )  # fmt: skip
                if "distill" in m["notes"]:
                    d = m["notes"]["distill"]
                    console.print(
                        f"  distillation: held-out KL to the teacher {d['held_out_kl_before']:.3f} -> "
                        f"{d['held_out_kl_after']:.3f} nats; loss {d['first_loss']:.3f} -> {d['last_loss']:.3f}",
                        highlight=False,
                    )  # fmt: skip
    except UserError as exc:
        _fail(str(exc))


@app.command(context_settings=_PLAN_ARGS, epilog=_SERVE_EPILOG)
def serve(ctx: typer.Context) -> None:
    """Serve variants behind an OpenAI-compatible API with continuous batching and priorities.

    variantbench serve [PLAN.yaml] [--variants fp32,int8] [--port 8000] [--router int8,fp32] ...; the plan's serve
    and router sections
    """
    _need("serve", "serving")
    from variantbench.serving.commands import serve as serve_plan

    console = Console(stderr=True)
    try:
        plan, _ = _resolve_plan(list(ctx.args), table=SERVE_FLAGS, command="serve")
        serve_plan(plan, say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False),
                   announce=lambda m: console.print(m, highlight=False),
                   warn=lambda m: console.print(f"[yellow]{m}[/yellow]", highlight=False))  # fmt: skip
    except UserError as exc:
        _fail(str(exc))


@app.command(context_settings=_PLAN_ARGS, epilog=_ROUTE_EPILOG)
def route(ctx: typer.Context) -> None:
    """Calibrate the tiered router and compare it with always-light and always-standard on held-out samples.

    variantbench route [PLAN.yaml] [--router int8,fp32] [--tasks 40] [--standard-share 0.2]; the plan's router section
    """
    _need("serve", "the tiered router")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from variantbench.serving.commands import route as route_plan
    from variantbench.serving.host import router_pair

    console = Console(stderr=True)
    out = Console()
    try:
        plan, _ = _resolve_plan(list(ctx.args), table=ROUTE_FLAGS, command="route")
        light, standard = router_pair(plan.router.tiers or "int8,fp32")
        standard_share = plan.router.standard_share
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:  # fmt: skip
            task = progress.add_task("answering held-out samples with both variants", total=None)
            result, tiered = route_plan(plan, say=lambda m: console.print(f"[dim]{m}[/dim]", highlight=False),
                                        progress=lambda d, t: progress.update(task, completed=d, total=t))  # fmt: skip
    except UserError as exc:
        _fail(str(exc))
        return
    table = Table(title=f"tiered router {light} -> {standard}: {result['held_out']} held-out samples, "
                        f"target standard share {standard_share:g}, realized {result['realized_share']:.2f}")  # fmt: skip
    for col in (
        "policy",
        "standard share",
        "quality (composite)",
        "compute s / request",
        "cost / 1k requests",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, p in result["policies"].items():
        q = "n/a" if p["quality"] is None else f"{p['quality']:.3f}"
        table.add_row(name, f"{p['standard_share']:.2f}", q, f"{p['compute_s_per_request']:.3f}",
                      f"{p['cost_per_1k_requests']:.4f}")  # fmt: skip
    out.print(table)
    out.print(f"routing overhead: {result['routing_s_per_request'] * 1e3:.1f} ms per request "
              f"(light-model prefill of the prompt's last {tiered.window} tokens), included in the router's cost")  # fmt: skip


def main() -> None:
    from variantbench.quiet import quiet_libraries

    quiet_libraries()
    try:
        app()
    except UserError as exc:  # anything that escaped a command
        from rich.markup import escape

        Console(stderr=True).print(f"[bold red]error:[/bold red] {escape(str(exc))}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
