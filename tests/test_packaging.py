"""environment.yml stays in sync with the dependencies pyproject.toml declares."""

import os
import re
import tomllib

from conftest import ROOT


def conda_names():
    names, section = set(), None
    with open(os.path.join(ROOT, "environment.yml")) as f:
        for line in f:
            if re.match(r"^[a-z_]+:", line):
                section = line.split(":")[0]
            m = re.match(r"^\s*-\s*([A-Za-z0-9_.\-]+)", line)
            if m and section == "dependencies":
                names.add(m.group(1).lower())
    return names


def test_environment_yml_lists_every_declared_dependency():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = {re.split(r"[<>=!~\[ ;]", d)[0].lower() for d in project["dependencies"]}
    for extra in project["optional-dependencies"].values():  # test, plot: the conda env brings them all
        declared |= {re.split(r"[<>=!~\[ ;]", d)[0].lower() for d in extra}
    conda = conda_names()
    assert declared <= conda, f"missing from environment.yml: {sorted(declared - conda)}"
    assert {"openmpi", "python"} <= conda, "environment.yml must bring MPI and Python too"
    extra = conda - declared - {"openmpi", "python"}
    assert not extra, f"environment.yml has packages pyproject.toml does not declare: {sorted(extra)}"


def test_h5py_in_environment_yml_is_the_mpi_build():
    with open(os.path.join(ROOT, "environment.yml")) as f:
        text = f.read()
    assert re.search(r"-\s*h5py=\*=mpi_openmpi", text), "conda-forge h5py must be the mpi_openmpi build"


def pip_installed_names(script: str) -> set[str]:
    """Package names given to `pip install` commands of a shell script (comments ignored)."""
    names = set()
    joined = re.sub(r"\\\n", " ", script)  # continuation lines
    for line in joined.splitlines():
        code = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]
        m = re.search(r"\bpip install\b(.*)", code)
        if m:
            args = re.split(r"\|\||&&|[|;]|\s\d?>", m.group(1))[0]  # up to the next operator or redirection
            names |= {re.split(r"[<>=!~\[ ;]", w.strip("\"'"))[0].lower() for w in args.split() if not w.startswith("-")}
    return names


def test_setup_installs_the_declared_dependencies():
    """Every dependency pyproject.toml declares is an argument of a `pip install` in scripts/setup
    (a comment naming it does not count)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = [d for group in project["optional-dependencies"].values() for d in group]
    declared = {re.split(r"[<>=!~\[ ;]", d)[0].lower() for d in project["dependencies"] + extras}
    with open(os.path.join(ROOT, "scripts", "setup")) as f:
        installed = pip_installed_names(f.read())
    assert {"numpy", "autograd", "mpi4py", "pytest", "h5py"} <= declared
    assert declared <= installed, f"scripts/setup does not pip install {sorted(declared - installed)}"
