"""The shape of the code, measured from the code (docs/design.md gives the reading order):

- a default run imports no optional layer (tensor parallelism's bookkeeping, deterministic mode,
  faults, plots, TensorBoard, benchmarks, PyTorch);
- the files a default training step runs total at most STEP_LINES lines (whole files, as wc -l
  counts them), `train_step` itself at most TRAIN_STEP_LINES;
- no module is over MODULE_LINES lines, and no import cycle;
- only capstone/parallel/comm.py (with values.py, its JSON methods) calls a collective of an MPI
  communicator, and only in its non-blocking form or under the watchdog: every other module goes
  through the deadline-aware `Comm`.
"""

import ast
import inspect
import json
import os
import subprocess
import sys

from conftest import ROOT, mpi_env

STEP_LINES = 2000
TRAIN_STEP_LINES = 35
MODULE_LINES = 400
PACKAGE = os.path.join(ROOT, "capstone")
OPTIONAL = ("capstone.parallel.tensor", "capstone.parallel.deterministic", "capstone.parallel.pipeline",
            "capstone.parallel.zero2", "capstone.parallel.zero3", "capstone.parallel.progress",
            "capstone.model.recompute", "capstone.faults", "capstone.plot", "capstone.observe.tensorboard", "benchmarks", "torch",
            "matplotlib", "tensorboardX")

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
    from capstone import cli, run as runs, train
    from capstone.parallel import launch
    world = launch.world()
    run = runs.open_run(world, cli.parse(sys.argv[1:]))
    train.train_step(run, 1)
    files = set()
    def watch(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename)
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


def test_a_default_run_imports_no_optional_layer(tmp_path):
    got = probe("modules", 2, "--steps", "3", tmp_path=tmp_path)
    assert got["code"] == 0
    loaded = [m for m in got["modules"] if m.startswith(OPTIONAL)]
    assert not loaded, f"a default run imported {loaded}"
    # the check can fail: the same probe with --tp 2 and --deterministic loads those layers
    tp = probe("modules", 2, "--steps", "2", "--tp", "2", tmp_path=tmp_path / "tp")
    assert "capstone.parallel.tensor" in tp["modules"]
    zero3 = probe("modules", 2, "--steps", "2", "--zero-stage", "3", tmp_path=tmp_path / "zero3")
    assert {"capstone.parallel.zero3", "capstone.parallel.progress"} <= set(zero3["modules"])


def test_a_default_step_runs_at_most_2000_lines_of_files(tmp_path):
    files = [f for f in probe("step_files", 2, "--steps", "3", tmp_path=tmp_path) if f.startswith(PACKAGE)]
    total = sum(lines(f) for f in files)
    listing = "\n".join(f"{lines(f):6d} {os.path.relpath(f, ROOT)}" for f in files)
    print(f"files a default training step runs ({total} lines):\n{listing}")
    assert "capstone/train.py" in listing and "capstone/model/blocks.py" in listing, listing
    assert total <= STEP_LINES, f"{total} lines > {STEP_LINES}:\n{listing}"


def test_train_step_is_short():
    from capstone import train
    n = len(inspect.getsource(train.train_step).splitlines())
    assert n <= TRAIN_STEP_LINES, f"train_step is {n} lines"


def test_no_module_is_too_long():
    long = {os.path.relpath(f, ROOT): lines(f) for f in package_files() if lines(f) > MODULE_LINES}
    assert not long, long


def imports_of(path: str) -> set[str]:
    """The capstone modules a file imports, at any depth of the file (a lazy import counts)."""
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("capstone"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("capstone"))
    return found


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def test_no_import_cycle():
    modules = {module_name(f): f for f in package_files()}
    graph = {m: {i for i in imports_of(f) if i in modules and i != m} for m, f in modules.items()}
    for m in modules:   # a package imports its own __init__; a module importing its package is not a cycle
        graph[m] = {i for i in graph[m] if not m.startswith(i + ".")}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"
    for m in sorted(modules):
        if m not in state:
            visit(m)


def mpi_uses(path: str) -> set[str]:
    """What a file takes from mpi4py: the attributes of `MPI` it names, and "<.mpi>" where it reaches
    through a Comm to its raw communicator."""
    tree = ast.parse(open(path).read())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "MPI":
                used.add(node.attr)
            elif node.attr == "mpi" and not isinstance(node.value, ast.Call):   # not h5py.get_config().mpi
                used.add("<.mpi>")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(n and n.startswith("mpi4py") for n in names):
                used.add("<import mpi4py>")
    return used


def test_only_comm_holds_an_mpi_communicator():
    """Every collective goes through capstone.parallel.comm.Comm: no other module can reach a raw
    communicator. Outside comm.py, mpi4py gives only the world and COMM_SELF to make Comms of
    (launch.py; grid.py: an axis of one rank), the
    request test and the abort (deadline.py) and version strings (provenance.py); nobody but comm.py
    touches a Comm's `.mpi` (checkpoint code gets it from `Comm.blocking`, under the watchdog)."""
    allowed = {"capstone/parallel/comm.py": None, "capstone/parallel/values.py": {"<.mpi>"},
               "capstone/parallel/exchanges.py": {"<.mpi>"},
               "capstone/parallel/grid.py": {"<import mpi4py>", "COMM_SELF"},
               "capstone/parallel/launch.py": {"<import mpi4py>", "COMM_SELF", "COMM_WORLD"},
               "capstone/parallel/deadline.py": {"<import mpi4py>", "Request"},
               "capstone/parallel/timeout.py": {"<import mpi4py>", "COMM_WORLD"},
               "capstone/observe/provenance.py": {"<import mpi4py>", "Get_library_version", "Get_version"}}
    for path in package_files():
        rel = os.path.relpath(path, ROOT)
        used = mpi_uses(path)
        if rel in allowed:
            assert allowed[rel] is None or used <= allowed[rel], (rel, used - allowed[rel])
        else:
            assert not used, f"{rel} uses {sorted(used)}: go through capstone.parallel.comm.Comm"
    # the check can fail: a module with a raw collective is caught
    probe_file = os.path.join(ROOT, "tests", "_raw_collective_probe.py")
    with open(probe_file, "w") as f:
        f.write("from mpi4py import MPI\nMPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, None)\n")
    try:
        assert {"<import mpi4py>", "COMM_WORLD", "IN_PLACE"} <= mpi_uses(probe_file)
    finally:
        os.remove(probe_file)


def test_comm_issues_only_non_blocking_collectives():
    """In comm.py and its mixins every collective is the non-blocking (I...) form waited on with the deadline;
    the blocking calls (Split, Split_type) sit inside `blocking`, under the watchdog."""
    calls = set()
    for name in ("comm.py", "values.py", "exchanges.py"):   # the mixins of Comm
        tree = ast.parse(open(os.path.join(PACKAGE, "parallel", name)).read())
        calls |= {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Attribute)
                  and node.func.value.attr == "mpi"}
    blocking = {c for c in calls if not c.startswith(("I", "Get_", "Free"))}
    assert blocking == {"Split", "Split_type"}, calls
    source = open(os.path.join(PACKAGE, "parallel", "comm.py")).read()
    for call in blocking:
        block = source[source.index(f"self.mpi.{call}(") - 300:source.index(f"self.mpi.{call}(")]
        assert "with self.blocking(" in block, f"{call} outside the watchdog"
