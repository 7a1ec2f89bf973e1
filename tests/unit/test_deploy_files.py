"""The deployment files, checked offline: Dockerfile, docker-compose.yml, k8s/, docs/operating.md.

Two layers:

1. Validators. ``docker-compose config -q`` checks the compose file against the Compose
   schema (no Docker engine needed); ``kubectl kustomize`` renders k8s/ (base and GPU
   overlay) and ``kubernetes-validate --strict`` checks every rendered object against the
   Kubernetes schemas, unknown fields included. Each validator is also shown to reject
   a deliberately broken copy, so a pass means something.
2. The files against the code: every command is ``swarm <sub-command>`` that the CLI has,
   every ``SWARM_*`` variable is a setting of the service that reads it and parses with
   it, ports are the settings' defaults and agree across healthchecks, probes, Services
   and URLs, and the settings table of docs/operating.md lists exactly the settings.

A missing tool skips its tests, except under CI (``CI``) or ``SWARM_REQUIRE_DEPLOY_TOOLS=1``
(which .ci/run sets): there it fails, so CI never passes by skipping.
"""

from __future__ import annotations

import copy
import fnmatch
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from services.cli import COMMANDS
from shared.config import (
    CoordinatorSettings,
    StageServerSettings,
    TrainerSettings,
    known_settings_fields,
    settings_fields,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
K8S = ROOT / "k8s"
GPU_OVERLAY = K8S / "overlays" / "gpu"
DOCS = ROOT / "docs" / "operating.md"

# The settings class each settings-driven sub-command reads.
SETTINGS_FOR = {"coordinator": CoordinatorSettings, "server": StageServerSettings, "train": TrainerSettings}
# Variables the deployment files already set for a setting that a later issue adds:
# SWARM_SECRET (authentication). Remove a name here once shared/config.py has its field.
PENDING_SETTINGS: set[str] = set()  # variables a deploy file may set before the code reads them
# Settings that every member of a run must agree on.
RUN_WIDE = ("SWARM_RUN_ID", "SWARM_NUM_STAGES", "SWARM_MODEL", "SWARM_SEED", "SWARM_WIRE_CODEC", "SWARM_INT8_BLOCK")
COORDINATOR_PORT = CoordinatorSettings.model_fields["port"].default
SERVER_PORT = StageServerSettings.model_fields["port"].default
TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

REQUIRE_TOOLS = os.environ.get("SWARM_REQUIRE_DEPLOY_TOOLS", "") not in ("", "0") or os.environ.get(
    "CI", ""
).lower() in ("1", "true", "yes")


def _missing(what: str) -> None:
    message = f"{what}; it validates the deployment files offline (see .ci/run for how CI installs it)"
    if REQUIRE_TOOLS:
        pytest.fail(message + " [required: CI or SWARM_REQUIRE_DEPLOY_TOOLS is set]")
    pytest.skip(message)


def _yaml():
    if importlib.util.find_spec("yaml") is None:
        _missing("PyYAML is not installed (pip install kubernetes-validate brings it)")
    import yaml

    return yaml


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        _missing(f"{name} is not on PATH")
    return path


def _kubernetes_validate() -> list[str]:
    if importlib.util.find_spec("kubernetes_validate") is not None:
        return [sys.executable, "-m", "kubernetes_validate"]
    return [_tool("kubernetes-validate")]


def _run(cmd: list[str], *, stdin: str | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": "/nonexistent"}  # kubectl never probes a cluster
    return subprocess.run(cmd, check=False, input=stdin, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def _settings_env(env: dict[str, str], cls) -> dict[str, str]:
    """The variables of ``env`` that are settings of ``cls``."""
    return {k: v for k, v in env.items() if k.removeprefix("SWARM_").lower() in settings_fields(cls)}


def _check_settings(where: str, env: dict[str, str], sub: str, monkeypatch) -> None:
    """Every SWARM_* variable in ``env`` is a setting of ``sub``'s class, and they parse."""
    cls = SETTINGS_FOR[sub]
    unknown = sorted(
        k
        for k in env
        if k.startswith("SWARM_")
        and k.removeprefix("SWARM_").lower() not in settings_fields(cls)
        and k not in PENDING_SETTINGS
    )
    assert not unknown, f"{where}: `swarm {sub}` has no setting for {unknown} (fields of {cls.__name__})"
    for name in [k for k in os.environ if k.upper().startswith("SWARM_")]:
        monkeypatch.delenv(name)
    for name, value in _settings_env(env, cls).items():
        monkeypatch.setenv(name, value)
    try:
        cls()
    except ValueError as exc:
        pytest.fail(f"{where}: its SWARM_* variables do not parse as {cls.__name__}:\n{exc}")
    finally:
        for name in _settings_env(env, cls):
            monkeypatch.delenv(name, raising=False)


def _check_command(where: str, command: list[str]) -> str:
    """``swarm SUB --flag value ...`` with a known SUB and flags its settings have; returns SUB."""
    assert isinstance(command, list) and len(command) >= 2 and command[0] == "swarm", (
        f"{where}: command {command!r} is not `swarm <sub-command>`"
    )
    sub = command[1]
    assert sub in COMMANDS, f"{where}: `swarm {sub}` is not a sub-command of services/cli.py ({sorted(COMMANDS)})"
    if sub in SETTINGS_FOR:
        fields = settings_fields(SETTINGS_FOR[sub])
        for arg in command[2:]:
            if arg.startswith("--"):
                flag = arg[2:].split("=", 1)[0]
                assert flag.replace("-", "_") in fields, f"{where}: `swarm {sub}` has no flag --{flag}"
    return sub


def _url(value: str) -> tuple[str, int, str]:
    parts = urlsplit(value)
    return parts.hostname, parts.port, parts.path


# ---------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("sub", sorted(SETTINGS_FOR))
def test_settings_classes_are_the_ones_the_commands_read(sub):
    module = importlib.import_module(COMMANDS[sub][0])
    cls = SETTINGS_FOR[sub]
    assert getattr(module, cls.__name__, None) is cls, f"{COMMANDS[sub][0]} does not read {cls.__name__}"


# ---------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return _yaml().safe_load(COMPOSE_FILE.read_text())


def _compose_config(path: Path) -> subprocess.CompletedProcess:
    return _run([_tool("docker-compose"), "-f", str(path), "config", "-q"], cwd=path.parent)


def test_compose_file_validates():
    result = _compose_config(COMPOSE_FILE)
    assert result.returncode == 0, f"docker-compose config -q failed:\n{result.stderr}"


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda c: c["services"]["trainer"]["depends_on"].update(nowhere={"condition": "service_healthy"}), "nowhere"),
        (
            lambda c: c["services"]["coordinator"].update(helthcheck=c["services"]["coordinator"].pop("healthcheck")),
            "helthcheck",
        ),
        (lambda c: c["services"]["coordinator"].update(restart=["always"]), "restart"),
    ],
    ids=["undefined-dependency", "misspelt-key", "wrong-type"],
)
def test_compose_validation_rejects_a_broken_copy(tmp_path, compose, breakage, expected):
    broken = copy.deepcopy(compose)
    breakage(broken)
    path = tmp_path / "docker-compose.yml"
    path.write_text(_yaml().safe_dump(broken))
    result = _compose_config(path)
    assert result.returncode != 0, f"docker-compose accepted a broken file ({expected})"
    assert expected in result.stderr, result.stderr


