"""The page at ``/`` in a real headless Chromium (Debian's chromium + chromedriver, installed by
`make system-tools`), driven by Selenium, against a live server on the smoke pipeline's bundle:
the verdicts it shows equal the API's, the per-block chart is drawn, the API key is asked for and
remembered for the tab, refused files are explained in words."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.settings import Settings
from tests.live_server import LiveServer
from tests.service_helpers import API_KEY

pytestmark = pytest.mark.slow

MAX_BODY = 300_000
KEYED = {"X-API-Key": API_KEY}


@pytest.fixture(scope="module")
def page_server(smoke_run: Path) -> Iterator[LiveServer]:
    settings = Settings(
        bundle=smoke_run / "bundle", device="cpu", api_key=API_KEY, max_body_bytes=MAX_BODY
    )
    with LiveServer(settings) as live:
        yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    driver_path, chromium = shutil.which("chromedriver"), shutil.which("chromium")
    if driver_path is None or chromium is None:
        pytest.fail("chromium and chromedriver are missing: run `make system-tools`")
    options = Options()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1100,1600")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, timeout: float = 30.0):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The page rebuilds its live panel on every refresh (#live-requests among it): an element
    # found in one poll may be replaced before it is read; the next poll finds the new one.
    wait = WebDriverWait(driver, timeout, ignored_exceptions=[StaleElementReferenceException])
    return wait.until(condition)


def _css(driver, selector: str) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def _enter_key(driver) -> None:
    _wait(driver, lambda d: _css(d, "#key-panel")[0].is_displayed())
    _css(driver, "#key-input")[0].send_keys(API_KEY)
    _css(driver, "#key-form button")[0].click()
    _wait(driver, lambda d: len(_css(d, "#gallery button.sample")) > 0)


def _upload(driver, *paths: Path) -> None:
    _css(driver, "#file-input")[0].send_keys("\n".join(str(p) for p in paths))


def _cards(driver, count: int) -> list:
    """The first ``count`` result cards once none is pending (newest first on the page)."""
    _wait(
        driver,
        lambda d: len(_css(d, ".result")) >= count and not _css(d, ".result.pending"),
    )
    return _css(driver, ".result")


def _gallery_files(server: LiveServer, folder: Path) -> dict[str, Path]:
    """The bundle's gallery PNGs, saved as a user's files: by kind, the first of each."""
    samples = httpx.get(server.url + "/v1/gallery", headers=KEYED).json()["samples"]
    files: dict[str, Path] = {}
    for sample in samples:
        if sample["kind"] not in files:
            png = httpx.get(server.url + sample["url"], headers=KEYED).content
            files[sample["kind"]] = folder / sample["name"]
            files[sample["kind"]].write_bytes(png)
    return files


def test_page_shows_the_apis_verdicts_and_draws_the_chart(
    page_server: LiveServer, browser, tmp_path: Path
) -> None:
    files = _gallery_files(page_server, tmp_path)
    assert {"clean", "adversarial"} <= set(files)
    started = time.perf_counter()
    browser.get(page_server.url + "/")
    _wait(browser, lambda d: _css(d, "#model-list"))
    load_seconds = time.perf_counter() - started
    assert load_seconds < 5  # the page is ~25 kB from loopback (about 1 s is the aim)
    _enter_key(browser)
    _upload(browser, files["clean"], files["adversarial"])
    cards = _cards(browser, 2)
    with httpx.Client(base_url=page_server.url, headers=KEYED) as client:
        for card in cards[:2]:
            name = card.find_element("css selector", "h3").text
            answer = client.post(
                "/v1/predict", files={"files": (name, Path(tmp_path / name).read_bytes())}
            ).json()["results"][0]
            assert card.get_attribute("data-flagged") == str(answer["flagged"]).lower()
            assert card.get_attribute("data-label") == answer["class_name"]
            assert float(card.get_attribute("data-score")) == pytest.approx(answer["score"])
            verdict = card.find_element("css selector", ".verdict").text
            assert verdict == ("FLAGGED" if answer["flagged"] else "not flagged")
            _assert_charts_drawn(card, n_blocks=3)
    browser.save_screenshot(str(tmp_path / "page.png"))
    assert (tmp_path / "page.png").stat().st_size > 10_000
    # No script error and nothing refused by the page's CSP (the 401s before the key was entered
    # are logged by the browser as failed network requests: that is how the page learns of it).
    logs = browser.get_log("browser")
    severe = [e for e in logs if e["level"] == "SEVERE" and e["source"] != "network"]
    assert not severe, severe
    failed = [e["message"] for e in logs if e["source"] == "network"]
    assert all("401" in message for message in failed), failed


def _assert_charts_drawn(card, n_blocks: int) -> None:
    """Two charts (msq, cos), each with the clean band and one input point per block."""
    charts = card.find_elements("css selector", "svg.chart")
    assert len(charts) == 2
    for chart in charts:
        points = chart.find_element("css selector", "polyline.input-line").get_attribute("points")
        assert len(points.split()) == n_blocks
        assert len(chart.find_elements("css selector", "polygon.band-outer")) == 1
        assert len(chart.find_elements("css selector", "circle.point")) == n_blocks


def test_the_key_is_remembered_for_the_tab_and_refusals_are_shown_in_words(
    page_server: LiveServer, browser, tmp_path: Path
) -> None:
    browser.get(page_server.url + "/")  # same tab as the previous test: the key is kept
    _wait(browser, lambda d: len(_css(d, "#gallery button.sample")) > 0)
    assert not _css(browser, "#key-panel")[0].is_displayed()
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 20)
    huge = tmp_path / "huge.png"
    huge.write_bytes(b"\0" * (MAX_BODY + 50_000))
    _upload(browser, corrupt)
    refused = _cards(browser, 1)[0]
    assert refused.get_attribute("data-status") == "400"
    assert "Refused (400)" in refused.text and "cannot decode" in refused.text, refused.text
    _upload(browser, huge)
    _wait(browser, lambda d: _css(d, ".result")[0].get_attribute("data-status") == "413")
    too_large = _css(browser, ".result")[0]
    assert "Refused (413)" in too_large.text and str(MAX_BODY) in too_large.text, too_large.text
    browser.execute_script("sessionStorage.clear()")
    browser.get(page_server.url + "/")  # a new session: asked again
    _wait(browser, lambda d: _css(d, "#key-panel")[0].is_displayed())


def test_live_panel_counts_requests(page_server: LiveServer, browser) -> None:
    before = httpx.get(page_server.url + "/v1/stats", headers=KEYED).json()["requests"]
    browser.get(page_server.url + "/")
    _enter_key(browser)
    _css(browser, "#gallery button.sample")[0].click()
    _cards(browser, 1)
    _wait(
        browser,
        lambda d: int(_css(d, "#live-requests")[0].get_attribute("data-requests")) > before,
        timeout=15,
    )
    assert _css(browser, "#live-histogram svg rect.bar")
