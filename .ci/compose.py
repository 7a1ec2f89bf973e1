#!/usr/bin/env python3
"""`make compose`: the compose file's swarm, for real, in Docker on this machine.

What it does, in order, and what it checks (any failed check exits non-zero):

1. **An engine.** Uses the Docker engine that answers; when none does, installs Debian's
   ``docker.io`` if ``dockerd`` is missing (and ``docker-compose``, Debian's 1.29, which reads
   the same file), records the host's firewall (``iptables-save``, ``ip6tables-save``), the
   forwarding and ``net.bridge`` sysctls and the network links, then starts ``dockerd``.
2. **A base image.** The official ``python:3.11-slim`` when it is there or can be pulled;
   otherwise (no registry) one built from Debian's packages with ``debootstrap`` and
   ``docker import``, kept for the next run.
3. **The project's image** (``swarm-mesh:0.1.0``, the compose file's), built by the
   ``Dockerfile`` with the base as a build argument; when the host keeps torch's wheel on
   disk (pip's ``find-links``), that wheel and the host's CA bundle go into the build
   through ``.ci/image-extras/`` and torch's dependencies come from PyPI.
4. **The swarm.** ``docker-compose up -d`` of ``docker-compose.yml`` (coordinator, 2 stages x
   2 servers, a trainer); from the host: ``/health`` and ``/metrics`` of the coordinator
   (its published port) and of a stage server (its container's address); once the trainer
   is past ``--kill-at-step``, the process of one stage server is killed from the host
   (``docker kill`` would cancel the restart policy); the container restarts and the server
   registers again while training goes on; the trainer exits 0 with every microbatch done
   and its held-out loss fallen by at least ``--min-loss-drop``.
5. **Nothing left.** ``docker-compose down -v``; no container, network or volume of the
   project remains. If this script started the engine it stops it and puts the firewall,
   sysctls and links back, then compares them with the record.

The teardown runs on any failure, Ctrl-C or SIGTERM. It never runs beside the arena's
network namespaces: both hold ``/run/lock/swarm-mesh-host-network.lock`` (the arena shared,
this exclusively). Standard library only (it runs before any venv). The timings of each
phase, and whether the base and the image came from the cache, are printed and written to
``runs/compose/summary.json``; the containers' logs go to ``runs/compose/logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXTRAS = REPO / ".ci" / "image-extras"
PROJECT = "swarm-mesh-ci"
OFFICIAL_BASE = "python:3.11-slim"
DEBIAN_BASE = "swarm-mesh-base:bookworm"  # built here when no registry answers
DEBIAN_PACKAGES = "python3,python3-venv,ca-certificates"
COORDINATOR = "http://127.0.0.1:8000"  # the compose file publishes the coordinator's port on loopback
STAGE_PORT = 8100
PROBED_STAGE = "stage0-a"
KILLED_STAGE = "stage1-b"
LOCK = Path("/run/lock/swarm-mesh-host-network.lock")
SYSCTLS = ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding", "net/ipv6/conf/default/forwarding")


class Failed(Exception):
    """A check did not hold; the message says which and why."""


def log(message: str) -> None:
    print(f"compose: {message}", flush=True)


def run(*argv: str, timeout_s: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kw)
    except subprocess.TimeoutExpired as exc:
        raise Failed(f"{' '.join(argv[:4])} ...: no answer in {timeout_s:.0f} s") from exc
    if check and result.returncode != 0:
        raise Failed(
            f"{' '.join(argv[:6])}: exit {result.returncode}: {(result.stderr or result.stdout).strip()[-2000:]}"
        )
    return result


def wait_for(what: str, probe, timeout_s: float, every_s: float = 1.0):
    """Poll ``probe()`` until it returns something truthy, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """``GET url`` -> (status, body); (0, reason) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status, reply.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except OSError as exc:
        return 0, str(exc)


# ---------------------------------------------------------------- the host's network, recorded


def _normalise_iptables(text: str) -> dict[str, list[str]]:
    """``iptables-save`` -> {table: rules and chain policies}, without counters or comments,
    leaving out tables that hold nothing but ACCEPT policies (they filter nothing)."""
    tables: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line == "COMMIT":
            continue
        if line.startswith("*"):
            current = tables.setdefault(line[1:], [])
        elif current is not None:
            current.append(re.sub(r"\s*\[\d+:\d+\]$", "", line))
    return {
        table: lines
        for table, lines in tables.items()
        if any(line.startswith("-") or (line.startswith(":") and line.split()[1] != "ACCEPT") for line in lines)
    }


def network_state() -> dict:
    """What starting dockerd changes on the host: firewall tables, sysctls, links."""
    state: dict = {"iptables": {}, "sysctl": {}, "links": []}
    for tool in ("iptables", "ip6tables"):
        if shutil.which(f"{tool}-save"):
            state["iptables"][tool] = _normalise_iptables(run(f"{tool}-save", timeout_s=30).stdout)
    for name in list(SYSCTLS) + sorted(
        str(p.relative_to("/proc/sys")) for p in Path("/proc/sys/net/bridge").glob("*") if p.is_file()
    ):
        path = Path("/proc/sys") / name
        if path.exists():
            state["sysctl"][name] = path.read_text().strip()
    state["links"] = sorted(
        line.split(":")[1].strip().split("@")[0] for line in run("ip", "-o", "link", "show").stdout.splitlines()
    )
    state["br_netfilter_module"] = Path("/sys/module/br_netfilter").exists()
    return state


def restore_network(before: dict) -> None:
    """Put the firewall, sysctls and links back as ``before`` recorded them (best effort,
    every step tried; :func:`network_diff` says what still differs)."""
    for tool, tables in before["iptables"].items():
        now = _normalise_iptables(run(f"{tool}-save", timeout_s=30, check=False).stdout)
        for table in now:
            if table not in tables:  # created since: empty it, ACCEPT everywhere
                run(tool, "-t", table, "-F", check=False)
                run(tool, "-t", table, "-X", check=False)
                for line in now[table]:
                    if line.startswith(":") and line.split()[1] != "-":
                        run(tool, "-t", table, "-P", line[1:].split()[0], "ACCEPT", check=False)
        text = "".join(
            f"*{table}\n" + "".join(f"{line}\n" for line in lines) + "COMMIT\n" for table, lines in tables.items()
        )
        if text:
            run(f"{tool}-restore", input=text, check=False)
    for name, value in before["sysctl"].items():
        path = Path("/proc/sys") / name
        with contextlib.suppress(OSError):
            if path.read_text().strip() != value:
                path.write_text(value + "\n")
    for link in sorted(set(network_state()["links"]) - set(before["links"])):
        run("ip", "link", "delete", link, check=False)
    if not before["br_netfilter_module"] and Path("/sys/module/br_netfilter").exists() and shutil.which("rmmod"):
        run("rmmod", "br_netfilter", check=False)


def network_diff(before: dict, after: dict) -> list[str]:
    diffs = []
    for key in ("iptables", "sysctl"):
        for name in sorted(set(before[key]) | set(after[key])):
            if before[key].get(name) != after[key].get(name):
                diffs.append(f"{key} {name}: {before[key].get(name)!r} -> {after[key].get(name)!r}")
    if before["links"] != after["links"]:
        diffs.append(f"links: {before['links']} -> {after['links']}")
    if before["br_netfilter_module"] != after["br_netfilter_module"]:
        diffs.append("the br_netfilter module is loaded now (no rmmod here to unload it)")
    return diffs


# ---------------------------------------------------------------- engine, base, image


def apt_install(*packages: str) -> None:
    if os.geteuid() != 0:
        raise Failed(f"installing {', '.join(packages)} needs root (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run("apt-get", "update", "-qq", timeout_s=300, env=env)
    run("apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages, timeout_s=600, env=env)


def engine_answers() -> bool:
    return run("docker", "info", "--format", "{{.ServerVersion}}", timeout_s=20, check=False).returncode == 0


def start_engine(out: Path) -> subprocess.Popen:
    logfile = open(out / "dockerd.log", "w")  # noqa: SIM115 - open while dockerd runs
    proc = subprocess.Popen(["dockerd"], stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("dockerd answering", lambda: proc.poll() is not None or engine_answers(), 90)
    except Failed:
        stop_engine(proc)
        raise
    if proc.poll() is not None:
        raise Failed(f"dockerd exited ({proc.returncode}); see {out / 'dockerd.log'}")
    return proc


def stop_engine(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def image_exists(name: str) -> bool:
    return run("docker", "image", "inspect", name, timeout_s=30, check=False).returncode == 0


def base_image(requested: str | None, out: Path) -> tuple[str, str]:
    """(image, how it came: present, pulled, cached or built)."""
    if requested:
        if not image_exists(requested):
            run("docker", "pull", requested, timeout_s=600)
            return requested, "pulled"
        return requested, "present"
    for name, how in ((OFFICIAL_BASE, "present"), (DEBIAN_BASE, "cached")):
        if image_exists(name):
            return name, how
    if run("docker", "pull", OFFICIAL_BASE, timeout_s=120, check=False).returncode == 0:
        return OFFICIAL_BASE, "pulled"
    log(f"no registry answers: building {DEBIAN_BASE} from Debian's packages (debootstrap)")
    if not shutil.which("debootstrap"):
        apt_install("debootstrap")
    root = Path(tempfile.mkdtemp(prefix="swarm-mesh-rootfs-"))
    try:
        with open(out / "debootstrap.log", "w") as debootstrap_log:
            result = subprocess.run(
                ["debootstrap", "--variant=minbase", f"--include={DEBIAN_PACKAGES}", "bookworm", str(root)],
                stdout=debootstrap_log,
                stderr=subprocess.STDOUT,
                timeout=900,
            )
        if result.returncode != 0:
            raise Failed(f"debootstrap: exit {result.returncode}; see {out / 'debootstrap.log'}")
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        run("docker", "import", "-", DEBIAN_BASE, stdin=tar.stdout, timeout_s=300)
        tar.wait(timeout=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return DEBIAN_BASE, "built"


def pip_setting(name: str) -> list[str]:
    """A pip setting as the host's pip reads it (environment, then config files)."""
    values = os.environ.get(f"PIP_{name.upper().replace('-', '_')}", "").split()
    listed = run(sys.executable, "-m", "pip", "config", "list", timeout_s=60, check=False).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.split(".")[-1] == name:
            values += value.strip("'\"").split()
    return values


