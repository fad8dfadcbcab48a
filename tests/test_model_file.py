"""Tests for autoshard.model.model_file: every user mistake, and the bundled examples."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autoshard.errors import AutoshardError
from autoshard.model.model_file import LoadedModel, ModelFile, instantiate, load_model_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

GOOD = """\
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))


def example_inputs():
    return (torch.randn(3, 4),)
"""


def write(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    """Write ``source`` (dedented) to ``tmp_path/name`` and return the path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def load_error(path: Path) -> str:
    """The one-line AutoshardError message of loading and instantiating ``path`` on meta."""
    with pytest.raises(AutoshardError) as info:
        instantiate(load_model_file(path))
    msg = str(info.value)
    assert "\n" not in msg
    assert str(path.name) in msg
    return msg


# --- the file itself ---------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    msg = load_error(tmp_path / "nope.py")
    assert "nope.py: model file not found" in msg


def test_directory(tmp_path: Path) -> None:
    d = tmp_path / "models.py"
    d.mkdir()
    assert "is a directory" in load_error(d)


def test_not_python(tmp_path: Path) -> None:
    msg = load_error(write(tmp_path, GOOD, "model.txt"))
    assert "must be a Python file ending in .py" in msg


def test_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "import torch\n\ndef build_model(:\n    pass\n")
    msg = load_error(path)
    assert msg.startswith(f"{path}:3: SyntaxError: ")
    assert msg.endswith("fix the file")


def test_import_error_names_type_message_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "import torch\n\ny = x + 1\n")
    msg = load_error(path)
    assert msg == (
        f"{path}:3: NameError: name 'x' is not defined "
        "(while importing the model file; fix the file)"
    )


def test_missing_module_import(tmp_path: Path) -> None:
    path = write(tmp_path, "import torch\nimport no_such_module_xyz\n")
    msg = load_error(path)
    assert msg.startswith(f"{path}:2: ModuleNotFoundError: No module named 'no_such_module_xyz'")


def test_system_exit_in_file_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "import sys\nsys.exit(3)\n")
    assert load_error(path).startswith(f"{path}:2: SystemExit: 3")


@pytest.mark.parametrize("fn", ["build_model", "example_inputs"])
def test_missing_function(tmp_path: Path, fn: str) -> None:
    source = GOOD.replace(f"def {fn}():", "def something_else():")
    msg = load_error(write(tmp_path, source))
    assert f"does not define {fn}(); add it, e.g. `def {fn}() -> " in msg


def test_function_not_callable(tmp_path: Path) -> None:
    msg = load_error(write(tmp_path, GOOD + "\nbuild_model = 3\n"))
    assert "build_model is a int, not a function; define it as a function" in msg


# --- calling the functions ---------------------------------------------------------


def test_build_model_raises(tmp_path: Path) -> None:
    source = GOOD.replace(
        "    return nn.Sequential(", "    raise ValueError('bad size')\n    return nn.Sequential("
    )
    path = write(tmp_path, source)
    msg = load_error(path)
    assert (
        msg
        == f"{path}:6: build_model() raised ValueError: bad size (on device meta; fix build_model)"
    )


def test_build_model_returns_wrong_type(tmp_path: Path) -> None:
    source = GOOD.replace("return nn.Sequential(", "return dict(a=nn.Sequential(")
    source = source.replace("nn.Linear(8, 2))", "nn.Linear(8, 2)))")
    msg = load_error(write(tmp_path, source))
    assert "build_model() returned a dict, not a torch.nn.Module" in msg


def test_example_inputs_single_tensor(tmp_path: Path) -> None:
    msg = load_error(write(tmp_path, GOOD.replace("(torch.randn(3, 4),)", "torch.randn(3, 4)")))
    assert "example_inputs() returned a single Tensor of shape (3, 4)" in msg
    assert "return (x,)" in msg


def test_example_inputs_not_a_sequence(tmp_path: Path) -> None:
    msg = load_error(write(tmp_path, GOOD.replace("(torch.randn(3, 4),)", "{'input': 1}")))
    assert "example_inputs()['input'] is an int, not a torch.Tensor; return only tensors" in msg
    msg = load_error(write(tmp_path, GOOD.replace("(torch.randn(3, 4),)", "{1, 2}")))
    assert "example_inputs() returned a set; return a non-empty tuple of tensors" in msg


