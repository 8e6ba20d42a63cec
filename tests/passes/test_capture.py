"""passes/frontend/capture.py: export and symbolic_trace capture, module paths, input names, meta models, errors."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import autopar
from autopar.ir.meta_keys import MODULE, get_meta
from autopar.models import build_model, lm_loss
from autopar.passes.frontend.annotate import annotate
from autopar.passes.frontend.capture import capture

from graph_runner import captured as cached_capture

LINEARS_PER_LAYER = {"gpt_tiny": 4, "llama_tiny": 7}
# llama's rotary tables are buffers sliced by the traced length (``self.cos[:t]``): fx.symbolic_trace
# leaves buffers unproxied, so slicing one by a Proxy fails. capture could trace with
# ``proxy_buffer_attributes = True`` on its fx.Tracer (reported; see the test report).


def _ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _capture(name: str, mode: str, *, with_loss: bool = True):
    return cached_capture(name, mode, with_loss=with_loss)


@pytest.mark.parametrize("mode", ["export", "symbolic_trace"])
@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
def test_capture_gives_aten_linear_per_projection(name, mode):
    model, args, captured = _capture(name, mode)
    ops = _ops(captured.gm)
    assert ops["aten.linear.default"] == LINEARS_PER_LAYER[name] * model.cfg.num_layers + 1  # + lm_head
    assert captured.has_loss and captured.mode == mode
    with torch.no_grad():  # the captured graph computes the same loss as the model
        loss = pytree.tree_unflatten(list(captured.gm(*args)), captured.out_spec)
        torch.testing.assert_close(loss, lm_loss(model(args[0]), args[1]))


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
def test_export_keeps_module_paths_in_nn_module_stack_and_autopar_module(name):
    model, args, captured = _capture(name, "export")
    linears = [n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    expected = [f"model.{path}" for path, m in model.named_modules() if isinstance(m, nn.Linear)]
    innermost = [list(n.meta["nn_module_stack"].values())[-1][0] for n in linears]
    assert innermost == expected
    gm = annotate(captured.gm, example_inputs=args, model=model)
    assert [get_meta(n, MODULE).path for n in linears] == expected
    blocks = "blocks" if name == "gpt_tiny" else "layers"
    # every op inside a transformer block (views, attention, residual adds) knows its block
    sdpa = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert [get_meta(n, MODULE).unit for n in sdpa] == [f"model.{blocks}.{i}"
                                                        for i in range(model.cfg.num_layers)]
    assert all(get_meta(n, MODULE).path.endswith(".attn") for n in sdpa)


def test_symbolic_trace_keeps_module_paths_of_leaf_modules():
    model, args, captured = _capture("gpt_tiny", "symbolic_trace")
    gm = annotate(captured.gm, example_inputs=args, model=model)
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    expected = [f"model.{path}" for path, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert [get_meta(n, MODULE).path for n in linears] == expected


def test_symbolic_trace_keeps_module_paths_of_every_block_op():
    model, args, captured = _capture("gpt_tiny", "symbolic_trace")
    gm = annotate(captured.gm, example_inputs=args, model=model)
    sdpa = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert [get_meta(n, MODULE).unit for n in sdpa] == ["model.blocks.0", "model.blocks.1"]


@pytest.mark.parametrize("mode", ["export", "symbolic_trace"])
def test_placeholders_follow_the_forward_signature(mode):
    _, _, with_loss = _capture("gpt_tiny", mode)
    assert with_loss.input_names == ("idx", "target")
    _, _, inference = _capture("gpt_tiny", mode, with_loss=False)
    assert inference.input_names == ("idx",)
    assert [n.name for n in inference.gm.graph.nodes if n.op == "placeholder"] == ["idx"]


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, features, bias_term):
        return self.proj(features) + bias_term


def test_placeholders_of_a_two_input_model_are_named_after_its_parameters():
    x, b = torch.randn(2, 4), torch.randn(2, 4)
    captured = capture(TwoInputs(), (x, b), loss_fn=nn.functional.mse_loss, example_target=torch.randn(2, 4))
    assert captured.input_names == ("features", "bias_term", "target")


_PLAN_ON_META = """
import json, resource, sys
import torch
import autopar
from autopar.models import build_model, lm_loss


