"""The losses people train with trace to a whole training step (issue 30, item 3).

On the meta device torch 2.13 traced ``F.cross_entropy``'s backward as undefined: the
loss's seed gradient had no reader, the head and the last block got no gradient, and the
launcher crashed on a ``None`` (``'NoneType' object has no attribute 'device'``).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError
from autoshard.model.model_file import instantiate, load_model_file
from autoshard.solver.solve import SolveConfig, trace

GPT2_CE = """
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096,
                                      n_positions=128))


def example_inputs():
    return (torch.randint(0, 4096, (4, 128)),)


def loss_fn(output, input_ids):
    # next-token prediction: the shifted cross-entropy every causal LM trains with
    logits = output.logits[:, :-1, :]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))
"""


LLAMA_HF_LOSS = """
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM


class WithLabels(nn.Module):
    \"\"\"HF's own loss: the model given labels=input_ids returns the shifted cross-entropy.\"\"\"

    def __init__(self):
        super().__init__()
        self.lm = LlamaForCausalLM(LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=128))

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, labels=input_ids).loss


def build_model():
    return WithLabels()


def example_inputs():
    return (torch.randint(0, 4096, (4, 128)),)
"""


def _flops_of_a_real_step(path) -> int:
    """FlopCounterMode's count of the model and its loss (the file's loss_fn, or the
    scalar the model returns), forward and backward, run eagerly on fake CPU tensors (the
    reference autoshard did not write)."""
    from test_cost_model import CPU_FLASH_AS_CUDA

    mf = load_model_file(path)
    with FakeTensorMode(allow_non_fake_inputs=True):
        loaded = instantiate(mf, device="cpu")
        with FlopCounterMode(display=False, custom_mapping=CPU_FLASH_AS_CUDA) as counter:
            out = loaded.module.eval()(*loaded.inputs)
            scalar = isinstance(out, torch.Tensor) and out.dim() == 0
            loss = out if scalar else mf.module.loss_fn(out, *loaded.inputs)
            loss.backward()
    return counter.get_total_flops()


@pytest.mark.slow
def test_hf_s_own_loss_in_a_wrapper_traces_the_whole_step(tmp_path):
    """A Llama (grouped-query attention) wrapped to train on HF's own loss
    (``labels=input_ids``): the wrapped model's KV cache is off while tracing (it failed on
    the cache's concatenation), and the step is a real one: FLOPs as FlopCounterMode counts
    them (the refusal of a trace that loses gradients did not fire)."""
    path = tmp_path / "llama_hf_loss.py"
    path.write_text(LLAMA_HF_LOSS)
    graph = trace(SolveConfig(path, MeshSpec.from_options("2x2"), mode="train"))
    assert graph.step_flops == pytest.approx(_flops_of_a_real_step(path), rel=0.02)


@pytest.mark.slow
def test_a_shifted_cross_entropy_loss_traces_the_whole_backward(tmp_path):
    path = tmp_path / "gpt2_ce.py"
    path.write_text(GPT2_CE)
    graph = trace(SolveConfig(path, MeshSpec.from_options("2x2"), mode="train"))
    gm = graph.graph_module
    # every attention backward reads a real gradient (None crashed the launcher)
    backward = [n for n in gm.graph.nodes if "flash_attention_for_cpu_backward" in str(n.target)]
    assert len(backward) == 2
    assert all(isinstance(n.args[0], torch.fx.Node) for n in backward), [n.args for n in backward]
    # the head's weight (tied to the embedding) and the last block have gradients
    from autoshard._torch_private import describe_input, describe_outputs

    out = next(n for n in gm.graph.nodes if n.op == "output")
    grads = dict(zip(describe_outputs(out), out.args[0], strict=True))
    used = [
        describe_input(n)[1]
        for n in gm.graph.nodes
        if n.op == "placeholder" and describe_input(n)[0] == "param" and n.users
    ]
    assert "model.transformer.h.1.mlp.c_proj.weight" in used
    assert [p for p in used if grads.get(p) is None] == []
    # and the step's FLOPs are a real step's: the head's two backward matmuls included
    assert graph.step_flops == pytest.approx(_flops_of_a_real_step(path), rel=0.02)


def test_a_trace_that_loses_gradients_is_refused(tmp_path, monkeypatch):
    """Planted: the decomposition that fixes it turned off. The trace is refused with a
    one-line reason instead of planning a step without its backward."""
    import autoshard.trace.tracer as tracer

    monkeypatch.setattr(tracer.tp, "composite_implicit_decompositions", dict)
    path = tmp_path / "gpt2_ce.py"
    path.write_text(GPT2_CE)
    with pytest.raises(AutoshardError, match="lost gradients: the loss's seed gradient is never"):
        trace(SolveConfig(path, MeshSpec.from_options("2x2"), mode="train"))


GPT2_CE_SMALL = GPT2_CE.replace("n_embd=256", "n_embd=64").replace("4096", "256")
LLAMA_HF_LOSS_SMALL = (
    LLAMA_HF_LOSS.replace("4096", "256")
    .replace("hidden_size=256", "hidden_size=64")
    .replace("intermediate_size=512", "intermediate_size=128")
)


@pytest.mark.slow  # starts torchrun
@pytest.mark.parametrize(
    "text", [GPT2_CE_SMALL, LLAMA_HF_LOSS_SMALL], ids=["gpt2-loss_fn", "llama-hf-labels"]
)
def test_a_plan_with_a_cross_entropy_loss_launches_and_trains_like_one_device(tmp_path, text):
    """The crash of issue 30 (every rank: 'NoneType' object has no attribute 'device'): the
    ILP's plan of a GPT-2 trained with the shifted cross-entropy of its loss_fn, and of a
    Llama on HF's own loss, on 4 gloo ranks; loss, every gradient and every parameter after
    AdamW equal one device's, and the collectives that ran are the plan's."""
    assert text not in (GPT2_CE, LLAMA_HF_LOSS)
    model = tmp_path / "model_ce.py"
    model.write_text(text)
    _solve_and_check_on_4_ranks(model, tmp_path)


GPT2_DICT = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd={n_embd}, n_head=4, vocab_size={vocab},
                                      n_positions=128))


def example_inputs():
    # keyword inputs, HF's own loss: labels is the token ids themselves (HF shifts them)
    ids = torch.randint(0, {vocab}, (4, {seq}))
    return {{"input_ids": ids, "attention_mask": torch.ones(4, {seq}, dtype=torch.long),
            "labels": ids}}
"""


