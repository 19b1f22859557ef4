"""report.html in a real browser: Debian's chromium, headless, driven by selenium through chromedriver.

Each page must load with no console error and every chart image decoded (naturalWidth > 0). CI installs
chromium and sets COHORT_REQUIRE_BROWSER=1, so there a missing browser fails instead of skipping.
"""

from __future__ import annotations

import os
import shutil

import pytest
from test_trainer import DIGITS, _cfg

from cohort.report import build_panels, load_run, write_comparison
from cohort.trainer import GRPOTrainer

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    """Yields a headless chromium session (skips when there is none, unless CI requires one)."""
    if CHROMIUM is None or DRIVER is None:
        if os.environ.get("COHORT_REQUIRE_BROWSER") == "1":
            pytest.fail(
                "COHORT_REQUIRE_BROWSER=1 but chromium / chromedriver is missing (apt-get install chromium chromium-driver)"
            )
        pytest.skip("no chromium + chromedriver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1300,900",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _open(driver, path) -> dict:
    """Returns what the browser made of the page: its title, the charts it decoded and its console errors."""
    driver.get(path.resolve().as_uri())
    state = driver.execute_script(
        """
        const imgs = Array.from(document.querySelectorAll('figure.plot img'));
        return {
          title: document.title,
          plots: imgs.length,
          decoded: imgs.filter(i => i.complete && i.naturalWidth > 0).map(i => i.alt),
          empty: Array.from(document.querySelectorAll('figure.empty')).map(f => f.textContent),
          groups: document.querySelectorAll('div.group').length,
          width: document.documentElement.scrollWidth,
        };
        """
    )
    state["errors"] = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    return state


@pytest.fixture(scope="module")
def two_runs(tiny_model_dir, tmp_path_factory):
    """Returns two real run directories of a few steps with two reward functions, with different lrs."""
    root = tmp_path_factory.mktemp("browser")
    runs = []
    for name, lr in (("lr-5e-3", 5e-3), ("lr-1e-2", 1e-2)):
        cfg = _cfg(
            tiny_model_dir,
            root / name,
            steps=4,
            eval_every=2,
            eval_at_ends=True,
            rewards=[DIGITS, "format"],
            **{"optim.lr": lr, "algo.beta": 0.04, "data.n_eval": 8},
        )
        GRPOTrainer(cfg).train()  # writes report.html at the end
        runs.append(root / name)
    return runs


def test_a_real_runs_report_renders_every_chart_with_no_console_error(browser, two_runs):
    page = two_runs[0] / "report.html"
    expected = [p.title for p in build_panels([load_run(two_runs[0])]) if p.series or p.bands]
    state = _open(browser, page)
    assert state["title"] == "cohort run: lr-5e-3"
    assert state["errors"] == []
    assert state["plots"] == len(expected) and sorted(state["decoded"]) == sorted(expected), state
    assert "Reward: digit_fraction" in state["decoded"] and "Gradient norm" in state["decoded"]
    assert state["groups"] >= 1  # samples grouped by prompt
    assert state["width"] <= 1300  # nothing overflows the window sideways


def test_the_comparison_of_two_runs_renders_with_both_overlaid(browser, two_runs, tmp_path):
    out = write_comparison(two_runs, tmp_path / "compare.html")
    state = _open(browser, out)
    assert state["errors"] == []
    assert state["plots"] >= 10 and len(state["decoded"]) == state["plots"], state
    text = browser.find_element("tag name", "body").text
    assert "lr-5e-3" in text and "lr-1e-2" in text and "optim.lr" in text
