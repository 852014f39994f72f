"""The front door (README.md) and the opening of BENCHMARKS.md: every headline figure names its GPU and a commit whose
run is recorded (the journal or a file under benchmarks/results/), the quick commands stay first, and the relative
links resolve. Text checks only: no GPU, no model."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
README_MAX_LINES = 250  # issue 40: the README fits on a few screens


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _section(text: str, heading: str) -> str:
    """The text under the level-2 ``heading`` up to the next level-2 heading (or a ``---`` rule)."""
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    ends = [m.start() for m in re.finditer(r"^(## |---$)", rest, flags=re.M)]
    return rest[:min(ends)] if ends else rest


def _tables_by_gpu(section: str) -> dict[str, list[dict[str, str]]]:
    """Rows of every table under each ``### GPU`` heading of ``section``, as dicts keyed by the header cells."""
    out: dict[str, list[dict[str, str]]] = {}
    gpu, header = None, None
    for line in section.splitlines():
        if line.startswith("### "):
            gpu, header = line[4:].strip(), None
            out.setdefault(gpu, [])
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not all(set(c) <= set("-: ") for c in cells):
                assert gpu is not None, f"a figure table row outside a GPU heading: {line}"
                out[gpu].append(dict(zip(header, cells)))
        else:  # any other line ends a table
            header = None
    return out


def _recorded_commits() -> str:
    """Where a commit counts as recorded: the journal (BENCHMARKS.md below its opening) and result file names."""
    bench = _read("BENCHMARKS.md")
    journal = bench[bench.index("\n---\n"):]
    names = " ".join(os.listdir(os.path.join(ROOT, "benchmarks", "results")))
    return journal + "\n" + names


def _check_rows(rows_by_gpu: dict[str, list[dict[str, str]]], where: str) -> None:
    recorded = _recorded_commits()
    assert any("H200" in g for g in rows_by_gpu) and any("H100" in g for g in rows_by_gpu), \
        f"{where}: expected a table for the H200 and one for the H100, got {sorted(rows_by_gpu)}"
    for gpu, rows in rows_by_gpu.items():
        assert rows, f"{where}, {gpu}: no rows"
        assert gpu.startswith("NVIDIA "), f"{where}: heading {gpu!r} does not name a GPU"
        for row in rows:
            commit_key = next((k for k in row if k.startswith("commit")), None)
            assert commit_key is not None, f"{where}, {gpu}: a table without a commit column: {row}"
            cell = row[commit_key]
            if cell == "-":  # only a row that says nothing was measured may name no commit
                assert any("not measured" in v for v in row.values()), f"{where}, {gpu}: a figure without a commit: {row}"
                continue
            parts = [p.strip() for p in cell.split(",")]
            commit = parts[0]
            date = parts[1] if len(parts) > 1 else row.get("date", "")
            assert COMMIT.match(commit), f"{where}, {gpu}: {cell!r} is not a commit"
            assert DATE.match(date), f"{where}, {gpu}: row without a date: {row}"
            assert commit in recorded, f"{where}, {gpu}: commit {commit} is named nowhere in the journal or results"


def test_readme_starts_with_the_commands_and_the_range():
    text = _read("README.md")
    commands = re.findall(r"^    (make [\w-]+)", text, flags=re.M)
    assert commands[:3] == ["make demo", "make test", "make test-oldest"], commands
    assert "transformers 5.17 to the newest release" in text and "torch 2.11 to 2.13" in text


def test_readme_fits_on_a_few_screens():
    n = len(_read("README.md").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (target {README_MAX_LINES})"


def test_readme_headline_figures_name_gpu_and_commit():
    _check_rows(_tables_by_gpu(_section(_read("README.md"), "## Headline figures")), "README.md")


def test_benchmarks_opens_with_current_figures_per_gpu():
    bench = _read("BENCHMARKS.md")
    first_h2 = re.search(r"^## .*$", bench, flags=re.M).group(0)
    assert first_h2 == "## Current figures", first_h2
    _check_rows(_tables_by_gpu(_section(bench, "## Current figures")), "BENCHMARKS.md")


@pytest.mark.parametrize("rel", ["README.md", "docs/GUIDE.md"])
def test_relative_links_resolve(rel):
    text = _read(rel)
    base = os.path.dirname(os.path.join(ROOT, rel))
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"^[a-z]+:", link)]
    assert local, f"{rel}: no relative links found"
    missing = [link for link in local if not os.path.exists(os.path.normpath(os.path.join(base, link)))]
    assert not missing, f"{rel}: links to missing files: {missing}"


def test_every_environment_switch_is_documented():
    """docs/SWITCHES.md names every ``MOECOMP_*`` variable the package's code mentions (read or documented), and
    names none the code no longer has."""
    code = set()
    for top, _, files in os.walk(os.path.join(ROOT, "moecomp")):
        for f in files:
            if f.endswith(".py"):
                code |= set(re.findall(r"MOECOMP_[A-Z0-9_]*[A-Z0-9]", _read(os.path.join(top, f))))
    doc = set(re.findall(r"MOECOMP_[A-Z0-9_]*[A-Z0-9]", _read("docs/SWITCHES.md")))
    assert code, "no MOECOMP_ variable found in the package"
    assert not code - doc, f"not in docs/SWITCHES.md: {sorted(code - doc)}"
    assert not doc - code, f"docs/SWITCHES.md names variables the package no longer has: {sorted(doc - code)}"