def test_example_inputs_empty(tmp_path: Path) -> None:
    msg = load_error(write(tmp_path, GOOD.replace("(torch.randn(3, 4),)", "()")))
    assert "example_inputs() returned an empty tuple" in msg


def test_example_inputs_non_tensor_item(tmp_path: Path) -> None:
    msg = load_error(
        write(tmp_path, GOOD.replace("(torch.randn(3, 4),)", "[torch.randn(3, 4), 7]"))
    )
    assert "returned a list of (Tensor, int): item 1 is a int, not a torch.Tensor" in msg


def test_example_inputs_raises(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("(torch.randn(3, 4),)", "(torch.randn(3, 4) @ 2,)"))
    msg = load_error(path)
    assert msg.startswith(f"{path}:10: example_inputs() raised ")


def test_too_many_inputs(tmp_path: Path) -> None:
    msg = load_error(
        write(tmp_path, GOOD.replace("(torch.randn(3, 4),)", "(torch.randn(3, 4), torch.randn(3))"))
    )
    assert "returned 2 tensors but Sequential.forward() takes 1 positional input(s) (input)" in msg


def test_required_input_missing(tmp_path: Path) -> None:
    source = """\
    import torch
    from torch import nn

    class TwoIn(nn.Module):
        def forward(self, a, b):
            return a + b

    def build_model():
        return TwoIn()

    def example_inputs():
        return (torch.randn(2),)
    """
    msg = load_error(write(tmp_path, source))
    assert "TwoIn.forward() requires b but example_inputs() returned only 1 tensor(s)" in msg


# --- what works --------------------------------------------------------------------


