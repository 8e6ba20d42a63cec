"""Attention found in captured graphs (passes/context_parallel/attention.py, mask_probe.py).

On every family of tests/cp_families.py, with SDPA and eager attention: every layer's attention is
found with the facts its config says (heads, kv heads, causal, sliding window, soft-cap, ALiBi slopes,
the padding input, a latent kv), nothing is left unrecognised, and, the strongest check, the recorded
facts *reproduce* the attention: the graph is run on the batch, and eager attention written here from
the recorded q, k, v, layouts, scale, causal flag, window, soft-cap, padding input and ALiBi slopes equals
the value of the recorded output node (fp32, relative 1e-5). Hand-written modules cover what is refused.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

pytest.importorskip("transformers")

from autopar.ir.meta_keys import ATTENTION, get_meta  # noqa: E402
from autopar.passes.frontend.annotate import module_path_of  # noqa: E402
from autopar.passes.frontend.capture import capture  # noqa: E402
from autopar.passes.context_parallel.attention import annotate_attention, find_attention  # noqa: E402
from cp_families import CAPTURES, SEQ, captured  # noqa: E402

KV_HEADS = {"llama": 2, "qwen3": 2, "mistral": 2, "gemma2": 2, "gpt2": 4, "falcon_mq": 1, "bert": 4, "mixtral": 2,
            "deepseek_v3": 4, "bloom": 4}
WINDOWS = {"mistral": [4, 4], "gemma2": [6, None]}  # Gemma 2 slides on even layers only
ALIBI = {"bloom": tuple(2.0 ** (-8.0 * (h + 1) / 4) for h in range(4))}  # the ALiBi paper's slopes for 4 heads


class _Recorder(fx.Interpreter):
    def __init__(self, gm, names):
        super().__init__(gm)
        self.names, self.seen = set(names), {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.names:
            self.seen[n.name] = out
        return out


def _bhsd(x: torch.Tensor, layout, batch: int, heads: int) -> torch.Tensor:
    if layout.heads == layout.batch:  # one dim of batch x heads
        return x.reshape(batch, heads, *x.shape[1:]).movedim(layout.seq + 1, 2).movedim(layout.feature + 1, 3)
    return x.permute(layout.batch, layout.heads, layout.seq, layout.feature)


def _oracle(info, seen, data) -> torch.Tensor:
    """Eager attention written from the recorded facts only."""
    batch, heads = data["input_ids"].shape[0], info.num_heads
    q = _bhsd(seen[info.q], info.q_layout, batch, heads)
    k = _bhsd(seen[info.k], info.k_layout, batch, seen[info.k].shape[info.k_layout.heads] if
              info.k_layout.heads != info.k_layout.batch else heads)
    v = _bhsd(seen[info.v], info.v_layout, batch, k.shape[1])
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * info.scale
    if info.softcap:
        scores = info.softcap * torch.tanh(scores / info.softcap)
    qi, ki = torch.arange(SEQ).view(-1, 1), torch.arange(SEQ).view(1, -1)
    visible = torch.ones(batch, 1, SEQ, SEQ, dtype=torch.bool)
    if info.causal:
        visible &= ki <= qi
    if info.window:
        visible &= qi - ki < info.window
    for mask in info.masks:
        if mask.padding:
            visible &= data[mask.padding].bool()[:, None, None, :]
        if mask.alibi_slopes:
            scores = scores + torch.tensor(mask.alibi_slopes).view(1, -1, 1, 1) * ki.float()
    out = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v
    return out, visible.any(-1).expand(out.shape[:-1])  # rows with no key to see: padding (the model averages all)


@pytest.mark.parametrize("family,impl", CAPTURES)
def test_each_attention_is_found_with_its_config_and_reproduces_the_graph(family, impl):
    model, graph, data = captured(family, impl)
    report = find_attention(graph.gm)
    assert report.unrecognised == ()
    assert len(report.found) == model.config.num_hidden_layers
    windows = WINDOWS.get(family, [None] * len(report.found))
    for layer, info in enumerate(report.found):
        assert info.form == impl and str(layer) in info.path.split(".")
        assert (info.num_heads, info.num_kv_heads) == (4, KV_HEADS[family])
        assert info.causal is (family != "bert") and info.window == windows[layer]
        assert info.softcap == (50.0 if family == "gemma2" else None) and info.dropout == 0.0
        assert {m.padding for m in info.masks} >= {"attention_mask"}
        assert tuple(s for m in info.masks for s in m.alibi_slopes) == ALIBI.get(family, ())
        if KV_HEADS[family] < 4 and info.form == "eager":
            assert info.kv_source is not None  # the k before repeat_kv
    recorder = _Recorder(graph.gm, [n for a in report.found for n in (a.q, a.k, a.v, a.output)])
    recorder.run(*data.values(), *graph.extra_args)
    for info in report.found:
        got = recorder.seen[info.output]
        want, rows = _oracle(info, recorder.seen, data)
        got = _bhsd(got, info.q_layout, want.shape[0], info.num_heads)
        assert rows.float().mean() > 0.9
        torch.testing.assert_close(got[rows], want[rows], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, i=info: f"{family}/{impl} {i.path}: {m}")


def test_latent_attention_records_the_compressed_kv_and_its_head_dims():
    _, graph, _ = captured("deepseek_v3", "eager")
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    for info in find_attention(graph.gm).found:
        assert (info.head_dim, info.v_head_dim, info.scale) == (12, 8, pytest.approx(12 ** -0.5))
        assert module_path_of(by_name[info.latent]).endswith("self_attn.kv_a_proj_with_mqa")
    _, graph, _ = captured("llama", "eager")
    assert all(info.latent is None for info in find_attention(graph.gm).found)


def test_annotate_writes_the_info_on_each_output_node():
    _, graph, _ = captured("mistral", "sdpa")
    report = annotate_attention(graph.gm)
    marked = [get_meta(n, ATTENTION) for n in graph.gm.graph.nodes if get_meta(n, ATTENTION) is not None]
    assert marked == list(report.found) and marked[0].masks[0].sources[0] == "attention_mask"


def test_packed_documents_are_read_from_restarting_position_ids():
    from cp_families import build
    model = build("llama", "sdpa")
    ids = torch.randint(1, 100, (2, SEQ))
    positions = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).expand(2, SEQ)
    data = {"input_ids": ids, "position_ids": positions, "labels": ids}
    gm = capture(model, tuple(data.values()), keywords=tuple(data), own_loss=True).gm
    info = find_attention(gm).found[0]
    assert info.causal and [m.documents for m in info.masks] == ["position_ids"]


# -- what is refused, and why ---------------------------------------------------------------------------
class _Attn(nn.Module):
    """A hand-written attention whose scores step is given: the refusals' test bed."""

    def __init__(self, scores_step, *, keep_probs=False):
        super().__init__()
        self.proj, self.step, self.keep = nn.Linear(8, 24), scores_step, keep_probs

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 6, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)  # [batch, heads, seq, 4]
        probs = self.step(q @ k.transpose(-1, -2) / math.sqrt(4))
        out = probs @ v
        return (out, probs) if self.keep else out


