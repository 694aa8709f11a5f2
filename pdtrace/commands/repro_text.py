"""The text every test `pdtrace repro --cause N` writes shares (issue 61): the recorded constants, the docstring's
fields and reflow to vLLM's 88 columns, the provenance paragraph (where the trace came from, a labelled fault), and
the file's assembly. The builders (``repro_standalone``) fill them from the trace's facts (``repro_facts``). This
module never imports vLLM."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from pdtrace.commands import repro_templates as tpl
from pdtrace.errors import PdtraceError

CONFIGS = Path(__file__).resolve().parent.parent / "testing" / "configs"
SPEC = {"eagle": "eagle", "eagle3": "eagle", "mtp": "eagle", "draft_model": "draft_model", "ngram": "ngram",
         "dflash": "dflash", "": ""}
DRAFT = {"eagle": "tiny-eagle", "dflash": "tiny-dflash"}


def tiny_config(name: str) -> Any:
    """A tiny HF config (the test writes it as config.json)."""
    return json.loads((CONFIGS / name / "config.json").read_text())


WIDTH = 88  # vLLM's line length (ruff): the written file's docstring and constants keep to it


def constants(**kv: Any) -> str:
    import pprint

    out = []
    for k, v in kv.items():
        lead = f"{k} = "
        text = pprint.pformat(v, width=WIDTH - len(lead), compact=True, sort_dicts=False)
        out.append(lead + text.replace("\n", "\n" + " " * len(lead)) + "\n")
    return "".join(out)


ITEM = ("Trace:", "Root cause", "Recorded:", "- ")


def reflow(doc_text: str) -> str:
    """The written docstring filled to WIDTH: each paragraph, and within one each labelled line (Trace:, Root cause,
    Recorded:) and list item on its own, URLs and paths kept whole."""
    import textwrap

    head = doc_text.partition('"""')[2].rpartition('"""')[0]  # (between the opening and closing quotes)
    out = []
    for para in head.strip("\n").split("\n\n"):
        items: list[str] = []
        for line in para.split("\n"):
            if not items or line.startswith(ITEM):
                items.append(line.strip())
            else:
                items[-1] += " " + line.strip()
        out.append("\n".join(textwrap.fill(x, WIDTH, subsequent_indent="  " if x.startswith("- ") else "",
                                            break_on_hyphens=False, break_long_words=False) for x in items))
    return '"""' + "\n\n".join(out) + '\n"""\n'


def doc_base(trace: str, cause: Any, vllm: str) -> dict[str, Any]:
    """The docstring fields every written test has: when, from which trace and cause, on which vLLM."""
    return {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "trace": trace,
            "n": cause.n, "title": cause.title, "vllm": vllm or "?"}


def common(s: dict[str, Any], trace: str, cause: Any, vllm: str, window: int = 0,
            groups: bool = False) -> tuple[dict, dict]:
    """The docstring fields and the constants every written test has (spec, block size, async, the configs, the
    group's kind). ``window``: a sliding-window group's window, where the finding names it. ``groups``: the builder
    writes the recorded KV cache groups itself (full attention, one block size: its facts checked them)."""
    spec = SPEC.get(s["spec_method"])
    if spec is None:
        raise PdtraceError(f"{trace}: cause {cause.n} was recorded with speculative method {s['spec_method']!r}, "
                           f"which repro cannot rebuild yet (eagle-like methods, DFlash and ngram); attach the trace "
                           f"instead")
    if not groups and (len(s["block_sizes"]) > 1 or s["hybrid"]):
        raise PdtraceError(f"{trace}: cause {cause.n} was recorded with {len(s['block_sizes'])} KV cache groups "
                           f"({', '.join(s['group_kinds'])}); repro rebuilds one full-attention group so far")
    kind = s["group_kinds"][0] if s["group_kinds"] else "FullAttentionSpec"
    if not groups and kind != "FullAttentionSpec" and not (kind == "SlidingWindowSpec" and window):
        raise PdtraceError(f"{trace}: cause {cause.n} was recorded with a {kind} group; repro rebuilds a "
                           f"full-attention group (a sliding-window one where the finding names its window) so far")
    k = s["num_spec_tokens"] if spec else 0
    doc = {**doc_base(trace, cause, vllm), "bs": s["block_sizes"][0],
           "async_": s["async_scheduling"],
           "method_words": f"{s['spec_method']} with {k} speculative tokens" if spec else "no speculative decoding"}
    const = {"BLOCK_SIZE": s["block_sizes"][0], "SPEC_METHOD": spec, "NUM_SPEC_TOKENS": k,
             "ASYNC_SCHEDULING": s["async_scheduling"], "TARGET": tiny_config("tiny-llama"),
             "DRAFT": tiny_config(DRAFT[spec]) if spec in DRAFT else None,
             "SLIDING_WINDOW": window if kind == "SlidingWindowSpec" else 0}
    return doc, const


def provenance(header: dict, c: Any, faults: list[str], vllm: str, fault_words: str = "") -> str:
    """Where the trace came from, the upstream links `check` names, and a labelled fault's warning: the paragraph
    that closes a written test's docstring."""
    import textwrap

    said = [f"The trace: {header.get('origin') or 'a recording'}"
            + (f" {header['scenario']!r}" if header.get("scenario") else "")
            + (f", written {header['created']}" if header.get("created") else "")
            + (f" on host {header['host']!r}" if header.get("host") else "") + "."]
    if header.get("_damaged"):
        said.append(f"The trace was damaged ({header['_damaged']}) and read with --lenient: the facts above are those "
                    f"of the events that survived.")
    if c.upstream:
        said.append("Upstream, as `pdtrace check` names it: " + ", ".join(c.upstream) + ".")
    if faults and fault_words:  # (a class whose fault made the recorded layout, which the test rebuilds)
        said.append(f"The trace's layout came from a LABELLED FAULT put on vLLM {vllm or '?'} ({', '.join(faults)}): "
                    + fault_words)
    elif faults:
        said.append(f"The trace's finding came from a LABELLED FAULT put on vLLM {vllm or '?'} ({', '.join(faults)}): "
                    f"that vLLM's own code has the fix, so this test passes on it; it fails on the releases whose own "
                    f"code has the bug (above).")
    return "\n" + textwrap.fill(" ".join(said), WIDTH, break_on_hyphens=False, break_long_words=False) + "\n"


def short(link: str) -> str:
    """'https://github.com/vllm-project/vllm/issues/51571' -> 'vLLM #51571' (other text as it is)."""
    return f"vLLM #{link.rsplit('/', 1)[-1]}" if link.startswith("https://github.com/vllm-project/vllm/") else link


def faults_of(events: list, header: dict | None = None) -> list[str]:
    """The labelled faults the trace was made with: its fault.inject events' rules, and the rule names its header's
    provenance lists (a scenario whose fault is not an injected event: the metadata order, the racy read)."""
    named = [str(f).split(":", 1)[0] for f in ((header or {}).get("provenance") or {}).get("faults") or []]
    return sorted({str(e.get("rule")) for e in events if e["ev"] == "fault.inject"}
                  | {f for f in named if f and " " not in f})


def close_doc(doc_text: str, events: list, header: dict, c: Any, vllm: str) -> str:
    """The docstring with the provenance paragraph before its closing quotes."""
    head, _, _ = doc_text.rstrip().rpartition('"""')
    return reflow(head + provenance(header, c, faults_of(events, header), vllm, LAYOUT_FAULTS.get(c.mechanism, "")) + '"""')


def write_file(doc_tpl: str, doc: dict[str, Any], const: dict[str, Any], test: str, events: list = (), header: Any = None,
          c: Any = None) -> str:
    text = doc_tpl.format(**doc)
    if c is not None:
        text = close_doc(text, list(events), header or {}, c, doc["vllm"])
    return (text + tpl.PREAMBLE + f"# recorded: {doc['trace']}, root cause {doc['n']}\n"
            + constants(**const) + tpl.HELPERS + test)


# mechanism -> what a labelled fault in its trace means, where the fault made the layout the test rebuilds (so the
# test fails on the trace's own vLLM too)
LAYOUT_FAULTS = {
    "never-crossed/drafter-group": "vLLM 0.32.0's and 0.33.0's own builders leave no drafter group out of the transfer (vLLM main's "
                                   "layouts for draft-model groups do, #54926). This test rebuilds the recorded layout, "
                                   "so it fails on that vLLM too: what it tests is how the scheduler and the connector "
                                   "treat such a layout.",
}