def rss_kb():  # resident now, from /proc: the baseline, so nothing below an earlier peak is missed
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


before_kb = rss_kb()
with torch.device("meta"):  # 7B-wide layers: 2.7 GB of fp32 weights if anything allocated them
    model = build_model("llama2_7b", num_layers=2)
x = torch.randint(0, model.cfg.vocab_size, (2, 32))
result = autopar.plan(model, {"pp": 2, "tp": 2}, example_inputs=(x,), loss_fn=lm_loss, example_target=x)
grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb  # peak since the baseline, or more
stages = [(rank.rank, stage) for rank in result.ranks.values() for stage in rank.stages]
tensors = {f"{r}/{s.stage}": [t.is_meta for t in list(s.gm.parameters()) + list(s.gm.buffers())] for r, s in stages}
q = result.ranks[0].stages[0].gm.get_parameter("model.layers.0.attn.q_proj.weight")
json.dump({"grown_kb": grown_kb, "model_meta": all(p.is_meta for p in model.parameters()), "tensors": tensors,
           "num_ranks": len(result.ranks), "q_shape": list(q.shape),
           "num_parameters": [result.plan.num_parameters, sum(p.numel() for p in model.parameters())]}, sys.stdout)
"""


def test_meta_model_is_captured_and_planned_without_allocating():
    """Planned in a fresh process: its peak resident memory (ru_maxrss) is measured from its resident
    size just before planning, so an allocation cannot hide below an earlier peak of this test session."""
    done = subprocess.run([sys.executable, "-c", _PLAN_ON_META], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout)
    grown_gb = facts["grown_kb"] / 1e6
    assert grown_gb < 1.0, f"planning a meta model raised peak memory by {grown_gb:.2f} GB"
    assert facts["model_meta"]
    assert len(facts["tensors"]) >= 4 and all(t and all(t) for t in facts["tensors"].values()), facts["tensors"]
    assert facts["num_ranks"] == 4
    assert facts["num_parameters"][0] == facts["num_parameters"][1]
    # the tensor-parallel shards are local even on meta: q_proj holds half the heads
    assert tuple(facts["q_shape"]) == (4096 // 2, 4096)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow: no tracer can follow it
            return self.proj(x)
        return x


def _line_of(text: str) -> int:
    import inspect
    lines, start = inspect.getsourcelines(DataDependent.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("mode", ["export", "symbolic_trace"])
def test_untraceable_model_raises_capture_error_naming_file_and_line(mode):
    with pytest.raises(autopar.CaptureError) as info:
        capture(DataDependent(), (torch.randn(2, 4),), mode=mode)
    err = info.value
    assert f"{__file__}:{_line_of('if x.sum() > 0')}" in err.where
    assert "if x.sum() > 0" in err.where
    assert "DataDependent" in err.what and mode in err.what
    assert "control flow" in err.fix and "torch.where" in err.fix
    other = "symbolic_trace" if mode == "export" else "export"
    assert f"capture='{other}'" in err.fix


def test_plan_reports_capture_errors_with_the_chosen_mode():
    with pytest.raises(autopar.CaptureError, match="symbolic_trace could not capture DataDependent"):
        autopar.plan(DataDependent(), {"dp": 1}, example_inputs=(torch.randn(2, 4),), capture="symbolic_trace")


def test_unknown_capture_mode_and_missing_target_are_capture_errors():
    with pytest.raises(autopar.CaptureError, match="unknown capture mode") as info:
        capture(TwoInputs(), (torch.randn(2, 4), torch.randn(2, 4)), mode="jit")
    assert info.value.fix and info.value.where
    with pytest.raises(autopar.CaptureError, match="without an example target"):
        capture(TwoInputs(), (torch.randn(2, 4), torch.randn(2, 4)), loss_fn=nn.functional.mse_loss)