def test_good_file_on_meta(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    mf = load_model_file(path)
    assert isinstance(mf, ModelFile)
    assert mf.name == "model" and mf.path == path.resolve()
    lm = instantiate(mf)
    assert isinstance(lm, LoadedModel)
    assert lm.name == "model"
    assert lm.module.training is False  # eval(): dropout off
    assert all(p.device.type == "meta" for p in lm.module.parameters())
    assert [(tuple(t.shape), t.device.type) for t in lm.inputs] == [((3, 4), "meta")]
    assert lm.input_names == ("input",)


def test_var_positional_forward_names(tmp_path: Path) -> None:
    source = """\
    import torch
    from torch import nn

    class Sum(nn.Module):
        def forward(self, first, *rest):
            return first + sum(rest)

    def build_model():
        return Sum()

    def example_inputs():
        return [torch.randn(2), torch.randn(2), torch.randn(2)]
    """
    lm = instantiate(load_model_file(write(tmp_path, source)))
    assert lm.input_names == ("first", "rest_0", "rest_1")
    assert isinstance(lm.inputs, tuple) and len(lm.inputs) == 3


def test_helper_import_dataclass_and_no_pollution(tmp_path: Path) -> None:
    write(
        tmp_path,
        "import torch\nWIDTH = 5\ndef make():\n    return torch.nn.Linear(WIDTH, 1)\n",
        "my_helper_mod.py",
    )
    source = """\
    from dataclasses import dataclass
    import torch
    import my_helper_mod

    @dataclass
    class Cfg:
        batch: int = 7

    def build_model():
        import my_helper_mod as again  # a lazy import inside the function works too
        return again.make()

    def example_inputs():
        return (torch.zeros(Cfg().batch, my_helper_mod.WIDTH),)
    """
    path = write(tmp_path, source)
    before_path, before_modules = list(sys.path), set(sys.modules)
    try:
        mf = load_model_file(path)
        lm = instantiate(mf)
        assert tuple(lm.inputs[0].shape) == (7, 5)
        assert sys.path == before_path
        assert mf.module.__name__ not in sys.modules
        assert set(sys.modules) - before_modules == set()  # the helper left with the file
        # two loads of one file are independent modules
        assert load_model_file(path).module is not mf.module
    finally:
        sys.modules.pop("my_helper_mod", None)


def test_a_helper_that_reads_the_environment_reads_each_load_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper imported through a folder the model file puts on ``sys.path`` (as
    tests/data/llama_long.py imports examples/llama.py) is imported afresh by each load:
    its module-level read of the environment sees the second load's value. (Cached, the
    second load built the first load's depth: the measured long-sequence row priced a third
    of its FLOPs after a one-block row in the same process.)"""
    shared = tmp_path / "shared"
    shared.mkdir()
    write(
        shared,
        "import os, torch\nDEPTH = int(os.environ['HELPER_DEPTH'])\n"
        "def make():\n    return torch.nn.Sequential(*[torch.nn.Linear(4, 4)] * DEPTH)\n",
        "depth_helper.py",
    )
    source = f"""\
    import sys, torch
    sys.path.insert(0, {str(shared)!r})
    import depth_helper

    def build_model():
        return depth_helper.make()

    def example_inputs():
        return (torch.zeros(2, 4),)
    """
    path = write(tmp_path, source)
    before = set(sys.modules)
    depths = []
    for depth in ("1", "3", "2"):
        monkeypatch.setenv("HELPER_DEPTH", depth)
        depths.append(len(instantiate(load_model_file(path)).module))
    assert depths == [1, 3, 2]
    assert "depth_helper" not in set(sys.modules) - before
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(shared)])


def test_cpu_device_gives_real_tensors(tmp_path: Path) -> None:
    lm = instantiate(load_model_file(write(tmp_path, GOOD)), "cpu")
    assert all(p.device.type == "cpu" for p in lm.module.parameters())
    assert lm.inputs[0].device.type == "cpu"
    out = lm.module(*lm.inputs)
    assert tuple(out.shape) == (3, 2)
    torch.testing.assert_close(out, lm.module(*lm.inputs))  # eval(): deterministic


# --- bundled examples --------------------------------------------------------------


def test_mlp_example_on_meta_and_cpu() -> None:
    mf = load_model_file(EXAMPLES / "mlp.py")
    lm = instantiate(mf)
    assert lm.name == "mlp" and lm.input_names == ("x",)
    assert [(tuple(t.shape), t.dtype) for t in lm.inputs] == [((64, 1024), torch.float32)]
    assert {n: tuple(p.shape) for n, p in lm.module.named_parameters()} == {
        "fc1.weight": (4096, 1024),
        "fc1.bias": (4096,),
        "fc2.weight": (1024, 4096),
        "fc2.bias": (1024,),
    }
    real = instantiate(mf, "cpu")
    assert tuple(real.module(*real.inputs).shape) == (64, 1024)


def test_layer_override_must_be_a_positive_integer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOSHARD_LAYERS", "two")
    with pytest.raises(AutoshardError, match=r"gpt2.py:\d+: ValueError: AUTOSHARD_LAYERS must be"):
        load_model_file(EXAMPLES / "gpt2.py")


def test_gpt2_example_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    lm = instantiate(load_model_file(EXAMPLES / "gpt2.py"))
    assert lm.name == "gpt2" and lm.input_names == ("input_ids",)
    assert [(tuple(t.shape), t.dtype, t.device.type) for t in lm.inputs] == [
        ((8, 1024), torch.int64, "meta")
    ]
    assert len(lm.module.transformer.h) == 2
    assert lm.module.config.n_embd == 768 and lm.module.config.vocab_size == 50257
    assert lm.module.config.use_cache is True  # as written; off only while tracing
    assert all(p.device.type == "meta" for p in lm.module.parameters())
    assert lm.module.training is False


def test_gpt2_example_defaults_to_12_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOSHARD_LAYERS", raising=False)
    lm = instantiate(load_model_file(EXAMPLES / "gpt2.py"))
    assert len(lm.module.transformer.h) == 12


def test_gpt2_example_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOSHARD_LAYERS", "1")
    lm = instantiate(load_model_file(EXAMPLES / "gpt2.py"), "cpu")
    assert all(p.device.type == "cpu" for p in lm.module.parameters())
    (ids,) = lm.inputs
    assert ids.device.type == "cpu" and 0 <= int(ids.min()) and int(ids.max()) < 50257
    with torch.no_grad():
        logits = lm.module(ids[:1, :16]).logits
    assert tuple(logits.shape) == (1, 16, 50257)


def test_llama_example_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    lm = instantiate(load_model_file(EXAMPLES / "llama.py"))
    assert lm.name == "llama" and lm.input_names == ("input_ids",)
    assert [(tuple(t.shape), t.dtype) for t in lm.inputs] == [((8, 1024), torch.int64)]
    cfg = lm.module.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.vocab_size) == (
        4096,
        32,
        11008,
        32000,
    )
    assert len(lm.module.model.layers) == 2
    assert tuple(lm.module.model.layers[0].mlp.gate_proj.weight.shape) == (11008, 4096)
    assert all(p.device.type == "meta" for p in lm.module.parameters())


def test_mlp_example_exports_on_meta() -> None:
    lm = instantiate(load_model_file(EXAMPLES / "mlp.py"))
    ep = torch.export.export(lm.module, lm.inputs).run_decompositions()
    ops = sorted(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    assert ops == [
        "aten.addmm.default",
        "aten.addmm.default",
        "aten.gelu.default",
        "aten.permute.default",
        "aten.permute.default",
    ]


def test_message_uses_path_relative_to_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "examples").mkdir()
    write(tmp_path / "examples", "import torch\n\ny = x + 1\n", "bad.py")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AutoshardError) as info:
        load_model_file("examples/bad.py")
    assert str(info.value) == (
        "examples/bad.py:3: NameError: name 'x' is not defined "
        "(while importing the model file; fix the file)"
    )


def test_input_that_cannot_move_to_the_device(tmp_path: Path) -> None:
    source = GOOD.replace("(torch.randn(3, 4),)", "(torch.randn(3, 4, device='meta'),)")
    with pytest.raises(AutoshardError) as info:
        instantiate(load_model_file(write(tmp_path, source)), "cpu")
    assert "example_inputs() made input 0 on meta, which cannot move to cpu" in str(info.value)


def test_bert_example_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    lm = instantiate(load_model_file(EXAMPLES / "bert.py"))
    assert lm.name == "bert" and lm.input_names == ("input_ids",)
    assert [(tuple(t.shape), t.dtype) for t in lm.inputs] == [((8, 512), torch.int64)]
    assert len(lm.module.bert.encoder.layer) == 2
    assert all(p.device.type == "meta" for p in lm.module.parameters())


HF_WITH_MASK = """
import torch
from transformers import {config}, {model}


