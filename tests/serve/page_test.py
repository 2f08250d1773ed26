"""The search page in a real headless Chromium (Debian's `chromium` + `chromium-driver`): type a
query, press Enter, read the results the page's script fetched and drew; a screenshot of the
page is written beside the test's files."""
from __future__ import annotations

import os
import shutil

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from tests.serve.conftest import CORPUS_SIZE, call


@pytest.fixture
def browser(tmp_path):
    driver_path, chromium = shutil.which("chromedriver"), shutil.which("chromium")
    # `make test` installs both (Makefile); a machine without them fails here, by name.
    assert driver_path and chromium, "install Debian's chromium and chromium-driver packages"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1200,900", "--disable-breakpad",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    # The browser's profile, caches and settings stay in the test's folder, not in $HOME.
    env = dict(os.environ, HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    driver = webdriver.Chrome(service=Service(driver_path, env=env), options=options)
    yield driver
    driver.quit()


def test_typing_a_query_shows_ranked_results(server, served_index, browser, tmp_path):
    _, model_dir, sentences = served_index
    query = sentences[7].strip()  # the page trims what is typed
    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 60)
    # The header is filled in from /health by the page's script.
    wait.until(lambda b: "indexed" in b.find_element(By.ID, "info").text)
    info = browser.find_element(By.ID, "info").text
    assert str(model_dir.resolve()) in info and f"{CORPUS_SIZE} indexed" in info

    box = browser.find_element(By.ID, "query")
    box.send_keys(query)
    box.send_keys(Keys.ENTER)
    wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-state")
               in ("done", "error"))
    items = browser.find_elements(By.CSS_SELECTOR, "#results li")
    # textContent: exactly what the script wrote (.text would collapse whitespace).
    shown = [tuple(li.find_element(By.CLASS_NAME, name).get_attribute("textContent")
                   for name in ("score", "sentence")) for li in items]
    browser.save_screenshot(str(tmp_path / "serve_page.png"))
    assert (tmp_path / "serve_page.png").stat().st_size > 1000
    assert browser.find_element(By.ID, "status").text == ""

    # The page asked what the API answers for its form's values (top k 5, threshold 0).
    status, body = call(server.url, "/search", {"queries": [query], "top_k": 5,
                                                "threshold": 0})
    assert status == 200
    assert shown == [(f"{h['score']:.4f}", h["sentence"]) for h in body["results"][0]]
    assert shown[0][0] == "1.0000" and shown[0][1].strip() == query
    assert "?q=" in browser.current_url  # the query is in the address, to share
