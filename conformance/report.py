"""The report: one row per case with each measured figure beside its bound; text, Markdown and JSON."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .metrics import METRICS

_FMT = {"max_abs": "{:.2e}", "rel_l2": "{:.2e}", "cosine": "{:.6f}", "top1": "{:.3f}", "kl": "{:.2e}"}
_BOUND_FMT = {"max_abs": "{:g}", "rel_l2": "{:g}", "cosine": "{:g}", "top1": "{:g}", "kl": "{:g}"}


@dataclass
class CaseResult:
    backend: str
    model: str
    config: str            # "precision/weights[ extra]"
    case: str
    precision: str = ""
    weights: str = ""
    extra: dict = field(default_factory=dict)
    tolerance: str = ""    # the row of tolerances.py the figures answer to
    metrics: dict = field(default_factory=dict)
    bounds: dict = field(default_factory=dict)
    failed: list = field(default_factory=list)   # names of the metrics out of bound
    error: str = ""        # the case could not be judged on numbers: a crash or a broken contract
    note: str = ""
    seconds: float = 0.0
    against: str = "fp32 ref"   # or "own weights": the reference on the backend's own dequantized weights

    @property
    def passed(self) -> bool:
        return not self.failed and not self.error


@dataclass
class Report:
    results: list[CaseResult] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)     # {"backend", "config", "reason"}
    meta: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    def to_dict(self) -> dict:
        """Plain JSON: non-finite figures (a backend returning nan) become the strings "nan"/"inf"."""
        results = []
        for r in self.results:
            d = asdict(r)
            d["metrics"] = {k: v if math.isfinite(v) else str(v) for k, v in r.metrics.items()}
            results.append({**d, "passed": r.passed})
        return {"passed": self.passed, "meta": self.meta, "skipped": self.skipped, "results": results}

    def summary(self) -> str:
        n, bad = len(self.results), len(self.failures)
        backends = sorted({r.backend for r in self.results})
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: {n - bad}/{n} cases passed on {', '.join(backends) or 'no backend'}"
                + (f"; {bad} failed" if bad else ""))


def _cell(r: CaseResult, name: str) -> str:
    if name not in r.metrics:
        return "-"
    sign = "<=" if METRICS[name][0] == "max" else ">="
    cell = f"{_FMT[name].format(r.metrics[name])} {sign} {_BOUND_FMT[name].format(r.bounds[name])}"
    return cell + (" !" if name in r.failed else "")


def rows(report: Report) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, rows and footnotes (errors and notes, numbered from the result column)."""
    header = ["backend", "model", "config", "vs", "tol", "case"] + [METRICS[m][1] for m in METRICS] + ["result"]
    body, notes = [], []
    for r in report.results:
        result = "PASS" if r.passed else "FAIL"
        text = r.error or r.note
        if text:
            notes.append(f"[{len(notes) + 1}] {r.backend} {r.model} {r.config} {r.case}: {text}")
            result += f" [{len(notes)}]"
        body.append([r.backend, r.model, r.config, r.against, r.tolerance, r.case] + [_cell(r, m) for m in METRICS]
                    + [result])
    return header, body, notes


def format_table(report: Report) -> str:
    header, body, notes = rows(report)
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(header), line(["-" * w for w in widths])] + [line(row) for row in body]
    if notes:
        out += [""] + notes
    if report.skipped:
        out += [""] + [f"skipped: {_what(s)}: {s['reason']}" for s in report.skipped]
    out += ["", "'!' marks a figure outside its bound; bounds: conformance/tolerances.py", report.summary()]
    return "\n".join(out)


def _what(skipped: dict) -> str:
    return " ".join(x for x in (skipped["backend"], skipped.get("config")) if x)


def print_table(report: Report, file=None) -> None:
    print(format_table(report), file=file or sys.stdout)


def to_markdown(report: Report) -> str:
    header, body, notes = rows(report)
    m = report.meta
    out = ["# glmcore conformance report", ""]
    if m:
        out.append(f"{m.get('date', '')}, glmcore {m.get('glmcore', '')}, {m.get('machine', '')}; "
                   f"reference: {m.get('reference', '')}; {m.get('decode_steps', '')} decode steps, "
                   f"capacity {m.get('capacity', '')}.")
        out.append("")
    out += ["**" + report.summary() + "**", ""]
    out.append("| " + " | ".join(h.replace("|", "\\|") for h in header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    if report.skipped:
        out += ["", "Skipped:", ""] + [f"- {_what(s)}: {s['reason']}" for s in report.skipped]
    out += ["", "`!` marks a figure outside its bound. Bounds: `conformance/tolerances.py`."]
    return "\n".join(out) + "\n"


def write(report: Report, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "conformance.json", out / "conformance.md"
    js.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n", encoding="utf-8")
    md.write_text(to_markdown(report), encoding="utf-8")
    return js, md
