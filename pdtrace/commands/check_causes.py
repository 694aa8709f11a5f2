"""`pdtrace check`'s root causes (``pdtrace.detectors.causes``) in each format: the text's first
screen, the markdown a maintainer pastes into a GitHub issue, the JSON ``causes``."""

from __future__ import annotations

import shlex
from typing import Any, Callable

import orjson

from ..detectors.causes import Cause, issue_refs, source_link

LineFn = Callable[[str, int, str, "str | None"], list[str]]


def again(trace: str, *, lenient: bool = False, request: str | None = None, only: list[str] | tuple = ()) -> str:
    """The `pdtrace check` command that reads the trace as this one did (its flags kept), for the
    hints that say how to list more."""
    parts = ["pdtrace", "check", trace] + (["--lenient"] if lenient else []) + \
        (["--request", request] if request else []) + [x for k in only for x in ("--only", k)]
    return " ".join(shlex.quote(str(p)) for p in parts)


def text_lines(causes: list[Cause], trace: str, line: Callable[..., list[str]], width: int,
               asked: int | None = None) -> list[str]:
    """One block per cause: its title, its counts, the first example, where in vLLM, upstream and
    how to list all of its findings."""
    if not causes:
        return []
    out = ["", f"root cause{'s' if len(causes) > 1 else ''}:"]
    if len(causes) > 1 and asked is None:  # each in two or three lines: every cause on the first screen
        for c in causes:
            out += line(f"cause {c.n}: {c.severity.upper()} {c.kind}: {c.title}", width, "  ", "    ")
            bits = [c.counts_text()]
            if c.where:
                w = c.where[0]
                bits.append(f"{w['file'].rsplit('/', 1)[-1]}:{w['line']} {w['function'].rsplit('.', 1)[-1]}")
            if c.upstream:
                bits.append(issue_refs(c))
            bits.append(f"first [{c.first['index'] + 1}]")
            out += line("; ".join(bits), width, "    ", "      ")
        out += line(f"each in full (vLLM's files, upstream links, all its findings): {trace} --cause N", width,
                    "  ", "    ")
        return out
    for c in causes:
        if asked is not None and c.n != asked:
            continue
        out += line(f"cause {c.n}: {c.severity.upper()} {c.kind}: {c.title}", width, "  ", "    ")
        out += line(c.counts_text(), width, "    ", "      ")
        # the first finding (the block, the row, the copy) before vLLM's files: on an 80x24 screen it is named
        first = c.first
        ex = " ".join(x for x in (f"request {first['req']}" if first.get("req") else "",
                                  f"step {first['step']}" if first.get("step") is not None else "") if x)
        more = f"{trace} --cause {c.n}" if len(c.findings) > 1 and asked is None else ""
        what = str(first.get("title") or "")
        said = f"request {first['req']} step {first['step']}: " if first.get("req") and first.get("step") is not None \
            else None
        if said and what.startswith(said):  # (the finding's title opens with what ex already says)
            what = what[len(said):]
        elif first.get("req") and what.startswith(f"request {first['req']}: "):
            what = what[len(f"request {first['req']}: "):]
        elif first.get("req") and what.startswith(f"{first['req']} "):  # (the id once: "request X step N: read ...")
            what = what[len(f"{first['req']} "):]
        out += line(f"first: finding [{first['index'] + 1}]" + (f", {ex}" if ex else "") + (f": {what}" if what else ""),
                    width, "    ", "      ")
        if c.where:
            # (items apart by "; ": wrapped, a function never reads as the next file's)
            out += line(f"{c.where_words}: " + "; ".join(f"{w['file']}:{w['line']} {w['function'].rsplit('.', 1)[-1]}"
                                                for w in c.where), width, "    ", "      ")
        if c.upstream:
            out += line("upstream: " + ", ".join([c.upstream[0], *("#" + u.rsplit("/", 1)[-1] for u in c.upstream[1:])]),
                        width, "    ", "      ")
        if more:  # (the command on a line of its own, never wrapped: a command cut in two cannot be pasted)
            out += [f"    all {len(c.findings)}:", f"      {more}"]
    return out


def cause_of(causes: list[Cause]) -> dict[int, Cause]:
    """finding index -> its cause."""
    return {i: c for c in causes for i in c.findings}


def json_causes(causes: list[Cause], vllm: str) -> list[dict[str, Any]]:
    out = []
    for c in causes:
        d = c.to_dict()
        d["where"] = [{**w, "url": source_link(w, vllm)} for w in c.where]
        out.append(d)
    return out


def markdown(causes: list[Cause], findings: list[Any], command: str, header: dict, versions: dict,
             vllm: str) -> list[str]:
    """The causes, one worked example each, the commands that reproduce the check; the finding
    table is the caller's (under <details>)."""
    out: list[str] = []
    for c in causes:
        out += [f"### Cause {c.n}: {c.title}", "",
                f"`{c.kind}` ({c.severity}): {c.counts_text()}.", ""]
        if c.where:
            out += [("Where in vLLM " if c.where_words == "in vLLM" else "Where vLLM saw it, ") + (vllm or "") + ": "
                    + ", ".join(
                f"[`{w['file']}:{w['line']}`]({source_link(w, vllm)}) (`{w['function']}`)" for w in c.where) + ".", ""]
        if c.upstream:
            out += [f"Upstream: {', '.join(f'[{r}]({u})' for r, u in zip(issue_refs(c).split(', '), c.upstream))}.",
                    ""]
        f = findings[c.first["index"]]
        get = (lambda k: f.get(k)) if isinstance(f, dict) else (lambda k: getattr(f, k))
        data = get("data") or {}
        small = {k: v for k, v in data.items() if not isinstance(v, (list, dict)) or len(orjson.dumps(v)) < 120}
        out += [f"Example (finding {c.first['index'] + 1} of `pdtrace check`): **{_esc(get('title'))}**", "",
                "> " + str(get("explanation")).replace("\n", " "), "",
                "<details><summary>its data</summary>", "", "```json",
                orjson.dumps(small, option=orjson.OPT_NON_STR_KEYS).decode(), "```", "",
                "</details>", ""]
    cmd = header.get("cmd") or []
    out += ["### Reproduce", "", "```sh", command]
    out += [f"{command} --cause {c.n}" for c in causes[:3]]
    out += ["```", ""]
    if cmd:
        shown = " ".join(shlex.quote(str(x)) for x in cmd)
        out += ["Recorded command" + (" (first process)" if header.get("merged_from") else "") + ":", "", "```sh",
                shown if len(shown) < 1200 else shown[:1200] + " ...", "```", ""]
    return out


def _esc(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def untagged(f: Any) -> str:
    """A finding's title without the request and step its row's columns already give."""
    t = f.title
    for head in (f"request {f.req} step {f.step}: ", f"request {f.req}: ", f"step {f.step}: "):
        if t.startswith(head):
            return t[len(head):]
    return t


def short(title: str, n: int = 110) -> str:
    return title if len(title) <= n else title[:n - 3] + "..."