@pytest.mark.slow
def test_dict_inputs_bind_by_keyword_and_train_on_hf_s_loss(tmp_path):
    """Issue 30: ``example_inputs()`` returns a dict; the inputs are named by its keys (the
    names of the sharding map), ``labels`` given as the very tensor ``input_ids`` is made its
    own input (the trace read one placeholder for both, the launcher made two), and the step
    is HF's loss on them: FLOPs as FlopCounterMode counts ``model(**inputs).loss.backward()``."""
    from test_cost_model import CPU_FLASH_AS_CUDA

    path = tmp_path / "gpt2_dict.py"
    path.write_text(GPT2_DICT.format(n_embd=256, vocab=4096, seq=128))
    mf = load_model_file(path)
    loaded = instantiate(mf)
    assert loaded.input_names == ("input_ids", "attention_mask", "labels")
    assert loaded.inputs[2] is not loaded.inputs[0]
    graph = trace(SolveConfig(path, MeshSpec.from_options("2x2"), mode="train"))
    inputs = [i for i in graph.nodes.values() if i.kind == "input"]
    assert [i.fqn for i in inputs] == ["input_ids", "attention_mask", "labels"]
    with FakeTensorMode(allow_non_fake_inputs=True):
        raw = mf.module.example_inputs()
        model = mf.module.build_model().eval()
        with FlopCounterMode(display=False, custom_mapping=CPU_FLASH_AS_CUDA) as counter:
            model(**raw).loss.backward()
    assert graph.step_flops == pytest.approx(counter.get_total_flops(), rel=0.02)


KEYWORD_MLP = """
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, scale=None):
        y = self.fc(x)
        return y if scale is None else y * scale


def build_model():
    return Scaled()


def example_inputs():
    return {inputs}
"""


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ('{"x": torch.randn(8, 16), "scales": torch.ones(8, 1)}', "key 'scales', which is not"),
        ('{"x": torch.randn(8, 16), "scale": 2.0}', "\\['scale'\\] is a float, not a torch"),
        ('{"scale": torch.ones(8, 1)}', "forward\\(\\) requires x, which"),
    ],
    ids=["unknown-key", "not-a-tensor", "required-missing"],
)
def test_a_dict_forward_cannot_take_is_one_line(tmp_path, inputs, message):
    path = tmp_path / "scaled.py"
    path.write_text(KEYWORD_MLP.format(inputs=inputs))
    with pytest.raises(AutoshardError, match=message) as err:
        instantiate(load_model_file(path))
    assert "\n" not in str(err.value)