def build_model():
    return {model}({config}({sizes}))


def example_inputs():
    return (torch.randint(0, 256, (4, 32)), torch.ones(4, 32, dtype=torch.long))
"""


def test_a_mask_bound_to_gpt2_s_cache_parameter_is_one_line(tmp_path: Path) -> None:
    """Issue 30: GPT-2 takes its KV cache second, so (input_ids, attention_mask) bound the
    mask to the cache and failed deep in tracing, blamed on control flow. Llama takes the
    mask second: the same inputs are accepted and named after its parameters."""
    gpt2 = tmp_path / "gpt2_mask.py"
    gpt2.write_text(
        HF_WITH_MASK.format(
            config="GPT2Config",
            model="GPT2LMHeadModel",
            sizes="n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=64",
        )
    )
    with pytest.raises(AutoshardError) as err:
        instantiate(load_model_file(gpt2))
    message = str(err.value)
    assert "\n" not in message
    assert "input 2 (shape (4, 32)) binds to GPT2LMHeadModel.forward()'s parameter" in message
    assert "which takes a KV cache, not a tensor" in message
    llama = tmp_path / "llama_mask.py"
    llama.write_text(
        HF_WITH_MASK.format(
            config="LlamaConfig",
            model="LlamaForCausalLM",
            sizes="hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
            "num_attention_heads=2, vocab_size=256",
        )
    )
    assert instantiate(load_model_file(llama)).input_names == ("input_ids", "attention_mask")


def _one_layer_model(layer: str, forward: str) -> str:
    """A model file's ``class M``: ``self.fc = layer``, a one-line ``forward(x)`` of
    ``forward``, and ``build_model = M``."""
    return (
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        f"        self.fc = {layer}\n"
        "    def forward(self, x):\n"
        f"        {forward}\n"
        "build_model = M\n"
    )


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_a_tracing_error_says_whether_the_model_itself_fails(tmp_path: Path, mode: str) -> None:
    """Inputs that do not fit the model (a new user's (8, 5) into ``Linear(4, 4)``) fail
    in the model itself: the error says so, where it used to advise against
    data-dependent control flow. A branch on a tensor's value fails only when traced:
    that one keeps the tracing advice."""
    from autoshard.cost.mesh import MeshSpec
    from autoshard.solver.solve import SolveConfig, trace

    cases = {
        "misfit": "build_model = lambda: torch.nn.Linear(4, 4)\n"
        "example_inputs = lambda: (torch.randn(8, 5),)\n",
        "branch": _one_layer_model(
            "torch.nn.Linear(4, 4)", "return self.fc(x) if x.sum() > 0 else -self.fc(x)"
        )
        + "example_inputs = lambda: (torch.randn(8, 4),)\n",
    }
    said = {}
    for name, body in cases.items():
        path = tmp_path / f"{name}.py"
        path.write_text("import torch\n" + body)
        with pytest.raises(AutoshardError) as err:
            trace(SolveConfig(model_path=path, mesh=MeshSpec.from_options("2"), mode=mode))
        said[name] = str(err.value)
    assert "reduction dim" in said["misfit"], said["misfit"]
    assert said["misfit"].endswith(
        "(the model raises the same on its example inputs without tracing: check "
        "example_inputs() against build_model())"
    )
    assert "make the model traceable: no data-dependent Python control flow" in said["branch"]


def test_a_new_user_s_model_file_mistakes_each_say_what_to_do(tmp_path: Path) -> None:
    """Found by trying model files as a new user writes them: a model made at import time
    (on cpu) failed in the trace with torch's "found at least two devices, meta and cpu"
    and advice against data-dependent control flow; ``.cuda()`` said only "Torch not
    compiled with CUDA enabled"; a loss_fn returning a non-scalar had that advice added
    to autoshard's own message; an integer output was called "FakeTensor"; an exception
    in ``forward()`` named no file or line."""
    from autoshard.cost.mesh import MeshSpec
    from autoshard.solver.solve import SolveConfig, trace

    linear = "import torch\nexample_inputs = lambda: (torch.randn(8, 4),)\n"
    cases = {
        "import_time": linear + "m = torch.nn.Linear(4, 4)\nbuild_model = lambda: m\n",
        "cuda": linear + "build_model = lambda: torch.nn.Linear(4, 4).cuda()\n",
        "loss": linear + "build_model = lambda: torch.nn.Linear(4, 4)\n"
        "def loss_fn(out, x):\n    return out\n",
        "integer": "import torch\nexample_inputs = lambda: (torch.randint(0, 9, (8, 3)),)\n"
        + _one_layer_model("torch.nn.Embedding(9, 4)", "return self.fc(x).argmax(-1)"),
        "raises": linear + _one_layer_model("torch.nn.Linear(4, 4)", "raise ValueError('oops')"),
    }
    said = {}
    for name, body in cases.items():
        path = tmp_path / f"{name}.py"
        path.write_text(body)
        with pytest.raises(AutoshardError) as err:
            trace(SolveConfig(model_path=path, mesh=MeshSpec.from_options("2"), mode="train"))
        said[name] = str(err.value)
        assert "\n" not in said[name] and "FakeTensor" not in said[name], said[name]
    assert (
        "build_model() returned a model whose parameter weight is on cpu, not the meta device"
        in said["import_time"]
    )
    assert "create the model inside build_model()" in said["import_time"]
    assert "drop .cuda(), .to(device) and device= from build_model()" in said["cuda"]
    assert said["loss"] == "loss_fn(output, *inputs) returned shape (8, 4); return a scalar tensor"
    assert (
        "returned an int64 tensor of shape (8, 3): there is nothing to train on"
        in (said["integer"])
    )
    assert (
        f"could not trace raises at {tmp_path / 'raises.py'}:8: ValueError: oops"
        in (said["raises"])
    )
