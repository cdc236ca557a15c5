"""User workloads from local files: JSONL prompts, SQuAD, and CNN/DailyMail-style summarization.

Shapes, detected per record:

- prompt records: ``{"prompt": ...}`` or chat ``{"messages": [{"role", "content"}, ...]}``, with
  optional ``reference`` (string), ``task`` and ``max_tokens``;
- SQuAD: ``{"context", "question", "answers"}`` where answers is SQuAD's ``[{"text": ...}]``, the
  Hugging Face ``{"text": [...]}`` or a list of strings; also the official nested SQuAD JSON file
  (``{"data": [{"paragraphs": [{"context", "qas": [...]}]}]}``);
- summarization: ``{"article", "highlights"}`` (CNN/DailyMail), in JSONL or CSV;
- ShareGPT: ``{"conversations": [{"from": "human", "value"}, {"from": "gpt", "value"}, ...]}`` (the
  first human turn is the prompt, the first model turn after it the reference), in JSON or JSONL.

Files: ``.jsonl`` (one record per line), ``.json`` (a list of records, or SQuAD's nested file),
``.csv`` (a header row; columns as above). A bad record is reported with its line (or entry)
number and what is wrong; unless the caller skips bad records, any bad record stops the run before
anything is measured.

Read as hostile input (issue 41): records split on ``\n`` only (``str.splitlines`` also split on
U+2028 and U+0085, which JSON allows inside a string, so one record became three bad ones); every
string is checked for valid Unicode (an escaped lone surrogate loaded, then crashed the run at its
first log write) and for NUL characters; nesting beyond ``MAX_DEPTH`` and a field over
``MAX_FIELD_CHARS`` are a bad record, not a ``RecursionError`` or a ``csv.Error`` traceback.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field, replace
import io
import json
from pathlib import Path
from typing import Any

from variantbench.errors import UserError
from variantbench.workloads.base import MAX_NEW_TOKENS, TASKS, Sample, TokenCounter, Workload

QA_PROMPT = "Read the passage and answer the question with a short phrase taken from it.\n\nPassage: {context}\n\nQuestion: {question}"
SUMMARY_PROMPT = "Summarize this article in three sentences.\n\nArticle: {article}"
SUMMARY_MAX_TOKENS = 96
ROLES = ("system", "user", "assistant", "tool", "developer")


MAX_DEPTH = 64  # nesting of a record (ShareGPT's turns are 3 deep)
MAX_FIELD_CHARS = 4 << 20  # one field: a whole book is under 4 MiB of text; CNN/DailyMail's longest ~12 KB


class BadRecord(ValueError):
    """What is wrong with one record (the caller adds where it is)."""


def check_strings(value: Any, where: str = "", depth: int = 0) -> None:
    """Every string in ``value`` valid Unicode, free of NULs and at most ``MAX_FIELD_CHARS``; nesting
    at most ``MAX_DEPTH``. BadRecord names the field (``messages[1].content``)."""
    if depth > MAX_DEPTH:
        raise BadRecord(f"nested more than {MAX_DEPTH} deep")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRecord(f"'{where}' is not valid Unicode (a lone surrogate)") from None
        if "\x00" in value:
            raise BadRecord(f"'{where}' holds a NUL character")
        if len(value) > MAX_FIELD_CHARS:
            raise BadRecord(f"'{where}' is over {MAX_FIELD_CHARS >> 20} Mi characters")
    elif isinstance(value, dict):
        for key, item in value.items():
            name = key if isinstance(key, str) else str(key)
            check_strings(name, f"{where}.{name}" if where else name, depth + 1)
            check_strings(item, f"{where}.{name}" if where else name, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_strings(item, f"{where}[{i}]", depth + 1)


def _loads(text: str) -> Any:
    """JSON with no NaN/Infinity, and nesting too deep for the parser as a BadRecord."""
    try:
        return json.loads(text)
    except RecursionError:
        raise BadRecord(f"nested more than {MAX_DEPTH} deep") from None


@dataclass
class FileReport:
    good: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line or entry number, reason)


def _text(rec: dict[str, Any], key: str) -> str:
    value = rec.get(key)
    if not isinstance(value, str) or not value.strip():
        raise BadRecord(f"'{key}' must be a non-empty string")
    return value


def _answers(value: Any) -> list[str]:
    if isinstance(value, dict) and "text" in value:
        value = value["text"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise BadRecord("'answers' must be a list of answers or SQuAD's {'text': [...]}")
    out = []
    for a in value:
        text = a.get("text") if isinstance(a, dict) else a
        if not isinstance(text, str):
            raise BadRecord("every answer needs a 'text' string")
        if text.strip():
            out.append(text.strip())
    return out


def record_to_sample(rec: Any, sid: str) -> Sample:
    """One record in any of the accepted shapes -> a Sample; BadRecord says what is wrong."""
    if not isinstance(rec, dict):
        raise BadRecord(f"expected a JSON object, got {type(rec).__name__}")
    check_strings(rec)
    max_tokens = rec.get("max_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise BadRecord("'max_tokens' must be a positive integer")
    if "context" in rec and "question" in rec:
        answers = _answers(rec.get("answers", []))
        prompt = QA_PROMPT.format(
            context=_text(rec, "context").strip(), question=_text(rec, "question").strip()
        )
        reference = answers[0] if answers else ""
        return Sample(sid, "qa", prompt, reference, max_tokens or MAX_NEW_TOKENS["qa"],
                      alternatives=tuple(answers[1:]))  # fmt: skip
    if "conversations" in rec:
        return _sharegpt(rec, sid, max_tokens)
    if "article" in rec:
        highlights = rec.get("highlights", "")
        if not isinstance(highlights, str):
            raise BadRecord("'highlights' must be a string")
        prompt = SUMMARY_PROMPT.format(article=_text(rec, "article").strip())
        return Sample(sid, "summarization", prompt, highlights.strip(), max_tokens or SUMMARY_MAX_TOKENS)
    task = rec.get("task", "custom")
    if not isinstance(task, str) or task not in (*TASKS, "custom"):
        raise BadRecord(f"'task' must be one of {', '.join((*TASKS, 'custom'))}")
    reference = rec.get("reference", "")
    if not isinstance(reference, str):
        raise BadRecord("'reference' must be a string")
    cap = max_tokens or MAX_NEW_TOKENS.get(task, 64)
    if "messages" in rec:
        messages = rec["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRecord("'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise BadRecord(f"messages[{i}] needs a 'role' ({', '.join(ROLES)}) and a 'content' string")
        msgs = tuple({"role": m["role"], "content": m["content"]} for m in messages)
        flat = "\n".join(m["content"] for m in msgs)
        return Sample(sid, task, flat, reference.strip(), cap, messages=msgs)
    if "prompt" not in rec:
        raise BadRecord(
            "needs 'prompt', 'messages', SQuAD's 'context'+'question', 'article'+'highlights' or "
            "ShareGPT's 'conversations'"
        )
    return Sample(sid, task, _text(rec, "prompt"), reference.strip(), cap)


SHAREGPT_HUMAN = ("human", "user")
SHAREGPT_MODEL = ("gpt", "assistant", "chatgpt", "bing", "bard", "model")


def _sharegpt(rec: dict[str, Any], sid: str, max_tokens: int | None) -> Sample:
    """ShareGPT's ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``
    (vLLM's benchmark dataset): the first human turn is the prompt, the first model turn after it
    the reference, as ``vllm bench serve --dataset-name sharegpt`` takes them."""
    turns = rec["conversations"]
    if not isinstance(turns, list):
        raise BadRecord("'conversations' must be a list of {'from', 'value'} turns")
    for i, t in enumerate(turns):
        if (
            not isinstance(t, dict)
            or not isinstance(t.get("from"), str)
            or not isinstance(t.get("value"), str)
        ):
            raise BadRecord(f"conversations[{i}] needs a 'from' string and a 'value' string")
    first = next(
        (i for i, t in enumerate(turns) if t["from"].lower() in SHAREGPT_HUMAN and t["value"].strip()), None
    )
    if first is None:
        raise BadRecord("conversations has no human turn")
    reply = next((t["value"] for t in turns[first + 1 :] if t["from"].lower() in SHAREGPT_MODEL), "")
    prompt = turns[first]["value"].strip()
    # a plain prompt, as vLLM sends it to /v1/completions; with api: chat it becomes the user turn
    return Sample(sid, "generation", prompt, reply.strip(), max_tokens or MAX_NEW_TOKENS["generation"])


def _records(path: Path) -> list[tuple[int, Any]]:
    """(line or entry number, parsed record or the BadRecord) for each record of the file."""
    suffix = path.suffix.lower()
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if suffix == ".csv":
        return _csv_rows(path, raw)
    if suffix == ".json":
        try:
            data = _loads(raw)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        except BadRecord as exc:
            raise UserError(f"{path}: {exc}") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):  # official SQuAD
            out: list[tuple[int, Any]] = []
            for article in data["data"]:
                for para in article.get("paragraphs", []) if isinstance(article, dict) else []:
                    for qa in para.get("qas", []):
                        if qa.get("is_impossible"):
                            continue  # SQuAD 2.0's unanswerable questions have no reference span
                        out.append((len(out) + 1, {"context": para.get("context"), **qa}))
            return out
        if isinstance(data, list):
            return [(i + 1, rec) for i, rec in enumerate(data)]
        raise UserError(f"{path}: a .json workload must be a list of records or a SQuAD file")
    out = []
    for number, line in enumerate(raw.split("\n"), start=1):  # JSON Lines: "\n" ends a record, nothing else
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            out.append((number, _loads(line)))
        except json.JSONDecodeError as exc:
            out.append((number, BadRecord(f"not valid JSON ({exc.msg} at column {exc.colno})")))
        except BadRecord as exc:
            out.append((number, exc))
    return out


def _csv_rows(path: Path, raw: str) -> list[tuple[int, Any]]:
    """The rows of a CSV file, a field up to ``MAX_FIELD_CHARS`` (the csv module's own limit is 128 KiB)."""
    limit = csv.field_size_limit()
    csv.field_size_limit(MAX_FIELD_CHARS)
    reader = csv.DictReader(io.StringIO(raw, newline=""))
    try:
        return [(reader.line_num, row) for row in reader]  # the line where the row ends
    except csv.Error as exc:
        raise UserError(f"{path}: line {reader.line_num}: {exc}") from None
    finally:
        csv.field_size_limit(limit)


def load_workload_file(
    path: str | Path,
    skip_bad: bool = False,
    counter: TokenCounter | None = None,
    warn: Any = None,
) -> Workload:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"workload file not found: {path}")
    unit = "entry" if path.suffix.lower() == ".json" else "line"
    samples: list[Sample] = []
    report = FileReport()
    for number, rec in _records(path):
        try:
            if isinstance(rec, BadRecord):
                raise rec
            sample = record_to_sample(rec, f"{path.stem}-{number}")
        except BadRecord as exc:
            report.bad.append((number, str(exc)))
            continue
        if counter is not None:
            sample = replace(sample, input_tokens=counter(sample.prompt))
        samples.append(sample)
    total = len(samples) + len(report.bad)
    if report.bad:
        first = "; ".join(f"{unit} {n}: {why}" for n, why in report.bad[:3])
        more = f" (and {len(report.bad) - 3} more)" if len(report.bad) > 3 else ""
        if not skip_bad:
            raise UserError(
                f"{path}: {len(report.bad)} bad of {total} records: {first}{more}; "
                "fix them or pass --skip-bad-lines to run on the good ones"
            )
        if warn is not None:
            warn(f"{path}: skipping {len(report.bad)} bad of {total} records: {first}{more}")
    if not samples:
        raise UserError(f"{path}: no usable records")
    info = {"source": str(path), "skipped_records": [{unit: n, "reason": why} for n, why in report.bad],
            "counted_with": "tokenizer" if counter else None}  # fmt: skip
    return Workload(name=path.stem, seed=0, samples=tuple(samples), info=info)
