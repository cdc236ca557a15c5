"""The search's console table: every trial, the front marked, values in the objectives' units."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from variantbench.search.loop import Outcome


def search_table(outcome: Outcome) -> Table:
    o = outcome.objectives
    table = Table(title=f"variant search: {len(outcome.trials)} trials (* on the Pareto front)")
    table.add_column("#", justify="right")
    table.add_column("variant", overflow="fold")
    table.add_column("state")
    for x in o:
        table.add_column(f"{x.label} ({'max' if x.direction == 'maximize' else 'min'})", justify="right")
    table.add_column("note", overflow="fold")
    rows = sorted(outcome.trials, key=lambda t: t.number)
    if outcome.reference is not None:
        rows = [outcome.reference, *rows]
    for t in rows:
        values = [x.shown(t.values.get(x.name)) for x in o]
        number = "ref" if t.number < 0 else str(t.number)
        table.add_row(number, ("* " if t.front else "") + t.variant, t.state, *values, t.note)
    return table
