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
import torch

import autopar
from autopar.models import build_model, examples, lm_loss
from autopar.ops.collectives import collective_nodes
from autopar.report import write_report
from autopar.report.collect import graph_groups
from autopar.report.timeline import simulate_plan
from equivalence import build
from schedule_runners import CRITICAL_PATH_CASES, results

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
    assert len(re.findall(r'class="ev ev-F( crit)?"', svg)) == result.plan.pipeline.num_microbatches * 2
    assert len(re.findall(r'<tr class="mem-row">', dom)) == 8
    # the critical path: its actions outlined on the timeline and joined by one line, as the simulator finds it
    path = simulate_plan(result).sim.critical_path
    outlined = re.findall(r'<rect class="ev ev-[FBW] crit" data-action="(\w+)"', svg)
    assert sorted(outlined) == sorted(path.actions) and len(outlined) >= 4
    assert svg.count('<polyline class="critical-path"') == 1
    listed = re.search(r'<pre id="critical-actions">(.*?)</pre>', dom).group(1).replace("&gt;", ">")
    assert listed.split() == [s.label for s in path.steps]
    assert len(re.findall(r'<tr class="formula-row">', dom)) == result.plan.mesh.pp  # memory as a formula


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


@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_chromium_shows_the_critical_path_of_a_4_rank_pipeline(schedule, tmp_path):
    """1F1B and ZB-V on pp=4 (simulated): the outlined bars are the critical path, which is as long as the step."""
    browser = _browser()
    model = build_model("gpt_tiny", seq_len=32, num_layers=8)
    tokens = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    result = autopar.plan(model, {"pp": 4}, example_inputs=(tokens,), loss_fn=lm_loss, example_target=tokens,
                          schedule=schedule, num_microbatches=8)
    path = write_report(result, tmp_path / "report.html", formula=False)
    done = _run(browser, "--dump-dom", path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    sim = simulate_plan(result).sim
    svg = re.search(r'<svg class="timeline".*?</svg>', dom, flags=re.S).group(0)
    outlined = re.findall(r'<rect class="ev ev-[FBW] crit" data-action="(\w+)"', svg)
    assert sorted(outlined) == sorted(sim.critical_path.actions)
    assert {a[0] for a in outlined} >= {"0", "3"}  # it runs from the first stage to the last and back
    length = float(re.search(r"make the step ([\d.]+) units long", dom).group(1))
    assert length == pytest.approx(sim.step_time, rel=1e-3)
    shares = re.findall(r"<tr><td>pp rank \d</td><td>([\d.]+)</td>", dom.split('id="critical-path"')[1])
    transfers = sum(s.seconds for s in sim.critical_path.steps if s.kind == "transfer")
    assert sum(map(float, shares)) + transfers == pytest.approx(sim.step_time, rel=1e-3)


@pytest.mark.dist
@pytest.mark.parametrize("case", CRITICAL_PATH_CASES, ids=lambda c: dict(c.options)["schedule"])
def test_chromium_shows_a_measured_step_and_its_critical_path(case, tmp_path):
    """A real 2-rank pp=2 step (1F1B, ZB-V) in the report: its replay's timeline, its critical path outlined."""
    from autopar.runtime.execution.trace import measured_critical_path

    browser = _browser()
    run = results(case.world_size)[case]
    assert "error" not in run, run.get("traceback", run.get("error"))
    events = run["steps"][-1]
    model = build(case)  # the model the ranks ran
    tokens = torch.randint(0, 128, (case.batch, case.seq))
    options = dict(case.options)
    result = autopar.plan(model, {"pp": 2}, example_inputs=(tokens,), loss_fn=lm_loss, example_target=tokens,
                          schedule=options["schedule"], num_microbatches=options["num_microbatches"])
    path = write_report(result, tmp_path / "measured.html", formula=False, events=events)
    done = _run(browser, "--dump-dom", path.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    section = re.search(r'<section id="measured">.*?</section>', done.stdout, flags=re.S).group(0)
    critical = measured_critical_path(run["schedule"], events)
    outlined = re.findall(r'<rect class="ev ev-[FBW] crit" data-action="(\w+)"', section)
    assert sorted(outlined) == sorted(critical.actions)
    listed = re.search(r'<pre id="measured-critical-actions">(.*?)</pre>', section).group(1).replace("&gt;", ">")
    assert listed.split() == [s.label for s in critical.steps]
