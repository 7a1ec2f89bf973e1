"""The dashboard's prompt box in a real browser (headless Chromium): on a swarm with a
secret, Generate without the API key shows the 401's message; with it, the text streams
into #completion chunk by chunk and ends as the greedy completion of the same model in
one process. Stage servers and coordinator run in this process (as in
tests/service/test_completions.py). A screenshot lands in
``test-artifacts/dashboard-prompt.png``.

Needs Debian's Chromium and the ``playwright`` package, as tests/e2e/test_dashboard.py
(skipped without them, except under CI, where it fails).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.test_dashboard import browser_or_skip
from tests.service.test_completions import SECRET, greedy, start_swarm  # noqa: F401 (start_swarm is a fixture)

pytestmark = pytest.mark.e2e

ARTIFACT = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard-prompt.png"
BROWSER_TIMEOUT_MS = 60_000
PROMPT, MAX_TOKENS = "ROMEO:", 24
FINISHED = "() => ['done', 'error'].includes(document.querySelector('#completion').dataset.state)"
# Counts the changes of #completion's text while it streams (each chunk appends to it).
WATCH = """() => {
  window.completionUpdates = 0;
  new MutationObserver(() => { window.completionUpdates += 1; }).observe(
    document.querySelector('#completion'), {childList: true, characterData: true, subtree: true}
  );
}"""


async def test_the_prompt_box_streams_the_greedy_completion(start_swarm, tmp_path):  # noqa: F811
    _, chromium = browser_or_skip()
    from playwright.async_api import async_playwright

    swarm = await start_swarm(secret=SECRET)
    expected, finish, _ = await greedy(PROMPT, MAX_TOKENS)
    shot = tmp_path / "dashboard-prompt.png"
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
            timeout=BROWSER_TIMEOUT_MS,
        )
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 1300})
            page.set_default_timeout(BROWSER_TIMEOUT_MS)
            await page.goto(swarm.url + "/", wait_until="load")
            await page.wait_for_function(
                "() => Number(document.body.dataset.updates) >= 1 && "
                "document.querySelectorAll('tr.replica').length === 4"
            )
            await page.fill("#prompt", PROMPT)
            await page.fill("#max-tokens", str(MAX_TOKENS))
            await page.fill("#temperature", "0")

            # The swarm has a secret: without it as the API key, the API refuses and the page says why.
            await page.click("#generate")
            await page.wait_for_function(FINISHED)
            assert await page.get_attribute("#completion", "data-state") == "error"
            assert "Bearer" in await page.inner_text("#completion-status")

            await page.fill("#api-key", SECRET)
            await page.evaluate(WATCH)
            await page.click("#generate")
            await page.wait_for_function(FINISHED)
            state, text = await page.eval_on_selector("#completion", "e => [e.dataset.state, e.textContent]")
            assert state == "done", await page.inner_text("#completion-status")
            assert text == expected
            assert await page.get_attribute("#completion", "data-finish-reason") == finish
            assert await page.evaluate("() => window.completionUpdates") >= 3, "the text did not arrive in chunks"
            assert not await page.is_disabled("#generate")
            await page.screenshot(path=str(shot), full_page=True)
        finally:
            await browser.close()
    ARTIFACT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACT)
    print(f"dashboard prompt box: {PROMPT!r} -> {text!r} ({finish}); screenshot {ARTIFACT}")