def _compose_services(compose: dict) -> dict[str, tuple[str, dict]]:
    """Service name -> (sub-command, environment)."""
    out = {}
    for name, service in compose["services"].items():
        sub = _check_command(f"compose service {name}", service["command"])
        env = service.get("environment") or {}
        assert isinstance(env, dict), f"compose service {name}: write environment as a mapping"
        out[name] = (sub, {k: str(v) for k, v in env.items()})
    return out


def test_compose_commands_and_variables_match_the_code(compose, monkeypatch):
    for name, (sub, env) in _compose_services(compose).items():
        assert sub in SETTINGS_FOR, f"compose service {name} runs `swarm {sub}`"
        assert all(k.startswith("SWARM_") for k in env), f"compose service {name}: non-SWARM variables {sorted(env)}"
        _check_settings(f"compose service {name}", env, sub, monkeypatch)
        assert env.get("SWARM_LOG_FORMAT") == "json", f"compose service {name}: containers log JSON"
        assert env.get("SWARM_MDNS") == "false", f"compose service {name}: mDNS is off in compose"


def test_compose_swarm_shape_ports_and_health(compose):
    services = _compose_services(compose)
    coordinators = [n for n, (sub, _) in services.items() if sub == "coordinator"]
    servers = {n: env for n, (sub, env) in services.items() if sub == "server"}
    trainers = [n for n, (sub, _) in services.items() if sub == "train"]
    assert len(coordinators) == 1 and trainers, f"one coordinator and a trainer: {sorted(services)}"
    (coordinator,) = coordinators
    for key in RUN_WIDE:
        values = {n: env[key] for n, (_, env) in services.items() if key in env}
        assert len(set(values.values())) <= 1, f"compose: services disagree on {key}: {values}"
    num_stages = int(services[coordinator][1]["SWARM_NUM_STAGES"])
    per_stage = {
        s: sorted(n for n, env in servers.items() if env.get("SWARM_STAGE") == str(s)) for s in range(num_stages)
    }
    assert num_stages >= 2 and all(len(r) >= 2 for r in per_stage.values()), (
        f"at least 2 stages x 2 replicas: {per_stage}"
    )
    assert sum(map(len, per_stage.values())) == len(servers), f"a stage server outside 0..{num_stages - 1}: {servers}"

    for name, (sub, env) in services.items():
        service = compose["services"][name]
        if sub == "train":
            continue
        port = int(env["SWARM_PORT"])
        assert port == (COORDINATOR_PORT if sub == "coordinator" else SERVER_PORT), (
            f"compose service {name}: SWARM_PORT {port} is not the default"
        )
        assert env["SWARM_HOST"] == "0.0.0.0", f"compose service {name} must listen on all interfaces"
        host, url_port, _ = _url(env["SWARM_ADVERTISE_URL"])
        assert (host, url_port) == (name, port), f"compose service {name} advertises {env['SWARM_ADVERTISE_URL']}"
        test = " ".join(service["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/health" in test and "urllib" in test, (
            f"compose service {name}: healthcheck {test}"
        )
        published = [str(p).rsplit(":", 1)[-1] for p in service.get("ports", [])] + [
            str(p) for p in service.get("expose", [])
        ]
        assert published and set(published) == {str(port)}, f"compose service {name}: ports {published} != {port}"

    for name, (sub, env) in services.items():
        if sub != "coordinator":
            host, port, _ = _url(env["SWARM_COORDINATOR"])
            assert (host, port) == (coordinator, COORDINATOR_PORT), (
                f"compose service {name}: SWARM_COORDINATOR {env['SWARM_COORDINATOR']}"
            )
        for dep, cond in (compose["services"][name].get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, f"compose service {name}: depends_on {dep} {cond}"
            assert "healthcheck" in compose["services"][dep], f"compose service {dep} has no healthcheck"
    for trainer in trainers:
        assert set(compose["services"][trainer]["depends_on"]) == {coordinator, *servers}, (
            "the trainer waits for every server"
        )


def test_compose_volume_keeps_the_coordinators_state(compose):
    service = compose["services"]["coordinator"]
    env = service["environment"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in service["volumes"]}
    for key in ("SWARM_STATE_DB", "SWARM_CHECKPOINT_DIR"):
        path = Path(env[key])
        mount = next((m for m in mounts if path.is_relative_to(m)), None)
        assert mount, f"compose coordinator: {key}={path} is on no volume ({service['volumes']})"
        assert mounts[mount] in compose["volumes"], f"compose: {mounts[mount]} is not a named volume"
    # Stage servers resume from the same checkpoints when no live replica has their stage.
    for name, (sub, server_env) in _compose_services(compose).items():
        if sub == "server":
            assert server_env["SWARM_CHECKPOINT_DIR"] == env["SWARM_CHECKPOINT_DIR"], (
                f"compose service {name}: SWARM_CHECKPOINT_DIR"
            )
            assert set(compose["services"][name]["volumes"]) == {f"{v}:{m}:ro" for m, v in mounts.items()}, (
                f"compose service {name}: volumes"
            )


# ---------------------------------------------------------------------------- k8s


def _render(directory: Path) -> str:
    result = _run([_tool("kubectl"), "kustomize", str(directory)])
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    assert result.stdout.strip(), f"kubectl kustomize {directory} rendered nothing"
    return result.stdout


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {
        name: [d for d in _yaml().safe_load_all(_render(path)) if d]
        for name, path in (("base", K8S), ("gpu", GPU_OVERLAY))
    }


def _validate(manifests: str) -> subprocess.CompletedProcess:
    return _run([*_kubernetes_validate(), "--strict", "--quiet", "-"], stdin=manifests)


@pytest.mark.parametrize("directory", [K8S, GPU_OVERLAY], ids=["base", "gpu"])
def test_k8s_manifests_validate(directory):
    result = _validate(_render(directory))
    assert result.returncode == 0, (
        f"kubernetes-validate --strict failed for {directory}:\n{result.stdout}{result.stderr}"
    )


def _break_deployment(docs: list[dict], breakage) -> list[dict]:
    docs = copy.deepcopy(docs)
    breakage(next(d for d in docs if d["kind"] == "Deployment")["spec"])
    return docs


@pytest.mark.parametrize(
    "breakage",
    [
        lambda spec: spec.update(replica=2),  # unknown field: only --strict catches it
        lambda spec: spec["template"]["spec"]["containers"][0].update(ports=[{"containerPort": "eight thousand"}]),
        lambda spec: spec["template"]["spec"].pop("containers"),
    ],
    ids=["unknown-field", "wrong-type", "missing-required"],
)
def test_k8s_validation_rejects_a_broken_manifest(rendered, breakage):
    yaml = _yaml()
    result = _validate(yaml.safe_dump_all(_break_deployment(rendered["base"], breakage)))
    assert result.returncode != 0, "kubernetes-validate accepted a broken Deployment"


def test_kustomize_rejects_a_broken_kustomization(tmp_path):
    copied = shutil.copytree(K8S, tmp_path / "k8s")
    kustomization = copied / "base" / "kustomization.yaml"
    kustomization.write_text(
        kustomization.read_text().replace("  - trainer.yaml\n", "  - trainer.yaml\n  - missing.yaml\n")
    )
    result = _run([_tool("kubectl"), "kustomize", str(copied)])
    assert result.returncode != 0 and "missing.yaml" in result.stderr, result.stderr


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _objects(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _containers(docs: list[dict]):
    """(workload, pod spec, container, sub-command, env) for every container of every workload."""
    configmaps = _objects(docs, "ConfigMap")
    secrets = _objects(docs, "Secret")
    for kind in ("Deployment", "Job"):
        for name, obj in _objects(docs, kind).items():
            pod = obj["spec"]["template"]["spec"]
            for c in pod["containers"]:
                where = f"k8s {kind} {name}, container {c['name']}"
                sub = _check_command(where, c["command"])
                env = {}
                for source in c.get("envFrom", []):
                    ref = source["configMapRef"]["name"]
                    assert ref in configmaps, f"{where}: no ConfigMap {ref}"
                    env.update(configmaps[ref]["data"])
                for var in c.get("env", []):
                    if "value" in var:  # $(NAME) expands a variable defined above, as the kubelet does
                        env[var["name"]] = _expand(var["value"], env)
                    elif "secretKeyRef" in var["valueFrom"]:
                        ref = var["valueFrom"]["secretKeyRef"]
                        secret = secrets.get(ref["name"], {})
                        assert ref["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}, (
                            f"{where}: no key {ref['key']} in Secret {ref['name']}"
                        )
                        env[var["name"]] = secret.get("stringData", {}).get(ref["key"], "s" * 32)
                    else:
                        assert var["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, f"{where}: {var}"
                        env[var["name"]] = "10.1.2.3"
                yield name, pod, c, sub, env


@pytest.mark.parametrize("variant", ["base", "gpu"])
def test_k8s_commands_and_variables_match_the_code(rendered, variant, monkeypatch):
    seen = set()
    for name, pod, c, sub, env in _containers(rendered[variant]):
        where = f"k8s {variant} {name}"
        seen.add(sub)
        assert sub in SETTINGS_FOR, f"{where} runs `swarm {sub}`"
        _check_settings(where, env, sub, monkeypatch)
        for key, value in env.items():
            assert key.startswith("SWARM_") or key == "POD_IP", f"{where}: unexpected variable {key}"
            assert "$(" not in value, f"{where}: {key}={value} refers to an undefined variable"
        assert env.get("SWARM_LOG_FORMAT") == "json" and env.get("SWARM_MDNS") == "false", (
            f"{where}: JSON logs, mDNS off"
        )
        assert "SWARM_SECRET" in env, f"{where}: the swarm secret is not mounted"
        # A Service named swarm-* would inject SWARM_*_PORT variables into every pod.
        assert pod.get("enableServiceLinks") is False, f"{where}: set enableServiceLinks: false"
        sc = pod.get("securityContext", {})
        assert sc.get("runAsNonRoot") and sc.get("runAsUser") == 10001, f"{where}: runs as the image's user 10001"
        assert c["resources"].get("requests") and c["resources"].get("limits"), f"{where}: resource requests and limits"
    assert seen == set(SETTINGS_FOR), f"k8s {variant}: workloads for {sorted(SETTINGS_FOR)}, found {sorted(seen)}"
    for key in RUN_WIDE:
        values = {n: env[key] for n, _, _, _, env in _containers(rendered[variant]) if key in env}
        assert len(set(values.values())) <= 1, f"k8s {variant}: workloads disagree on {key}: {values}"


def _by_sub(docs: list[dict]) -> dict[str, tuple]:
    return {sub: (name, pod, c, env) for name, pod, c, sub, env in _containers(docs)}


def test_k8s_ports_probes_and_urls(rendered):
    docs = rendered["base"]
    workloads = _by_sub(docs)
    services = _objects(docs, "Service")
    for sub, default in (("coordinator", COORDINATOR_PORT), ("server", SERVER_PORT)):
        name, _, c, env = workloads[sub]
        port = int(env["SWARM_PORT"])
        assert port == default, f"k8s {name}: SWARM_PORT {port} is not the default {default}"
        assert env["SWARM_HOST"] == "0.0.0.0"
        assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", port)], (
            f"k8s {name}: ports {c['ports']}"
        )
        for probe in ("readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health" and get["port"] in ("http", port), f"k8s {name}: {probe} {get}"
        if "startupProbe" in c:
            assert c["startupProbe"]["httpGet"]["path"] == "/health"

    coord_name, _, _, coord_env = workloads["coordinator"]
    labels = _objects(docs, "Deployment")[coord_name]["spec"]["template"]["metadata"]["labels"]
    (service,) = [s for s in services.values() if s["spec"]["selector"].items() <= labels.items()]
    (svc_port,) = service["spec"]["ports"]
    assert svc_port["port"] == COORDINATOR_PORT and svc_port["targetPort"] in ("http", COORDINATOR_PORT), (
        f"k8s Service {service['metadata']['name']}: {svc_port}"
    )
    host, port, _ = _url(coord_env["SWARM_ADVERTISE_URL"])
    assert (host, port) == (service["metadata"]["name"], COORDINATOR_PORT), (
        f"k8s coordinator advertises {coord_env['SWARM_ADVERTISE_URL']}"
    )
    for sub in ("server", "train"):
        name, _, _, env = workloads[sub]
        host, port, _ = _url(env["SWARM_COORDINATOR"])
        assert (host, port) == (service["metadata"]["name"], COORDINATOR_PORT), (
            f"k8s {name}: SWARM_COORDINATOR {env['SWARM_COORDINATOR']}"
        )


def test_k8s_workload_shapes(rendered):
    docs = rendered["base"]
    workloads = _by_sub(docs)
    deployments, jobs = _objects(docs, "Deployment"), _objects(docs, "Job")

    name, pod, c, env = workloads["coordinator"]
    spec = deployments[name]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate", f"k8s {name}: one replica, Recreate"
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
    }
    assert set(claims.values()) <= set(_objects(docs, "PersistentVolumeClaim")), f"k8s {name}: claims {claims}"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"] if m["name"] in claims}
    for key in ("SWARM_STATE_DB", "SWARM_CHECKPOINT_DIR"):
        assert any(Path(env[key]).is_relative_to(m) for m in mounts), (
            f"k8s {name}: {key}={env[key]} is on no persistent volume"
        )
    assert pod["securityContext"].get("fsGroup") == 10001, f"k8s {name}: the volume must be writable by user 10001"

    name, pod, c, env = workloads["server"]
    assert name in deployments, "stage servers are a Deployment (scalable)"
    assert env["SWARM_STAGE"] == "auto"
    pod_ip = next(v for v in c["env"] if v["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    advertise = next(v for v in c["env"] if v["name"] == "SWARM_ADVERTISE_URL")["value"]
    assert advertise == f"http://$(POD_IP):{SERVER_PORT}", advertise
    names = [v["name"] for v in c["env"]]
    assert names.index("POD_IP") < names.index("SWARM_ADVERTISE_URL"), "POD_IP must be defined before it is used"
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > float(env["SWARM_DRAIN_TIMEOUT_S"]), f"k8s {name}: grace period {grace} s <= SWARM_DRAIN_TIMEOUT_S"

    name, *_ = workloads["train"]
    assert name in jobs, "the trainer is a Job"


def test_k8s_gpu_overlay(rendered):
    base, gpu = _by_sub(rendered["base"]), _by_sub(rendered["gpu"])
    _, _, c, env = gpu["server"]
    assert env["SWARM_DEVICE"] == "cuda" and base["server"][3]["SWARM_DEVICE"] == "cpu"
    assert str(c["resources"]["limits"].get("nvidia.com/gpu")) == "1", c["resources"]
    assert c["image"] == base["server"][2]["image"] + "-cuda", f"GPU stage servers run {c['image']}"
    for sub in ("coordinator", "train"):  # no weights there: the CPU image
        assert gpu[sub][2]["image"] == base[sub][2]["image"], f"the GPU overlay changed the {sub}'s image"


# ---------------------------------------------------------------------------- Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_dockerfile_pins_torch_and_matches_the_code():
    instructions = _dockerfile()
    stages = {
        m.group(1): i
        for i, (op, arg) in enumerate(instructions)
        if op == "FROM" and (m := re.search(r" AS (\S+)$", arg, re.IGNORECASE))
    }
    assert {"torch", "app"} <= set(stages), f"a torch stage and the final one: {sorted(stages)}"
    args = dict(arg.split("=", 1) for op, arg in instructions if op == "ARG" and "=" in arg)
    assert args["DEVICE"] == "cpu" and args["TORCH_VERSION"] == TORCH_VERSION, args
    assert args["BASE_IMAGE"] == "python:3.11-slim" and args["TORCH_INDEX_URL"] == "", args

    def stage(name, op):
        start = stages[name]
        end = min([i for i in stages.values() if i > start] + [len(instructions)])
        return [arg for o, arg in instructions[start:end] if o == op]

    # The classic builder (docker-compose 1.29's) builds every stage of the file: one stage
    # installs torch, choosing its index by DEVICE, and the final stage copies its venv.
    installs = [arg for op, arg in instructions if op == "RUN" and "torch==" in arg]
    assert len(installs) == 1 and installs == [r for r in stage("torch", "RUN") if "torch==" in r], installs
    torch_run = installs[0]
    assert '"torch==${TORCH_VERSION}"' in torch_run and '--index-url "$index"' in torch_run, torch_run
    assert f'[ "$DEVICE" = cpu ]; then index={TORCH_CPU_INDEX}' in torch_run, torch_run
    assert "index=https://pypi.org/simple" in torch_run and "--find-links /opt/image-extras" in torch_run
    assert "--from=torch /opt/venv /opt/venv" in stage("app", "COPY"), stage("app", "COPY")
    assert f"TORCH_VERSION ?= {TORCH_VERSION}" in (ROOT / "Makefile").read_text(), (
        "the Makefile and the image pin different torch versions"
    )

    env_names = set()
    for op, arg in instructions:
        if op == "ENV":
            env_names |= set(re.findall(r"(\w+)=", arg))
    known = {f"SWARM_{f.upper()}" for f in known_settings_fields()}
    assert {n for n in env_names if n.startswith("SWARM_")} <= known, (
        f"Dockerfile sets unknown settings: {env_names - known}"
    )
    assert "SWARM_LOG_FORMAT" in env_names and "SWARM_HOST" in env_names
    exposed = {int(p) for op, arg in instructions if op == "EXPOSE" for p in arg.split()}
    assert exposed == {COORDINATOR_PORT, SERVER_PORT}, exposed
    user = [arg for op, arg in instructions if op == "USER"]
    assert user and not user[-1].startswith(("0", "root")), "the image runs as a non-root user"
    cmd = [arg for op, arg in instructions if op == "CMD"][-1]
    assert cmd.startswith('["swarm"'), cmd

    allowed = {
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    for op, arg in instructions:
        if op == "COPY" and not arg.startswith("--from="):
            for source in shlex.split(arg)[:-1]:
                let_through = any(p in allowed for p in [source.rstrip("/"), *map(str, Path(source).parents)])
                exists = "*" in source or (ROOT / source).exists()
                assert exists and let_through, f"COPY {source}: missing, or excluded by .dockerignore"


# ---------------------------------------------------------------------------- docs


def _format_default(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.4g}"
    return str(value)


def test_operating_doc_lists_exactly_the_settings():
    rows = {}
    for line in DOCS.read_text().splitlines():
        if m := re.match(r"\|\s*`(SWARM_\w+)`\s*\|([^|]*)\|([^|]*)\|", line):
            assert m.group(1) not in rows, f"docs/operating.md lists {m.group(1)} twice"
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    fields = known_settings_fields()
    documented = {name.removeprefix("SWARM_").lower() for name in rows}
    assert documented == fields, (
        f"docs/operating.md table: missing {sorted(fields - documented)}, not settings {sorted(documented - fields)}"
    )
    for name, (default_cell, read_by) in rows.items():
        field = name.removeprefix("SWARM_").lower()
        readers = {sub for sub, cls in SETTINGS_FOR.items() if field in settings_fields(cls)}
        listed = set(SETTINGS_FOR) if read_by == "all" else {w.strip() for w in read_by.split(",")}
        assert listed == readers, f"docs/operating.md {name}: read by {sorted(readers)}, the table says {read_by!r}"
        defaults = {_format_default(settings_fields(SETTINGS_FOR[sub])[field].default) for sub in readers} - {""}
        assert set(re.findall(r"`([^`]*)`", default_cell)) == defaults, (
            f"docs/operating.md {name}: default {default_cell!r}, the code says {sorted(defaults) or 'empty'}"
        )


def test_operating_doc_commands_exist(rendered):
    text = DOCS.read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    commands = [
        shlex.split(line.split("#")[0].replace("\\\n", " "))
        for block in blocks
        for line in block.replace("\\\n", " ").splitlines()
    ]
    swarm = [
        c[c.index("swarm") :]
        for c in commands
        if "swarm" in c and c.index("swarm") < len(c) - 1 and c[c.index("swarm") + 1] in COMMANDS
    ]
    assert swarm, "docs/operating.md shows no swarm command"
    for command in swarm:
        _check_command(f"docs/operating.md `{' '.join(command)}`", command)
    assert any(
        c[:2] == ["swarm", "server"] and {"--coordinator", "--advertise-url", "--stage"} <= set(c) for c in swarm
    )
    names = {f"{d['kind'].lower()}/{d['metadata']['name']}" for d in rendered["base"]}
    for ref in re.findall(r"\b((?:deployment|job|service)/[a-z0-9-]+)", text):
        assert ref in names, f"docs/operating.md refers to {ref}, which k8s/ does not define"


def test_image_gets_every_data_file():
    """The image installs the project without -e (pip install /src), so a file other than
    Python source reaches it only through [tool.setuptools.package-data] in pyproject.toml."""
    import tomllib

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-data", {})

    def covered(path: Path) -> bool:
        for package_dir in [p for p in path.parents if (p / "__init__.py").is_file()]:
            package = ".".join(package_dir.relative_to(ROOT).parts)
            rel = path.relative_to(package_dir).parts
            for pattern in package_data.get(package, []) + package_data.get("*", []):
                parts = pattern.split("/")
                if len(parts) == len(rel) and all(fnmatch.fnmatchcase(r, p) for r, p in zip(rel, parts)):
                    return True
        return False

    data = [
        p
        for top in ("shared", "services")
        for p in (ROOT / top).rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    missing = sorted(str(p.relative_to(ROOT)) for p in data if not covered(p))
    assert not missing, (
        f"not installed into the image (add them to [tool.setuptools.package-data] in pyproject.toml): {missing}"
    )