def test_a_dict_in_any_order_binds_by_keyword(tmp_path):
    """``scale`` before ``x`` in the dict: named and passed by keyword, so the traced
    step is ``fc(x) * scale`` whatever the order."""
    path = tmp_path / "scaled.py"
    path.write_text(
        KEYWORD_MLP.format(inputs='{"scale": torch.ones(8, 1), "x": torch.randn(8, 16)}')
    )
    loaded = instantiate(load_model_file(path), device="cpu")
    assert loaded.input_names == ("scale", "x")
    scale, x = loaded.inputs
    expected = loaded.module.fc(x) * scale
    torch.testing.assert_close(loaded.module(*loaded.inputs), expected)


def test_a_forward_patched_onto_the_instance_is_kept_by_keyword(tmp_path):
    """A hook that replaced the instance's ``forward`` (as accelerate's and PEFT's do) runs
    under the keyword adapter, in the module and in a deep copy of it, bound to the copy."""
    import copy

    from autoshard.model.model_file import by_keyword

    path = tmp_path / "scaled.py"
    path.write_text(
        KEYWORD_MLP.format(inputs='{"scale": torch.ones(8, 1), "x": torch.randn(8, 16)}')
    )
    loaded = instantiate(load_model_file(path), device="cpu")
    module = loaded.module
    original = type(module).forward

    def hooked(self, x, scale):  # the class's forward, times 3
        return original(self, x=x, scale=scale) * 3.0

    import types

    plain = copy.deepcopy(module)
    module.forward = types.MethodType(hooked, module)
    by_keyword(module, ("scale", "x"))
    scale, x = loaded.inputs
    torch.testing.assert_close(module(scale, x), module.fc(x) * scale * 3.0)
    twin = copy.deepcopy(module)
    with torch.no_grad():
        twin.fc.weight.mul_(2.0)  # the copy's own weights, not the original's
    torch.testing.assert_close(twin(scale, x), twin.fc(x) * scale * 3.0)
    torch.testing.assert_close(plain(scale, x), plain.fc(x) * scale)  # no hook: the class's
    by_keyword(module, ("scale", "x"))  # again (a model file that caches its module)
    torch.testing.assert_close(module(scale, x), module.fc(x) * scale * 3.0)
    by_keyword(plain, ("scale", "x"))  # again on the adapter alone: not its own inner forward
    torch.testing.assert_close(plain(scale, x), plain.fc(x) * scale)


@pytest.mark.slow  # starts torchrun
def test_dict_inputs_with_hf_s_loss_launch_like_one_device(tmp_path):
    """The dict inputs and HF's loss through the plan's graph on 4 gloo ranks: collectives
    as planned, loss, gradients and parameters after AdamW as one device's."""
    model = tmp_path / "gpt2_dict.py"
    model.write_text(GPT2_DICT.format(n_embd=64, vocab=256, seq=32))
    _solve_and_check_on_4_ranks(model, tmp_path)


def _solve_and_check_on_4_ranks(model, out) -> None:
    """``autoshard solve MODEL --mesh 2x2``, then its plan on 4 gloo ranks with
    ``--train --check``: collectives as planned; loss, every gradient and every parameter
    after AdamW within 1e-6 of one device's."""
    from helpers import assert_checked, autoshard_cli, ranks

    solved = autoshard_cli("solve", str(model), "--mesh", "2x2", "--out", str(out), "-q")
    assert solved.returncode == 0, solved.stderr[-3000:]
    plan = next(p for p in solved.stdout.split() if p.endswith(".json"))
    run = ranks(4, plan, str(model), "--train", "--check")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "check: collectives equal the plan's prediction ok" in run.stdout
    assert_checked(run.stdout, 1e-6, grads=1e-6, params=1e-6)