def torch_version() -> str:
    match = re.search(r"^ARG TORCH_VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    if not match:
        raise Failed("the Dockerfile pins no TORCH_VERSION")
    return match.group(1)


def stage_extras() -> dict:
    """The host's torch wheel (for the image's Python 3.11) and CA bundle into
    .ci/image-extras/, when the host has them; what was staged."""
    version = torch_version()
    wheels = sorted(
        {
            Path(p)
            for folder in pip_setting("find-links")
            if not folder.startswith(("http:", "https:"))
            for p in glob.glob(
                os.path.join(folder.removeprefix("file://"), f"torch-{version}*-cp311-*linux*x86_64.whl")
            )
        }
    )
    staged: dict = {"wheels": [], "ca": None}
    for wheel in wheels[:1]:
        shutil.copy2(wheel, EXTRAS / wheel.name)
        staged["wheels"].append(wheel.name)
    for cert in pip_setting("cert")[:1]:
        if Path(cert).is_file():
            shutil.copy2(cert, EXTRAS / "ca.crt")
            staged["ca"] = cert
    return staged


def clear_extras() -> None:
    for path in EXTRAS.iterdir():
        if path.name != "README.md":
            path.unlink()


def build_image(base: str, image: str, out: Path) -> dict:
    staged = stage_extras()
    args = ["--build-arg", f"BASE_IMAGE={base}"]
    if staged["wheels"]:
        # the local wheel (a +cpu build, which sorts above PyPI's CUDA build of the same
        # version) and torch's dependencies from the index the host's pip uses, if a web one
        index = next(
            (u for u in pip_setting("index-url") if u.startswith(("http:", "https:"))), "https://pypi.org/simple"
        )
        args += ["--build-arg", f"TORCH_INDEX_URL={index}"]
    started = time.monotonic()
    try:
        with open(out / "build.log", "w") as build_log:
            result = subprocess.run(
                ["docker", "build", *args, "-t", image, str(REPO)],
                stdout=build_log,
                stderr=subprocess.STDOUT,
                timeout=1800,
                env={**os.environ, "DOCKER_BUILDKIT": "0"},  # the builder docker-compose 1.29 uses
            )
    finally:
        clear_extras()
    text = (out / "build.log").read_text()
    if result.returncode != 0:
        raise Failed(f"docker build: exit {result.returncode}; the end of {out / 'build.log'}:\n{text[-1500:]}")
    steps = len(re.findall(r"^Step \d+/\d+", text, re.MULTILINE))
    cached = len(re.findall(r"Using cache", text))
    return {**staged, "seconds": round(time.monotonic() - started, 1), "steps": steps, "cached_steps": cached}


# ---------------------------------------------------------------- the swarm


def compose(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return run(
        "docker-compose", "-p", PROJECT, "-f", str(REPO / "docker-compose.yml"), *args, timeout_s=timeout_s, check=check
    )


def container(service: str) -> str:
    cid = compose("ps", "-q", service).stdout.strip()
    if not cid:
        raise Failed(f"no container for {service}")
    return cid


def inspect(cid: str, template: str) -> str:
    return run("docker", "inspect", "-f", template, cid, timeout_s=30).stdout.strip()


def trainer_events(cid: str) -> list[dict]:
    """The trainer's JSON log lines so far."""
    result = run("docker", "logs", cid, timeout_s=60, check=False)
    events = []
    for line in (result.stdout + result.stderr).splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def trainer_step(cid: str) -> int:
    steps = [
        e["step"] for e in trainer_events(cid) if e.get("event") == "train.step" and isinstance(e.get("step"), int)
    ]
    return max(steps, default=-1)


def registered(url: str, stage: int, after: float) -> dict | None:
    """The coordinator's live record of ``url`` in ``stage``, if it registered after ``after``."""
    status, body = get(f"{COORDINATOR}/swarm")
    if status != 200:
        return None
    for replica in json.loads(body)["stages"][stage]["replicas"]:
        if replica["url"] == url and replica["registered_at"] > after:
            return replica
    return None


def server_pid(cid: str) -> int:
    """The host PID of the ``swarm server`` process in a container (under docker-init)."""
    top = run("docker", "top", cid, "-eo", "pid,args", timeout_s=30).stdout.splitlines()[1:]
    pids = [int(row.split(None, 1)[0]) for row in top if "swarm server" in row or "stage_server" in row]
    if not pids:
        raise Failed(f"no swarm server process in {cid[:12]}: {top}")
    return pids[0]


def check_endpoints(base_url: str, who: str) -> dict:
    status, body = get(f"{base_url}/health")
    if status != 200 or json.loads(body).get("status") != "ok":
        raise Failed(f"{who} {base_url}/health: {status} {body[:300]}")
    health = json.loads(body)
    status, metrics = get(f"{base_url}/metrics")
    if status != 200 or "swarm_build_info" not in metrics:
        raise Failed(f"{who} {base_url}/metrics: {status} {metrics[:300]}")
    return {"health": {k: health[k] for k in list(health)[:4]}, "metrics_lines": len(metrics.splitlines())}


def run_swarm(args, image: str) -> dict:
    report: dict = {}
    status, _ = get(f"{COORDINATOR}/health", timeout_s=2)
    if status:
        raise Failed(f"something already answers at {COORDINATOR}, the port the compose file publishes")
    started = time.monotonic()
    # -d, then `docker wait` for the trainer: with --exit-code-from (which implies
    # --abort-on-container-exit) compose 1.29 would stop the whole swarm the moment the killed
    # server's container exits, before its restart policy brings it back.
    compose("up", "-d", "--no-build", timeout_s=600)
    report["up_s"] = round(time.monotonic() - started, 1)
    trainer = container("trainer")
    report["coordinator"] = check_endpoints(COORDINATOR, "coordinator")
    probed = container(PROBED_STAGE)
    address = inspect(probed, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
    report[PROBED_STAGE] = check_endpoints(f"http://{address}:{STAGE_PORT}", PROBED_STAGE)
    log(f"/health and /metrics answer from the host: coordinator, {PROBED_STAGE} at {address}")

    wait_for(f"the trainer past step {args.kill_at_step}", lambda: trainer_step(trainer) >= args.kill_at_step, 600, 2)
    victim = container(KILLED_STAGE)
    restarts_before = int(inspect(victim, "{{.RestartCount}}"))
    pid = server_pid(victim)
    killed_at, killed_wall, step_at_kill = time.monotonic(), time.time(), trainer_step(trainer)
    os.kill(pid, signal.SIGKILL)
    log(f"killed {KILLED_STAGE}'s server (host pid {pid}) at trainer step {step_at_kill}")
    url = f"http://{KILLED_STAGE}:{STAGE_PORT}"
    stage = int(KILLED_STAGE.removeprefix("stage").split("-")[0])
    replica = wait_for(f"{KILLED_STAGE} registered again", lambda: registered(url, stage, killed_wall), 300, 1)
    restarts = int(inspect(victim, "{{.RestartCount}}"))
    if restarts <= restarts_before:
        raise Failed(f"{KILLED_STAGE} registered again but its container did not restart ({restarts})")
    step_at_rejoin = trainer_step(trainer)
    report["kill"] = {
        "service": KILLED_STAGE,
        "trainer_step_at_kill": step_at_kill,
        "rejoined_s": round(time.monotonic() - killed_at, 1),
        "trainer_step_at_rejoin": step_at_rejoin,
        "restart_count": restarts,
        "server_id": replica["server_id"],
    }
    log(f"{KILLED_STAGE} restarted and registered again after {report['kill']['rejoined_s']} s (step {step_at_rejoin})")

    exit_code = int(run("docker", "wait", trainer, timeout_s=1800).stdout.strip())
    report["train_s"] = round(time.monotonic() - started, 1)
    events = trainer_events(trainer)
    done = next((e for e in reversed(events) if e.get("event") == "train.done"), None)
    if exit_code != 0 or done is None:
        raise Failed(f"the trainer exited {exit_code} ({'no train.done' if done is None else done})")
    report["train"] = {
        k: done.get(k) for k in ("steps", "completed", "failed", "tokens_per_s", "eval_loss_before", "eval_loss_after")
    }
    last_step = trainer_step(trainer)
    if last_step <= step_at_kill:
        raise Failed(f"no step after the kill (last {last_step}, killed at {step_at_kill})")
    drop = done["eval_loss_before"] - done["eval_loss_after"]
    if done.get("failed") or drop < args.min_loss_drop:
        raise Failed(f"training: {report['train']}: the held-out loss fell by {drop:.3f} (< {args.min_loss_drop})")
    log(
        f"trained {done['steps']} steps in containers: held-out loss {done['eval_loss_before']} -> "
        f"{done['eval_loss_after']}, {done['tokens_per_s']} tokens/s"
    )
    return report


def save_logs(out: Path) -> None:
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    for service in compose("config", "--services", check=False).stdout.split():
        result = compose("logs", "--no-color", service, timeout_s=60, check=False)
        (logs / f"{service}.log").write_text(result.stdout + result.stderr)


def leftovers() -> list[str]:
    label = f"label=com.docker.compose.project={PROJECT}"
    left = []
    for kind, argv in (
        ("container", ["docker", "ps", "-aq", "--filter", label]),
        ("network", ["docker", "network", "ls", "-q", "--filter", label]),
        ("volume", ["docker", "volume", "ls", "-q", "--filter", label]),
    ):
        left += [f"{kind} {x}" for x in run(*argv, timeout_s=60).stdout.split()]
    return left


# ---------------------------------------------------------------- main


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="base image to build on (default: python:3.11-slim, else one from Debian)")
    parser.add_argument("--kill-at-step", type=int, default=40, help="kill a stage server once the trainer is past it")
    parser.add_argument("--min-loss-drop", type=float, default=1.0, help="held-out loss must fall at least this much")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "compose")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminate)
    image = re.search(r"^\s*image:\s*(\S+)", (REPO / "docker-compose.yml").read_text(), re.MULTILINE).group(1)

    summary: dict = {"ok": False, "phases_s": {}}
    phases = summary["phases_s"]
    t0 = time.monotonic()
    engine, before, swarm_started = None, None, False
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    lock = open(LOCK, "a")  # noqa: SIM115 - held for the whole run
    try:
        log(f"waiting for {LOCK} (the arena's network namespaces hold it shared)")
        fcntl.flock(lock, fcntl.LOCK_EX)
        t = time.monotonic()
        missing = [
            pkg
            for tool, pkg in (("docker-compose", "docker-compose"), ("docker", "docker.io"))
            if not shutil.which(tool)
        ]
        if not engine_answers():
            if not shutil.which("dockerd") and "docker.io" not in missing:
                missing.append("docker.io")
        if missing:
            log(f"installing {', '.join(missing)} (apt)")
            apt_install(*missing)
        phases["packages"] = round(time.monotonic() - t, 1)
        summary["packages_installed"] = missing

        t = time.monotonic()
        if engine_answers():
            summary["engine"] = "already running: left as found"
        else:
            before = network_state()
            (args.out / "network-before.json").write_text(json.dumps(before, indent=1))
            engine = start_engine(args.out)
            summary["engine"] = "started here, stopped after; the host's firewall restored"
        summary["engine_version"] = run("docker", "info", "--format", "{{.ServerVersion}}").stdout.strip()
        phases["engine"] = round(time.monotonic() - t, 1)

        t = time.monotonic()
        base, how = base_image(args.base, args.out)
        summary["base_image"] = {"image": base, "how": how}
        phases["base_image"] = round(time.monotonic() - t, 1)
        log(f"base image {base} ({how}) in {phases['base_image']} s")

        t = time.monotonic()
        summary["build"] = build_image(base, image, args.out)
        phases["build"] = round(time.monotonic() - t, 1)
        log(
            f"built {image} in {phases['build']} s "
            f"({summary['build']['cached_steps']} of {summary['build']['steps']} steps cached)"
        )

        t = time.monotonic()
        swarm_started = True
        summary["swarm"] = run_swarm(args, image)
        phases["swarm"] = round(time.monotonic() - t, 1)
        summary["ok"] = True
    except Failed as exc:
        summary["error"] = str(exc)
        log(f"FAILED: {exc}")
    except (KeyboardInterrupt, SystemExit) as exc:
        summary["error"] = f"interrupted ({exc!r})"
        log(summary["error"])
    finally:
        t = time.monotonic()
        try:
            if swarm_started:
                save_logs(args.out)
                compose("down", "-v", "--remove-orphans", "--timeout", "45", timeout_s=300, check=False)
                left = leftovers()
                summary["left_after_down"] = left
                if left:
                    summary["ok"] = False
                    log(f"FAILED: left after docker-compose down -v: {left}")
        except Failed as exc:
            summary["ok"] = False
            log(f"FAILED: teardown: {exc}")
        finally:
            if engine is not None:
                stop_engine(engine)
            if before is not None:
                restore_network(before)
                diffs = network_diff(before, network_state())
                summary["network_after"] = diffs or "as before"
                if diffs:
                    summary["ok"] = False
                    log("FAILED: the host's network differs from before: " + "; ".join(diffs))
            phases["teardown"] = round(time.monotonic() - t, 1)
            phases["total"] = round(time.monotonic() - t0, 1)
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            log(f"{'passed' if summary['ok'] else 'FAILED'}: " + ", ".join(f"{k} {v} s" for k, v in phases.items()))
            log(f"summary in {args.out / 'summary.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
