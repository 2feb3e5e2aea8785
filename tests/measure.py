"""The code's measured figures, one place: the files a reader of a default training step opens, the
code lines (not blank, comment or docstring) of capstone/ with the batch scripts and scripts/launch,
the `ConfigError(` sites, and the modules' sizes. tests/test_architecture.py holds the limits;
`python tests/measure.py --write` (scripts/code-figures) regenerates docs/code-figures.md, which the
docs link to instead of restating a figure.
"""

import ast
import io
import json
import os
import subprocess
import sys
import tokenize

from conftest import ROOT, mpi_env

PACKAGE = os.path.join(ROOT, "capstone")
SCRIPTS = ("scripts/launch", "scripts/slurm/step.sh", "scripts/slurm/capstone.sbatch", "scripts/slurm/template.sbatch")
FIGURES = os.path.join(ROOT, "docs", "code-figures.md")

# Runs `python -m capstone.train ARGV` in-process on every rank and prints, from rank 0, what the
# question (QUESTION) asks of it: the modules loaded, the files one step runs, the MPI calls made.
PROBE = r'''
import json, os, sys
from mpi4py import MPI
sys.argv = ["capstone.train"] + json.loads(os.environ["PROBE_ARGV"])
question = os.environ["PROBE"]
if question == "modules":
    from capstone import train
    try:
        train.main()
    except SystemExit as e:
        code = e.code
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("PROBE" + json.dumps({"code": code, "modules": sorted(sys.modules)}))
elif question == "step_files":
    import inspect
    from capstone import cli, run as runs, train
    from capstone.collective import launch
    package = os.path.dirname(os.path.abspath(train.__file__))

    def source_file(obj):
        """The capstone file that defines obj (a function behind a cache: its own), else None."""
        try:
            found = inspect.getsourcefile(inspect.unwrap(obj))
        except (TypeError, ValueError):
            return None
        return found if found and found.startswith(package) else None

    world = launch.world()
    run = runs.open_run(world, cli.parse(sys.argv[1:]))
    train.train_step(run, 1)
    files = set()
    def watch(frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(package):
            return
        files.add(code.co_filename)                        # a function the step runs
        if event == "return":
            named = [frame.f_globals.get(n) for n in code.co_names]          # a cached function, a class, a module
            held = [type(v) for v in frame.f_locals.values()]               # the type of an object it reads
            files.update(f for f in map(source_file, named + held) if f)
    sys.setprofile(watch)
    train.train_step(run, 2)
    sys.setprofile(None)
    if world.rank == 0:
        print("PROBE" + json.dumps(sorted(files)))
elif question == "mpi_calls":
    from capstone import train
    calls = set()
    def watch(frame, event, arg):
        if event == "c_call" and isinstance(getattr(arg, "__self__", None), MPI.Comm):
            calls.add((arg.__name__, frame.f_code.co_filename))
    sys.setprofile(watch)
    try:
        train.main()
    except SystemExit as e:
        code = e.code
    sys.setprofile(None)
    everyone = MPI.COMM_WORLD.gather(sorted(calls))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("PROBE" + json.dumps({"code": code, "calls": sorted({tuple(c) for r in everyone for c in r})}))
'''


def probe(question: str, ranks: int, *argv, tmp_path) -> object:
    env = {**mpi_env(), "PROBE": question, "PROBE_ARGV": json.dumps(["--out", str(tmp_path / question), *argv])}
    res = subprocess.run(["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-c", PROBE],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("PROBE")]
    assert res.returncode == 0 and line, res.stdout + res.stderr
    return json.loads(line[0][len("PROBE"):])


def package_files() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(PACKAGE) for f in fs if f.endswith(".py"))


def lines(path: str) -> int:
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def docstring_lines(tree) -> set[int]:
    """The lines of every module, class and function docstring."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            found.update(range(body[0].lineno, body[0].end_lineno + 1))
    return found


def python_code_lines(source: str) -> int:
    """Lines that hold a token of code: not blank, not a comment, not inside a docstring."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    doc, found = docstring_lines(ast.parse(source)), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            found.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in doc)
    return len(found)


def shell_code_lines(source: str) -> int:
    return sum(1 for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#"))


def code_lines() -> dict[str, int]:
    """Code lines of each file of capstone/ and of the batch scripts and scripts/launch."""
    out = {os.path.relpath(f, ROOT): python_code_lines(open(f).read()) for f in package_files()}
    out.update({s: shell_code_lines(open(os.path.join(ROOT, s)).read()) for s in SCRIPTS})
    return out


def config_error_sites() -> int:
    """`ConfigError(` in capstone/ outside its class statement."""
    return sum(open(f).read().count("ConfigError(") - open(f).read().count("class ConfigError(")
               for f in package_files())


def step_files(tmp: str) -> dict[str, int]:
    """The files a reader of a default training step opens (2 ranks, 3 steps) and their lines."""
    files = [f for f in probe("step_files", 2, "--steps", "3", tmp_path=__import__("pathlib").Path(tmp))
             if f.startswith(PACKAGE)]
    return {os.path.relpath(f, ROOT): lines(f) for f in files}


def figures(tmp: str) -> str:
    """docs/code-figures.md's text."""
    import inspect
    sys.path.insert(0, ROOT)
    from capstone import train
    step, code = step_files(tmp), code_lines()
    packages: dict[str, list[int]] = {}
    for f in package_files():
        rel = os.path.relpath(f, PACKAGE)
        key = rel.split(os.sep)[0] if os.sep in rel else "(top level)"
        packages.setdefault(key, [0, 0, 0])
        packages[key] = [packages[key][0] + 1, packages[key][1] + lines(f), packages[key][2] + code[os.path.relpath(f, ROOT)]]
    head = [
        "# Code figures", "",
        "Generated by `scripts/code-figures` (`python tests/measure.py --write`); do not edit. The limits are",
        "tests/test_architecture.py's; docs/design.md explains the reading order.", "",
        "| figure | measured |", "|---|---|",
        f"| files a reader of a default step opens | {len(step)} |",
        f"| their lines (whole files, as wc -l counts) | {sum(step.values()):,} |",
        f"| `train_step`'s lines | {len(inspect.getsource(train.train_step).splitlines())} |",
        f"| code lines of capstone/ + batch scripts + scripts/launch (not blank, comment or docstring) | "
        f"{sum(code.values()):,} |",
        f"| `ConfigError(` sites in capstone/ | {config_error_sites()} |",
        f"| cli.py's lines | {lines(os.path.join(PACKAGE, 'cli.py'))} |",
        f"| longest module | {max(lines(f) for f in package_files())} lines |", "",
        "## The default step's files", "", "| file | lines |", "|---|---|"]
    rows = [f"| `{f}` | {n} |" for f, n in step.items()]
    pk = ["", "## The packages", "", "| package | files | lines | code lines |", "|---|---|---|---|"]
    pk += [f"| `{k}` | {v[0]} | {v[1]:,} | {v[2]:,} |" for k, v in sorted(packages.items())]
    return "\n".join(head + rows + pk) + "\n"


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        text = figures(tmp)
    if sys.argv[1:] == ["--write"]:
        with open(FIGURES, "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(FIGURES, ROOT)}")
    else:
        print(text, end="")
