"""The report in a real browser: headless Chromium renders it, takes a screenshot, and every section is there,
every plot drew at a readable size, and the page logs no console error.

Chromium is Debian's `chromium` package (`make system` installs it as root with apt). The page itself holds no
script; for the measurements a copy of it gets one that writes what it measured into the DOM, which
`--dump-dom` returns.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from helpers import TH, synthetic, write_run

from mappa.analysis.report import SECTIONS, build_report, write_report
from mappa.analysis.runs import load_run

pytestmark = pytest.mark.integration

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0"]  # fmt: skip
MEASURE = """<script>
window.__errors = [];
window.addEventListener("error", e => window.__errors.push(String(e.message || e.target && e.target.outerHTML)), true);
const origError = console.error;
console.error = (...a) => { window.__errors.push(a.join(" ")); origError(...a); };
window.addEventListener("load", () => {
  const figs = [...document.querySelectorAll("figure.plot")].map(f => {
    const svg = f.querySelector("svg"), r = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
    return {name: f.dataset.plot, width: r.width, height: r.height,
            shapes: svg ? svg.querySelectorAll("path, line, rect, use").length : 0,
            text: svg ? svg.querySelectorAll("text").length : 0};
  });
  const sections = [...document.querySelectorAll("section[data-section]")].map(s => s.dataset.section);
  const pre = document.createElement("pre");
  pre.id = "measured";
  pre.textContent = JSON.stringify({figs, sections, errors: window.__errors, width: document.body.scrollWidth});
  document.body.appendChild(pre);
});
</script>"""


def chromium() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.skip("chromium not installed (`make system` installs it as root with apt): no browser test")


def run_browser(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([chromium(), *FLAGS, *args], capture_output=True, text=True, timeout=timeout)


def console_messages(stderr: str) -> list[str]:
    """What the page wrote to the console, as Chromium logs it (`--enable-logging=stderr`: every level appears
    as INFO:CONSOLE). The report holds no script, so any line is an error (an uncaught exception, a
    console.error of the measuring script's hook)."""
    return [x for x in stderr.splitlines() if ":CONSOLE" in x]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    tmp = tmp_path_factory.mktemp("browser")
    a = load_run(write_run(tmp / "biased", synthetic(bias=2.5, coder_rise=0.8)))
    b = load_run(write_run(tmp / "outcome", synthetic(seed=3), coach={"backend": "outcome"}, probes=False))
    built = build_report([a, b], [TH, TH])
    write_report(built, tmp / "report.html")
    return tmp / "report.html", built.figures


def test_every_section_is_there_and_every_plot_drew(report: tuple[Path, int]) -> None:
    path, figures = report
    probe = path.with_name("measure.html")
    probe.write_text(path.read_text().replace("<head>", "<head>" + MEASURE, 1))
    proc = run_browser("--window-size=1280,2000", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r'<pre id="measured">(.*?)</pre>', proc.stdout, re.DOTALL)
    assert found, proc.stdout[-2000:]
    measured = json.loads(html.unescape(found.group(1)))
    for name in SECTIONS:  # each run's sections; the comparison and the alarms once
        assert measured["sections"].count(name) == 2, name
    assert {"alarms", "comparison"} <= set(measured["sections"])
    assert len(measured["figs"]) == figures >= 20
    for fig in measured["figs"]:  # drawn at the page's width, with its aspect, axes, marks and labels
        assert 800 <= fig["width"] <= 1010 and 150 <= fig["height"] <= 900, fig
        assert fig["shapes"] >= 5 and fig["text"] >= 3, fig
    assert measured["width"] <= 1280  # no sideways scrolling on a laptop screen
    assert measured["errors"] == [] and console_messages(proc.stderr) == []


def test_screenshot(report: tuple[Path, int]) -> None:
    path, _ = report
    shot = path.with_name("report.png")
    proc = run_browser("--window-size=1280,2400", f"--screenshot={shot}", path.as_uri())
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1280, 2400)
    assert len(data) > 50_000  # text, tables and plots, not a blank page
    assert console_messages(proc.stderr) == []
