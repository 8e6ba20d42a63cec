"""The HTML report as a browser shows it: headless Chromium parses it and takes a screenshot.

.ci/run installs Debian's ``chromium``; elsewhere the test is skipped when no Chromium is found,
but on CI (``CI=true``) a missing browser is a failure.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

import pytest

import autopar
from autopar.models import examples
from autopar.report import write_report
from autopar.report.collect import graph_groups
from autopar.runtime.collectives import collective_nodes

_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--hide-scrollbars")


def _browser() -> str:
    found = next((path for path in map(shutil.which, _NAMES) if path), None)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no Chromium on CI: .ci/run must install Debian's chromium package")
        pytest.skip("no Chromium found (apt-get install chromium)")
    return found


def _run(browser: str, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([browser, *_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=120)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    model, (tokens,), loss_fn, targets = examples.gpt_tiny()
    result = autopar.plan(model, {"dp": 2, "pp": 2, "tp": 2}, example_inputs=(tokens,), loss_fn=loss_fn,
                          example_target=targets)
    path = write_report(result, tmp_path_factory.mktemp("report") / "report.html")
    return result, path


def test_chromium_renders_the_plan_graphs_collectives_and_timeline(report):
    browser = _browser()
    result, path = report
    done = _run(browser, "--dump-dom", path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert "Plan for GPT: dp=2 x pp=2 x tp=2 = 8 ranks" in dom
    assert len(re.findall(r'<section class="graph" id="graph-s\d-t\d"', dom)) == 4
    collectives = sum(len(collective_nodes(g.graph.gm)) for g in graph_groups(result))
    assert dom.count('<span class="badge coll"') == collectives
    assert dom.count('<span class="badge p2p"') == 4  # one send and one recv per tp rank
    svg = re.search(r'<svg class="timeline".*?</svg>', dom, flags=re.S).group(0)
    assert svg.count('class="ev ev-F"') == result.plan.pipeline.num_microbatches * 2
    assert len(re.findall(r'<tr class="mem-row">', dom)) == 8


def test_chromium_screenshot_is_not_blank(report, tmp_path):
    from PIL import Image

    browser = _browser()
    _result, path = report
    shot = tmp_path / "report.png"
    done = _run(browser, "--window-size=1280,1800", f"--screenshot={shot}", path.as_uri())
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1800)
    colors = image.getcolors(maxcolors=1 << 20)
    assert len(colors) > 50  # text, bars and tables, not one flat colour
    non_white = sum(count for count, rgb in colors if rgb != (255, 255, 255))
    assert non_white > 0.05 * 1280 * 1800
    pixels = {rgb for _count, rgb in colors}
    assert (0x4C, 0x72, 0xB0) in pixels and (0x55, 0xA8, 0x68) in pixels  # the timeline's F and B bars


def test_chromium_renders_the_expert_placement_and_its_links(tmp_path):
    import torch

    from autopar.models.moe import build_moe, moe_loss

    browser = _browser()
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (8, 16))
    result = autopar.plan(build_moe("switch"), {"dp": 2}, example_inputs=(idx,), loss_fn=moe_loss,
                          example_target=idx, expert_parallel=2, num_microbatches=1)
    path = write_report(result, tmp_path / "moe.html")
    done = _run(browser, "--dump-dom", path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert len(re.findall(r'<tr class="expert-row" id="experts-rank-\d">', dom)) == 2  # one row per rank
    assert len(re.findall(r'<tr class="exchange-row">', dom)) == 4  # 2 layers x 2 ranks
    targets = set(re.findall(r'<a href="#(graph-s\d-t\d)"><code class="exchange', dom))
    assert targets and all(f'id="{t}"' in dom for t in targets)  # each node links to its graph's section
