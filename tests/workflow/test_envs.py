"""The conda environment file lists what the workflow's code imports (for --sdm conda).

No conda channel is reachable where kb-nano is developed, so the environment is not
created in CI; this test keeps the file honest instead.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib

import yaml
from workflow_helpers import REPO

ENV = REPO / "envs/kb_nano.yaml"


def _env_packages(path=ENV) -> dict[str, str | None]:
    env = yaml.safe_load(path.read_text())
    assert env["channels"] and env["dependencies"]
    pkgs: dict[str, str | None] = {}
    for dep in env["dependencies"]:
        items = dep["pip"] if isinstance(dep, dict) else [dep]
        for item in items:
            if item.startswith("-e"):
                continue
            m = re.match(r"^([A-Za-z0-9_.-]+)\s*(?:[=<>]=?\s*([^\s]+))?$", item)
            assert m, f"cannot parse dependency {item!r} in {ENV}"
            pkgs[m.group(1).lower()] = m.group(2)
    return pkgs


def _third_party_imports() -> set[str]:
    files = [*REPO.joinpath("src/kb_nano").rglob("*.py"), *REPO.joinpath("workflow/scripts").glob("*.py")]
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("kb_nano", "snakemake"):
                    found.add(top)
    return found


def test_env_file_lists_every_imported_distribution():
    pkgs = _env_packages()
    dists = importlib.metadata.packages_distributions()
    # triton: imported inside candidates only; CUDA installs bring it with torch.
    # vllm: the e2e extra; the e2e rules use envs/kb_nano_e2e.yaml (test below).
    optional = {"triton", "vllm"}
    missing = []
    for module in sorted(_third_party_imports() - optional):
        names = {d.lower() for d in dists.get(module, [module])}
        if not names & set(pkgs):
            missing.append(f"{module} ({', '.join(sorted(names))})")
    assert not missing, f"{ENV} lacks: {missing}"


def test_env_pins_match_pyproject():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = {}
    for dep in pyproject["project"]["dependencies"]:
        name, _, version = dep.partition("==")
        pins[name.strip().lower()] = version.strip()
    for name, version in _env_packages().items():
        if name in pins:
            assert version == pins[name], f"{name}: env pins {version}, pyproject {pins[name]}"


def test_e2e_env_is_the_main_env_plus_the_e2e_extra():
    main = _env_packages()
    e2e = _env_packages(REPO / "envs/kb_nano_e2e.yaml")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (vllm_pin,) = pyproject["project"]["optional-dependencies"]["e2e"]
    name, _, version = vllm_pin.partition("==")
    assert e2e == {**main, name: version}
    assert "conda:\n        ENV_E2E" in (REPO / "workflow/rules/e2e.smk").read_text()
