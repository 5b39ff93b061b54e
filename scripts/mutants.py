"""Mutation check: apply each single-point mutation of tests/mutants.txt to a copy of the tree, run
the tests named for it, and report which mutants survived (every named test passed) and which were
killed, with the time each took. Run through ``scripts/mutants.sh`` (docs/testing.md, "Mutation
check"); not part of the test suite.

List format, one mutant per line (``#`` comments and blank lines allowed)::

    path/to/file.py :: exact text (occurs exactly once) :: replacement :: tests/test_x.py::test_a [more node ids]

In the text and the replacement ``\\n`` stands for a newline (``\\\\`` for a backslash). A comment line
``# <id>: <description>`` directly above a mutant names it (else its id is ``L<line>``).

Exit status: 0 when every mutant was killed; 1 when one survived; 2 when the list is stale or broken
(a text found other than exactly once, a file or test id that does not exist, a mutation that does not
compile): checked for the whole list before anything runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEP = " :: "


@dataclass
class Mutant:
    id: str
    line: int
    path: str
    find: str
    replace: str
    tests: list[str]
    about: str


def unescape(text: str) -> str:
    r"""``\n`` → newline, ``\\`` → backslash; any other backslash stays as it is."""
    return re.sub(r"\\([\\n])", lambda m: "\n" if m.group(1) == "n" else "\\", text)


def parse(path: Path) -> list[Mutant]:
    """The mutants of the list at ``path``; raises ``ValueError`` naming the line of a malformed entry."""
    out, comment, seen = [], None, set()
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line:
            comment = None
            continue
        if line.startswith("#"):
            comment = line.lstrip("#").strip()
            continue
        fields = raw.split(SEP)
        if len(fields) != 4 or not all(f.strip() for f in (fields[0], fields[1], fields[3])):
            raise ValueError(f"{path.name}:{n}: expected 'file :: text :: replacement :: tests', got {raw!r}")
        m = re.match(r"([\w.\-]+):\s*(.*)", comment or "")
        mid, about = (m.group(1), m.group(2)) if m else (f"L{n}", comment or "")
        if mid in seen:
            raise ValueError(f"{path.name}:{n}: id {mid!r} used twice")
        seen.add(mid)
        out.append(
            Mutant(mid, n, fields[0].strip(), unescape(fields[1]), unescape(fields[2]), fields[3].split(), about)
        )
        comment = None
    return out


def stale(mutants: list[Mutant], tree: Path) -> list[str]:
    """What does not fit ``tree``: missing files, texts found other than once, mutations that do not compile."""
    problems = []
    for m in mutants:
        where = f"{m.id} (line {m.line})"
        src = tree / m.path
        if not src.is_file():
            problems.append(f"{where}: no file {m.path}")
            continue
        text = src.read_text()
        count = text.count(m.find)
        if count != 1:
            problems.append(f"{where}: {m.find!r} occurs {count} times in {m.path}, not once")
            continue
        try:
            compile(text.replace(m.find, m.replace), str(src), "exec")
        except SyntaxError as e:
            problems.append(f"{where}: the mutated {m.path} does not compile: {e}")
        for test in m.tests:
            if not (tree / test.split("::")[0]).is_file():
                problems.append(f"{where}: no test file for {test}")
    return problems


def copy_tree(dest: Path) -> None:
    """The working tree's tracked and untracked (not ignored) files, uncommitted edits included."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def pytest(python: str, tree: Path, args: list[str], log: Path) -> tuple[int, float]:
    """Run pytest in ``tree`` (the copy first on the path; no bytecode written, so an edit never meets a
    stale cache); its output to ``log``. Returns the exit status and the seconds it took."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tree), str(tree / "tools")]),
        NO_VCS_VERSION="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    start = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.run(
            [python, "-m", "pytest", "-p", "no:cacheprovider", *args],
            cwd=tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
    return rc, time.monotonic() - start


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", type=Path, default=ROOT / "tests" / "mutants.txt", help="the mutant list")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutants only")
    parser.add_argument("--check", action="store_true", help="check the list against the tree (and the test ids) only")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="first run every named test on the unmutated copy (a test that fails there kills nothing)",
    )
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    parser.add_argument(
        "--logs", type=Path, help="keep each mutant's pytest output here (default: shown for survivors only)"
    )
    args = parser.parse_args()
    python = os.path.abspath(args.python) if os.sep in args.python else args.python  # pytest runs in the copy

    try:
        mutants = parse(args.list)
    except ValueError as e:
        print(f"mutants: {e}", file=sys.stderr)
        return 2
    if args.only:
        unknown = set(args.only) - {m.id for m in mutants}
        if unknown:
            print(f"mutants: no mutant {sorted(unknown)} in {args.list}", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.id in args.only]

    tree = Path(tempfile.mkdtemp(prefix="gift-mutants-"))
    logs = args.logs or tree / ".logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        copy_tree(tree)
        problems = stale(mutants, tree)
        tests = sorted({t for m in mutants for t in m.tests})
        rc, _ = pytest(python, tree, ["-q", "--collect-only", *tests], logs / "collect.txt")
        if rc != 0:
            problems.append(
                f"the named tests do not all collect (pytest exit {rc}):\n{(logs / 'collect.txt').read_text()[-3000:]}"
            )
        if problems:
            print("mutants: the list does not fit the tree:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 2
        print(f"mutants: {len(mutants)} mutants, {len(tests)} test ids, {load()}", flush=True)
        if args.check:
            return 0
        if args.baseline:
            rc, secs = pytest(python, tree, ["-q", *tests], logs / "baseline.txt")
            print(f"baseline: pytest exit {rc} in {secs:.0f} s", flush=True)
            if rc != 0:
                print((logs / "baseline.txt").read_text()[-3000:], file=sys.stderr)
                return 2

        start, results = time.monotonic(), []
        for m in mutants:
            src = tree / m.path
            original = src.read_text()
            src.write_text(original.replace(m.find, m.replace))
            try:
                rc, secs = pytest(python, tree, ["-x", "-q", *m.tests], logs / f"{m.id}.txt")
            finally:
                src.write_text(original)
            status = "survived" if rc == 0 else "killed" if rc == 1 else f"killed (pytest exit {rc})"
            results.append((m, status, secs))
            print(f"{m.id:32s} {status:24s} {secs:6.0f} s  {m.about}", flush=True)
            if rc == 0:
                print(f"  {m.path}: {m.find!r} -> {m.replace!r}\n  passed: {' '.join(m.tests)}", flush=True)
            elif rc != 1:
                print("  " + (logs / f"{m.id}.txt").read_text()[-1500:].replace("\n", "\n  "), flush=True)
        survivors = [m for m, status, _ in results if status == "survived"]
        total = time.monotonic() - start
        print(
            f"mutants: {len(results) - len(survivors)} killed, {len(survivors)} survived"
            f"{' (' + ', '.join(m.id for m in survivors) + ')' if survivors else ''} of {len(results)} "
            f"in {total / 60:.1f} min; {load()}"
        )
        return 1 if survivors else 0
    finally:
        shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
