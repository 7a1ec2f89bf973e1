"""The coordinator's dashboard in a real browser (headless Chromium) while a real swarm trains:
it lists every replica under its stage, marks the weakest stage, and updates itself
without a reload. A screenshot lands in ``test-artifacts/dashboard.png`` (and tmp_path).

Needs Debian's Chromium (``apt-get install -y --no-install-recommends chromium``, or
``SWARM_TEST_CHROMIUM=/path``) and the ``playwright`` package (no browser download: it
drives that Chromium). Without them the test is skipped, except under CI (``CI`` set),
where it fails.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.e2e.conftest import get_json, wait_until
from tests.e2e.small_swarm import START_S, start_small_swarm, trainer_step

pytestmark = pytest.mark.e2e

ARTIFACT = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard.png"
BROWSER_TIMEOUT_MS = 60_000
READ_DOM = """() => ({
  updates: Number(document.body.dataset.updates),
  replicas: [...document.querySelectorAll("tr.replica")].map(r => ({
    url: r.dataset.url,
    server_id: r.dataset.serverId,
    health: r.dataset.health,
    stage: Number(r.closest("article.stage").dataset.stage),
  })),
  weakest: [...document.querySelectorAll("article.stage.weakest[data-weakest=true]")].map(a => ({
    stage: Number(a.dataset.stage),
    badge: a.querySelector(".badge")?.textContent,
  })),
  step: Math.max(0, ...[...document.querySelectorAll("tr.trainer")].map(t => Number(t.dataset.step))),
  events: [...document.querySelectorAll("#events li")].map(li => li.dataset.event),
  lost: [...document.querySelectorAll("article.stage")].map(a => a.querySelector(".losses")?.dataset.stepsLost),
})"""
INKED_PIXELS = """(selector) => {
  const canvas = document.querySelector(selector);
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let inked = 0;
  for (let i = 3; i < data.length; i += 4) if (data[i]) inked++;
  return inked;
}"""


def browser_or_skip() -> tuple[object, str]:
    """(playwright's sync_playwright, the Chromium binary), or skip (fail under CI)."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing, sync_playwright = "the playwright package (pip install playwright)", None
    chromium = os.environ.get("SWARM_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        missing = "Chromium (apt-get install -y --no-install-recommends chromium, or set SWARM_TEST_CHROMIUM)"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"the dashboard test needs {missing}")
        pytest.skip(f"the dashboard test needs {missing}")
    return sync_playwright, chromium


def test_dashboard_shows_every_replica_marks_the_weakest_stage_and_updates_live(processes, tmp_path):
    sync_playwright, chromium = browser_or_skip()
    swarm = start_small_swarm(processes)
    wait_until(
        lambda: swarm.trainer.poll() is None and trainer_step(swarm.coordinator) >= 1,
        START_S,
        "the trainer's first progress report",
        poll_s=0.2,
    )
    registry = {
        r["url"]: (s["stage"], r["server_id"])
        for s in get_json(swarm.coordinator + "/swarm")["stages"]
        for r in s["replicas"]
    }
    assert set(registry) == {url for _, url in swarm.servers}

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            timeout=BROWSER_TIMEOUT_MS,
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.set_default_timeout(BROWSER_TIMEOUT_MS)
            page.goto(swarm.coordinator + "/", wait_until="load")
            page.evaluate("() => { window.loadedOnce = 'this document' }")  # gone if the page reloads
            page.wait_for_function(
                "() => Number(document.body.dataset.updates) >= 1 && "
                "document.querySelectorAll('tr.trainer').length >= 1"
            )
            first = page.evaluate(READ_DOM)

            # Every replica, under its stage, with its server id; stage 1 (one replica against two) marked weakest.
            assert {r["url"]: (r["stage"], r["server_id"]) for r in first["replicas"]} == registry
            assert first["weakest"] == [{"stage": 1, "badge": "weakest"}], first["weakest"]
            assert first["events"].count("registry.registered") >= 3 and "trainer.joined" in first["events"]
            # each stage says what its steps lost (nothing here: no stage lost every replica)
            lost = [str(s["step"]["steps_lost_total"]) for s in get_json(swarm.coordinator + "/swarm")["stages"]]
            assert first["lost"] == lost == ["0"] * len(lost), first["lost"]

            # Live: later polls redraw the same document with newer data (the trainer's step moves on).
            page.wait_for_function(
                f"() => Number(document.body.dataset.updates) > {first['updates']} && Math.max(0, "
                f"...[...document.querySelectorAll('tr.trainer')].map(t => Number(t.dataset.step))) > {first['step']}"
            )
            second = page.evaluate(READ_DOM)
            assert page.evaluate("() => window.loadedOnce") == "this document", (
                "the page reloaded instead of updating itself"
            )
            assert second["updates"] > first["updates"] and second["step"] > first["step"]
            assert (
                page.evaluate(INKED_PIXELS, "#loss-chart") > 500
                and page.evaluate(INKED_PIXELS, "#throughput-chart") > 500
            ), "a chart is blank"
            assert page.locator("#status").inner_text() == "live"

            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    ARTIFACT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACT)
    print(
        f"dashboard: {len(second['replicas'])} replicas, weakest stage "
        f"{second['weakest'][0]['stage']}, step {first['step']} -> {second['step']} "
        f"over {second['updates'] - first['updates']} updates; screenshot {ARTIFACT}"
    )