LLAMA_CE = """
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


def build_model():
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=64))


def example_inputs():
    return (torch.randint(0, 512, (8, 32)),)


def loss_fn(output, input_ids):
    # torchtitan's loss: cross-entropy of the float32 logits against the tokens
    return F.cross_entropy(output.logits.flatten(0, 1).float(), input_ids.flatten(0, 1))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mesh_text", ["4", "2x2"])
def test_the_cross_entropy_gradient_follows_the_batch_shard(tmp_path, mesh_text):
    """Issue 28, item 2: with torchtitan's cross-entropy loss, ``nll_loss_backward`` had
    only the replicated strategy (PyTorch's rule indexes the target's strategies by the
    input's), so every plan, the ILP's and FSDP's alike, made the whole (tokens, vocab)
    gradient of the logits on every device: 67 GB in float32 for Llama-3.1-8B at 16 x 8192
    on 8 GPUs, where torchtitan trained in 82 GiB. Now no op falls back; DDP and FSDP hold
    a quarter of that gradient on a device, as each rank of a data-parallel run
    differentiates its own tokens' loss, and so does the ILP's plan on 4 devices."""
    from autoshard.cost.liveness import local_bytes
    from autoshard.solver.baselines import baseline_choice
    from autoshard.solver.solve import plan_model, strategies

    path = tmp_path / "llama_ce.py"
    path.write_text(LLAMA_CE)
    mesh = MeshSpec.from_options(mesh_text)
    config = SolveConfig(path, mesh, mode="train")
    sg = strategies(config, trace(config))
    assert dict(sg.fallback_ops) == {}
    (name,) = [n for n, i in sg.graph.nodes.items() if "nll_loss_backward" in str(i.target)]
    grad = sg.graph.nodes[name].results[0]
    assert tuple(grad.shape) == (8 * 32, 512)
    ns = sg.nodes[name]
    held = {}
    for algo in ("ddp", "fsdp"):
        choice = baseline_choice(sg, algo, mesh)
        held[algo] = local_bytes(
            grad, ns.strategies[ns.choice[choice[ns.rep]]].outputs[0], sg.mesh_shape
        )
    assert held["ddp"] == held["fsdp"] == grad.nbytes / 4
    if mesh_text == "4":  # the ILP's plan (on 2x2 it may keep the loss whole on one dim)
        plan = plan_model(config).plan
        assert local_bytes(grad, plan.node_strategy[name].outputs[0], (4,)) == grad.nbytes / 4


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_cross_entropy_backward_rule_places_each_input_as_dtensor_does(reduction, weighted):
    """``nll_loss_backward(grad_output, input[N, C], target[N], weight?, reduction,
    ignore_index, total_weight)`` on a 2 x 2 mesh, N = 8: besides all-replicated, one
    strategy per way to shard N (dim 0, dim 1, both), as DTensor's rule places each
    concrete case: input, target and the gradient sharded alike; the gradient of the loss
    sharded with them without reduction, else the replicated seed; the weight replicated;
    ``total_weight`` replicated for the mean, as the forward left it (a sum over the
    shards) otherwise. Without class weights, loss parallelism's ``V`` on one mesh dim
    too: there the input and the gradient sharded on the classes, everything else
    replicated. A 1-D input (one sample) is only replicated."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate, Shard

    from autoshard.strategies.rules import op_rule

    rule = op_rule(torch.ops.aten.nll_loss_backward.default).generate
    t = SimpleNamespace
    args = [t(shape=(8,) if reduction == 0 else ()), t(shape=(8, 5)), t(shape=(8,))]
    args += [t(shape=(5,))] * weighted + [t(shape=())]
    node = SimpleNamespace(args=(None, None, None, None, reduction, -100, None))
    strategies = rule(node, args, [t(shape=(8, 5))], (2, 2))
    R, S, P, C = Replicate(), Shard(0), Partial(), Shard(1)
    rep = (R, R)
    assert strategies[0].outputs == (rep,) and strategies[0].inputs == (rep,) * len(args)
    vocab = {s.outputs[0]: s.inputs for s in strategies if Shard(1) in s.outputs[0]}
    assert set(vocab) == (set() if weighted else {(C, R), (R, C), (S, C), (C, S)})
    for combo, inputs in vocab.items():  # V: the classes sharded, the rest as on its side
        v = combo.index(C)
        assert [p[v] for p in inputs] == [R, C, R, R], (combo, inputs)
    got = {s.outputs[0]: s.inputs for s in strategies[1:] if Shard(1) not in s.outputs[0]}
    assert set(got) == {(S, R), (R, S), (S, S)}
    for combo, inputs in got.items():
        summed = tuple(P if p == S else R for p in combo)
        grad_out = combo if reduction == 0 else rep
        want = (grad_out, combo, combo) + (rep,) * weighted
        want += (rep if reduction == 1 else summed,)
        assert inputs == want, (combo, inputs)
    one_sample = [t(shape=()), t(shape=(5,)), t(shape=())] + [t(shape=())]
    assert len(rule(node, one_sample, [t(shape=(5,))], (2, 2))) == 1
