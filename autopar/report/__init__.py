"""Reading what autopar did: an HTML report of a plan and a text diff of a rank's rewritten graph.

- :func:`write_report` / :func:`render_report`: one self-contained HTML page with the Plan, the
  schedule's timeline, memory per rank and every rewritten stage graph (``autopar inspect --html``).
- :func:`graph_diff`: the original graph against one rank's rewritten graphs, as readable text
  (``autopar inspect --diff --rank R``).
"""
from autopar.report.diff import graph_diff
from autopar.report.html import render_report, write_report
from autopar.report.timeline import simulate_plan, timeline_svg

__all__ = ["render_report", "write_report", "graph_diff", "simulate_plan", "timeline_svg"]