def _refusal(module) -> str:
    gm = capture(module, (torch.randn(2, 6, 8),)).gm
    report = find_attention(gm)
    assert report.found == () and len(report.unrecognised) == 1
    return report.unrecognised[0].reason


def test_refusals_say_what_the_analysis_cannot_read():
    assert "normalises over dim 2" in _refusal(_Attn(lambda s: s.softmax(2)))
    assert "fills scores with 0.0" in _refusal(_Attn(lambda s: s.masked_fill(s > 3, 0.0).softmax(-1)))
    assert "pass through relu" in _refusal(_Attn(lambda s: s.relu().softmax(-1)))
    assert "read by 2 nodes" in _refusal(_Attn(lambda s: s.softmax(-1), keep_probs=True))


def test_a_router_softmax_is_no_attention_and_a_hand_written_one_is():
    _, graph, _ = captured("mixtral", "eager")  # every MoE layer's router softmax is not reported
    assert find_attention(graph.gm).unrecognised == ()
    gm = capture(_Attn(lambda s: s.softmax(-1)), (torch.randn(2, 6, 8),)).gm
    (info,) = find_attention(gm).found
    assert (info.form, info.causal, info.scale, info.num_heads) == ("eager", False, 0.5, 2)


def test_autopar_models_attention_is_found():
    from autopar.models.examples import gpt_tiny, llama_tiny
    for example, kv in ((gpt_tiny, 4), (llama_tiny, 2)):
        model, (x,), loss_fn, y = example()
        report = find_attention(capture(model, (x,), loss_fn=loss_fn, example_target=y).gm)
        assert [(a.form, a.causal, a.num_kv_heads) for a in report.found] == [("sdpa", True, kv)] * 2
