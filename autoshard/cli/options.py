"""The options the commands share, and what they build (a mesh, a solve config, progress).

Nothing here imports torch, HiGHS or the pipeline at import time, so that ``autoshard --help``
answers at once; :func:`config_from_options` imports them when a command runs.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from autoshard import interrupt
from autoshard.cost.devices import DEFAULT_DEVICE, DEVICES, DeviceSpec, get_device
from autoshard.cost.mesh import (
    DDP_BUCKET_BYTES,
    DEFAULT_INTER_NODE_BW,
    DEFAULT_INTER_NODE_LATENCY,
    DEFAULT_INTRA_NODE_BW,
    DEFAULT_INTRA_NODE_LATENCY,
    MeshSpec,
    parse_mesh_shape,
)
from autoshard.errors import AutoshardError
from autoshard.solver.options import FSDP_VERSIONS, WORK_LIMIT, SolverOptions
from autoshard.strategies.optimizer import OPTIMIZERS
from autoshard.units import BandwidthType, BytesType, DurationType, format_bandwidth, format_seconds

if TYPE_CHECKING:
    from autoshard.solver.solve import SolveConfig


class ContextParallelType(click.Choice):
    """``--context-parallel``'s kinds; a model file given as its value (the flag alone
    right before the file: click reads the file as the flag's value) gets an error that
    says where to put the flag."""

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201 - click's signature
        if isinstance(value, str) and value not in self.choices and value.endswith(".py"):
            self.fail(
                f"{value!r} is a model file, not a kind of context parallelism: give the "
                "flag after the model file (`autoshard solve model.py --context-parallel`) "
                f"or with its kind before it (`--context-parallel all {value}`)",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


class NonEmptyPath(click.Path):
    """A path option or argument (a :class:`pathlib.Path`) that refuses an empty string,
    which :class:`pathlib.Path` would read as the current folder (``--out ""`` wrote there
    without a word)."""

    def __init__(self) -> None:
        super().__init__(path_type=Path)

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201 - click's signature
        if isinstance(value, str) and not value.strip():
            self.fail("is empty: give a path (. for the current folder)", param, ctx)
        return super().convert(value, param, ctx)


def mesh_options(f=None, *, mesh_required: bool = True):
    """The mesh, its links and the device (shared by solve, compare and stages);
    ``@mesh_options(mesh_required=False)`` where another option can stand for ``--mesh``
    (solve's ``--gpus``)."""
    if f is None:
        return functools.partial(mesh_options, mesh_required=mesh_required)
    options = [
        click.option(
            "--mesh",
            "mesh_shape",
            # no explicit default: click 8.5 takes ``default=None`` for a given default and
            # stops enforcing ``required`` (a missing --mesh then reached MeshSpec as None)
            required=mesh_required,
            metavar="SHAPE",
            help="Devices per mesh dim, e.g. 8, 2x4, 2x2x2. Dim 0 is inter-node when there "
            "are two or more dims (MASE's convention); the rest are intra-node.",
        ),
        click.option(
            "--mesh-dim-names",
            default=None,
            metavar="NAMES",
            help="Comma-separated names of the mesh dims, e.g. dp,tp (default: dp,tp for 2 "
            "dims, d0,d1,... otherwise).",
        ),
        click.option(
            "--intra-node-bw",
            type=BandwidthType(),
            default=DEFAULT_INTRA_NODE_BW,
            show_default=format_bandwidth(DEFAULT_INTRA_NODE_BW),
            help="Bandwidth of intra-node mesh dims, each way per device: the default is "
            "what NCCL's all-gather reaches on H100 NVLink 4 (line rate 450 GB/s).",
        ),
        click.option(
            "--inter-node-bw",
            type=BandwidthType(),
            default=DEFAULT_INTER_NODE_BW,
            show_default=format_bandwidth(DEFAULT_INTER_NODE_BW),
            help="Bandwidth of the inter-node mesh dim: the default is what NCCL reaches "
            "on one 400 Gb/s NIC per GPU (line rate 50 GB/s).",
        ),
        click.option(
            "--intra-node-latency",
            type=DurationType(),
            default=DEFAULT_INTRA_NODE_LATENCY,
            show_default=format_seconds(DEFAULT_INTRA_NODE_LATENCY),
            help="Latency (alpha) of one collective step on intra-node dims.",
        ),
        click.option(
            "--inter-node-latency",
            type=DurationType(),
            default=DEFAULT_INTER_NODE_LATENCY,
            show_default=format_seconds(DEFAULT_INTER_NODE_LATENCY),
            help="Latency (alpha) of one collective step on the inter-node dim.",
        ),
        click.option(
            "--device",
            "device_name",
            default=DEFAULT_DEVICE,
            show_default=True,
            type=click.Choice(sorted(DEVICES), case_sensitive=False),
            help="GPU that prices compute (roofline). h100-measured (the default) and "
            "h200-measured price at the rates one such GPU reached (matmuls by size, "
            "attention, copy; docs/validation.md), a100-measured at published A100 "
            "benchmarks' GEMM, attention and copy rates; the plain names (h100, a100, ...) at "
            "the datasheet's peaks, which no GPU reaches.",
        ),
        click.option(
            "--profile",
            "profile_path",
            type=NonEmptyPath(),
            default=None,
            metavar="FILE",
            help="A profile from `autoshard calibrate`: measured latency and bandwidth per "
            "mesh dim, matmul and attention rates by size and memory bandwidth, in place of "
            "the link options and --device. A profile of one GPU (calibrate --mesh 1) "
            "replaces --device only, on any mesh (and with --gpus).",
        ),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def mesh_from_options(
    mesh_shape, mesh_dim_names, intra_node_bw, inter_node_bw, intra_node_latency, inter_node_latency
) -> MeshSpec:
    """Build the :class:`MeshSpec` from the CLI's mesh options."""
    names = mesh_dim_names.split(",") if mesh_dim_names else None
    return MeshSpec.from_options(
        mesh_shape,
        names,
        intra_node_bw=intra_node_bw,
        inter_node_bw=inter_node_bw,
        intra_node_latency=intra_node_latency,
        inter_node_latency=inter_node_latency,
    )


def step_options() -> list:
    """``--mode``, ``--dtype``, ``--precision`` and ``--reduce-dtype``: what one step is
    (shared by solve, compare and stages)."""
    return [
        click.option(
            "--mode",
            type=click.Choice(["train", "infer"]),
            default="train",
            show_default=True,
            help="train: cost a training step (forward + backward from the joint graph, gradient "
            "reductions, AdamW memory); infer: the forward pass only.",
        ),
        click.option(
            "--dtype",
            "dtype_name",
            type=click.Choice(["float32", "bfloat16", "float16"]),
            default=None,
            help="Cast the whole step to this dtype, a pure cast: parameters, gradients, "
            "AdamW moments and activations all in it, as torch.optim.AdamW keeps them (default: "
            "the model's). For mixed precision use --precision.",
        ),
        click.option(
            "--precision",
            type=click.Choice(["model", "fp32", "bf16-mixed", "fp16-mixed"]),
            default="model",
            show_default=True,
            help="bf16-mixed / fp16-mixed: parameters and activations in half precision for "
            "compute (the device's bf16/fp16 peak FLOP/s), fp32 master weights and AdamW "
            "moments, gradients reduced in --reduce-dtype: 2 + 4 + 4 + 8 bytes per parameter "
            "(FSDP2's MixedPrecisionPolicy, torchtitan). model: the model's own dtype.",
        ),
        click.option(
            "--reduce-dtype",
            "reduce_dtype_name",
            type=click.Choice(["float32", "bfloat16"]),
            default="float32",
            show_default=True,
            help="With --precision *-mixed: the dtype gradients are reduced in (then kept in "
            "fp32 beside the master weights).",
        ),
        click.option(
            "--activation-checkpointing",
            type=click.Choice(["auto", "none", "full", "selective"]),
            default="auto",
            show_default=True,
            help="Recompute repeated blocks (transformer layers) in the backward pass instead "
            "of keeping their activations, as torch.utils.checkpoint around each block does. "
            "auto: the ILP decides per block, only where memory needs it: keep, recompute "
            "in full (one more forward pass of the block, its collectives included) or "
            "selectively; none: keep every activation; full: every block recomputes its "
            "forward; selective: every block keeps its attention and every other matmul "
            "output and recomputes the rest (torchtitan's op-level selective AC). Training "
            "only.",
        ),
        click.option(
            "--checkpoint-early-stop/--no-checkpoint-early-stop",
            default=True,
            show_default=True,
            help="A recomputed block reruns its forward only up to the last op its backward "
            "reads (its last projection and residual add do not run again), as non-reentrant "
            "torch.utils.checkpoint does by default. --no-checkpoint-early-stop reruns the "
            "whole forward, as reentrant checkpointing (Megatron-LM's), "
            "torch.utils.checkpoint's early_stop=False or torchtitan with its activation "
            "checkpointing's early_stop off does; the launch runs it so.",
        ),
        click.option(
            "--optimizer",
            type=click.Choice(OPTIMIZERS),
            default=OPTIMIZERS[0],
            show_default=True,
            help="The AdamW implementation each parameter's step is priced as (training). "
            "adamw-fused: one kernel, 28 bytes per fp32 element (torch.optim.AdamW(fused="
            "True), apex's FusedAdam as Megatron-LM runs it); adamw-foreach: PyTorch's "
            "foreach implementation, eight passes, 80 bytes (torch.optim.AdamW's default "
            "for CUDA tensors, torchtitan's default).",
        ),
    ]


def plan_options(f):
    """The options that say what plan to find (shared by ``solve`` and ``compare``)."""
    options = [
        click.option(
            "--inputs",
            "input_placement",
            type=click.Choice(["free", "replicate"]),
            default="free",
            show_default=True,
            help="free: the ILP chooses the inputs' placements; replicate: every input starts "
            "replicated on every device.",
        ),
        click.option(
            "--outputs",
            "output_placement",
            type=click.Choice(["free", "replicate"]),
            default="free",
            show_default=True,
            help="free: outputs may end sharded (never Partial: the plan pays to reduce them); "
            "replicate: every device ends with the whole output.",
        ),
        click.option(
            "--work-limit",
            type=click.IntRange(min=1),
            default=WORK_LIMIT,
            show_default=True,
            help="Work units each MIP solve may take (HiGHS's limit checks, made at fixed "
            "points of its search); when hit, the best plan found is written with its gap. It "
            "counts work, not seconds: the same plan on every run, however busy the machine.",
        ),
        click.option(
            "--time-limit",
            type=float,
            default=None,
            help="Wall-clock seconds for the search (default: none). Each later phase (the "
            "search with the overlap savings, each memory round) still gets at least 1 s, so a "
            "limit of a few seconds can be overrun by as much. When it stops the search, the "
            "plan may differ on a busier machine; the report says so.",
        ),
        click.option(
            "--mip-gap",
            type=float,
            default=1e-2,
            show_default=True,
            help="Relative optimality gap accepted (the report shows the plan's gap to the LP "
            "bound); 0 proves optimality, which can take minutes on large models.",
        ),
        *step_options(),
        click.option(
            "--memory-budget",
            type=BytesType(),
            default=None,
            metavar="BYTES",
            help="Memory per device the plan must fit, e.g. 40GiB "
            "(default: the device's capacity).",
        ),
        click.option(
            "--bucket-size",
            "bucket_bytes",
            type=BytesType(),
            default=DDP_BUCKET_BYTES,
            show_default="25MiB, DDP's bucket_cap_mb",
            metavar="BYTES",
            help="Gradient reductions and parameter all-gathers go in buckets of this size "
            "(training): each tensor pays its share of one collective's latency; 0 gives every "
            "tensor its own collective. FSDP gathers and reduces a whole wrapped block at once: "
            "to price it as FSDP runs, give one block's parameter bytes on one device (a "
            "Llama-3-8B block in bf16: 436224000B).",
        ),
        click.option(
            "--fsdp-version",
            type=click.Choice([str(v) for v in FSDP_VERSIONS]),
            default=str(FSDP_VERSIONS[0]),
            show_default=True,
            help="Which FSDP runs the fsdp and fsdp_tp plans (training): 2, "
            "fully_shard (torchtitan), or 1, FullyShardedDataParallel (Composer, Accelerate). "
            "Their price adds the copies it makes around each collective, unsharded bytes on "
            "every device: FSDP2 casts each shard into the all-gather, copies the gathered "
            "parameters out and the gradients in; FSDP1 flattens, casts and divides the "
            "gradients (docs/cost-model.md, 'FSDP's copies').",
        ),
        click.option(
            "--grad-accumulation",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            metavar="N",
            help="Gradient accumulation (training): each step runs N micro-batches, the "
            "example inputs split into N along dim 0, each with its forward, backward and "
            "collectives (gradients reduced after every micro-batch, as FSDP runs it under "
            "Composer and torchtitan), then one optimizer step. Memory is one micro-batch's. "
            "The plan is priced, not launched: autoshard launch runs one batch per step.",
        ),
        click.option(
            "--no-overlap",
            is_flag=True,
            help="Price every collective on the critical path; by default a gradient reduction "
            "hides under the next block's backward and a parameter all-gather under the block "
            "before its use, as DDP and FSDP schedule them (training).",
        ),
        click.option(
            "--share-reshardings",
            is_flag=True,
            help="Reads of one tensor in one phase and block that want the same placement pay "
            "one resharding, as Megatron-LM's sequence parallelism gathers a norm's output once "
            "for q, k and v, and the launch moves it once; by default each read pays its own "
            "(the search is 2-5x slower with it: docs/cost-model.md).",
        ),
        click.option(
            "--context-parallel",
            type=ContextParallelType(["all", "all-gather", "ring", "zigzag"]),
            is_flag=False,
            flag_value="all",
            default=None,
            help="Attention may also be sharded by sequence on a mesh dim (context "
            "parallelism; not for attention with a mask): each device attends its queries to "
            "the dim's keys and values, all-gathered (torchtitan's all-gather CP) or passed "
            "block by block around a ring (ring attention; each pass waits for the block "
            "before it, none is priced as hidden), plain or in the zig-zag layout that "
            "gives every device the same share of a causal mask's work. Alone: the search "
            "takes whichever is fastest; 'all-gather', 'ring' or 'zigzag': that one only. By "
            "default attention splits by batch or heads only (docs/cost-model.md).",
        ),
        click.option(
            "--no-tie",
            is_flag=True,
            help="Trace every repeated layer and give each its own variables (slower); by default "
            "identical layers share one plan and one traced middle block stands for all of them.",
        ),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


_MESH_KEYS = (
    "mesh_shape",
    "mesh_dim_names",
    "intra_node_bw",
    "inter_node_bw",
    "intra_node_latency",
    "inter_node_latency",
)


MESH_LINK_KEYS = _MESH_KEYS[2:]
"""The link options (bandwidth and latency, intra- and inter-node), by keyword name."""


def mesh_and_device(opts: dict) -> tuple[MeshSpec, DeviceSpec]:
    """The mesh and the device of the mesh options (click's keyword names): from
    ``--profile`` when given (:mod:`autoshard.calibrate`), else from the link options and
    ``--device``. A profile of one device (``calibrate --mesh 1``) sets the device only:
    it holds on any mesh, whose links come from the link options.

    Raises:
        AutoshardError: a bad mesh or profile, a profile measured on another mesh (unless
            on one device), or a link option or ``--device`` given beside ``--profile``
            (which sets them; a one-device profile sets only the device).
    """
    path = opts.get("profile_path")
    if path is None:
        return mesh_from_options(*(opts[k] for k in _MESH_KEYS)), get_device(opts["device_name"])
    from autoshard.calibrate import load_profile

    profile = load_profile(path)
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        # a profile of one device (calibrate --mesh 1) sets the device only
        keys = ("device_name",) if profile.device_only else (*_MESH_KEYS[2:], "device_name")
        given = [
            "--" + k.replace("_", "-").removesuffix("-name")
            for k in keys
            if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE
        ]
        if given:
            sets = "the device" if profile.device_only else "the links and the device"
            raise AutoshardError(f"--profile sets {sets}; drop {', '.join(given)}")
    if profile.device_only:
        return mesh_from_options(*(opts[k] for k in _MESH_KEYS)), profile.device_spec()
    names = opts["mesh_dim_names"].split(",") if opts.get("mesh_dim_names") else None
    return profile.mesh(parse_mesh_shape(opts["mesh_shape"]), names), profile.device_spec()


def config_from_options(model_file: Path, opts: dict) -> SolveConfig:
    """The :class:`~autoshard.solver.solve.SolveConfig` of the mesh and planning options
    (click's keyword names).

    Raises:
        AutoshardError: a bad mesh, unit or option value.
    """
    import torch  # heavy: only once a command runs (see the package docstring)

    from autoshard.solver.solve import SolveConfig

    mesh, device = mesh_and_device(opts)
    return SolveConfig(
        model_path=model_file,
        mesh=mesh,
        device=device,
        input_placement=opts["input_placement"],
        output_placement=opts["output_placement"],
        solver=SolverOptions(
            time_limit_s=opts["time_limit"], mip_gap=opts["mip_gap"], work_limit=opts["work_limit"]
        ),
        mode=opts["mode"],
        dtype=getattr(torch, opts["dtype_name"]) if opts["dtype_name"] else None,
        precision=opts["precision"],
        reduce_dtype=getattr(torch, opts["reduce_dtype_name"]),
        memory_budget=opts["memory_budget"],
        tie=not opts["no_tie"],
        bucket_bytes=opts["bucket_bytes"],
        overlap=not opts["no_overlap"],
        share_reshardings=opts["share_reshardings"],
        context_parallel={None: False, "all": True}.get(
            opts["context_parallel"], opts["context_parallel"]
        ),
        activation_checkpointing=opts.get("activation_checkpointing", "auto"),
        checkpoint_early_stop=opts.get("checkpoint_early_stop", True),
        optimizer=opts.get("optimizer", OPTIMIZERS[0]),
        fsdp_version=int(opts.get("fsdp_version", FSDP_VERSIONS[0])),
        grad_accumulation=int(opts.get("grad_accumulation", 1)),
    )


class Progress:
    """Progress of the long phases (trace, strategies, solve): a rich bar on a terminal;
    elsewhere (a pipe, a CI log) one line when a phase starts and one with its seconds when
    it ends, so that a piped run is never silent for minutes.

    While a MIP runs (:func:`autoshard.solver.highs.listening`), its incumbent, bound and
    gap show beside the solve phase on a terminal, and as a line every
    :attr:`EVERY_S` seconds elsewhere. Where several run at once (the mesh search's
    lanes), each is labelled with its subject (:func:`autoshard.solver.highs.about`): on
    a terminal each thread's latest side by side, elsewhere a line per subject. Only what
    is printed depends on the clock, never the plan. ``step_per_objective``: seconds of the
    step per second of the ILP's objective (``--grad-accumulation``'s N: the ILP prices one
    micro-batch), so that the incumbent and bound shown are the step's."""

    EVERY_S = 5.0
    STALE_S = 1.0  # a running MIP reports every 0.1 s; one silent this long has ended

    LABELS = {
        "trace": "tracing (torch.export, meta device)",
        "strategies": "generating strategies",
        "solve": "solving the ILP (HiGHS)",
        "space": "pricing the space's plans (DTensor's propagation)",
    }

    def __init__(self, console: Console, step_per_objective: float = 1.0) -> None:
        self.console = console
        self.scale = step_per_objective
        self.lines = not console.is_terminal
        self.bar = RichProgress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=self.lines,
        )
        self.tasks: dict[str, int] = {}
        self.started: dict[str, float] = {}
        self.counted: dict[str, float] = {}  # when a phase's count was last printed
        self.finished: set[str] = set()

    def __enter__(self):
        from autoshard.solver.highs import listening  # heavy (HiGHS): once a command runs

        self.bar.__enter__()
        self.listening = listening(self.solver)
        self.listening.__enter__()
        self.last_line: dict[str | None, float] = {}  # per subject, when last printed
        self.running: dict[int, tuple[float, str]] = {}  # per thread: when, its latest report
        self.lock = threading.Lock()  # the lanes report from their own threads
        return self

    def __exit__(self, *exc):
        self.listening.__exit__(*exc)
        return self.bar.__exit__(*exc)

    def solver(self, p) -> None:  # noqa: ANN001 - an autoshard.solver.highs.SolverProgress
        """One MIP progress report: the incumbent, bound and gap, on the solve phase."""

        def value(v: float | None) -> str:
            if v is None:
                return "none yet"
            return format_seconds(v * self.scale) if p.in_seconds else f"{v:.6g}"

        gap = f"{100 * p.gap:.2f}%" if p.gap is not None else "-"
        text = f"incumbent {value(p.incumbent)}, bound {value(p.bound)}, gap {gap}"
        if not p.mip:
            text = f"linear relaxation, {p.iterations} simplex iterations"
        if p.subject is not None:  # one of several MIPs at once (the mesh search's lanes)
            text = f"{p.subject}: {text}"
        label = self.LABELS["solve"]
        if self.lines:
            now = time.perf_counter()
            if now - self.last_line.get(p.subject, -float("inf")) >= self.EVERY_S:
                self.last_line[p.subject] = now
                seconds = now - self.started.setdefault("solve", now)
                self.console.print(f"{label}: {seconds:.0f} s, {text}", highlight=False)
            return
        if "solve" not in self.tasks:  # a command that reports no phases (stages)
            self.tasks["solve"] = self.bar.add_task(label, total=None)
        # each thread's latest report, while it reports (every 0.1 s): a MIP that ended
        # leaves the line a second later
        now = time.perf_counter()
        with self.lock:
            self.running[threading.get_ident()] = (now, text)
            shown = "; ".join(t for at, t in self.running.values() if now - at <= self.STALE_S)
        self.bar.update(self.tasks["solve"], description=f"{label}: {shown}")

    def __call__(self, phase: str, done: int, total: int) -> None:
        interrupt.check()  # a Ctrl-C that landed in a finaliser and was swallowed stops here
        label = self.LABELS.get(phase, phase)
        if self.lines:
            now = time.perf_counter()
            if phase not in self.started:
                self.started[phase] = self.counted[phase] = now
                self.console.print(f"{label} ...", highlight=False)
            elif 0 < done < total and now - self.counted.get(phase, 0.0) >= self.EVERY_S:
                self.counted[phase] = now  # a long phase of many steps: its count
                self.console.print(f"{label}: {done}/{total}", highlight=False)
            if done >= total and phase not in self.finished:
                self.finished.add(phase)
                seconds = time.perf_counter() - self.started[phase]
                self.console.print(f"{label}: done in {seconds:.1f} s", highlight=False)
            return
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(label, total=total)
        self.bar.update(self.tasks[phase], completed=done, total=total)


def check_writable(out_dir: Path, option: str = "--out") -> None:
    """Prove a file can be written in ``--out`` (or, when it does not exist yet, in its
    nearest existing parent, where it will be created) before any work, so that a long
    solve never ends in a folder it cannot write. Creates nothing. ``option``: the
    option the error names.

    Raises:
        AutoshardError: a file stands where a folder is needed, or the folder cannot be
            written.
    """
    try:
        existing = out_dir
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise NotADirectoryError(20, f"{existing} is a file, not a folder")
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".autoshard-write-check.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise AutoshardError(
            f"cannot write to {option} {out_dir}: {exc.strerror or exc}; pick a writable folder"
        ) from exc


def check_out_folder(out_dir: Path, files: str) -> None:
    """:func:`check_writable` for an ``--out`` that names the folder of the files written
    (``files``: what it gets, for the message), refusing a path that does not exist and
    is named like one of those files (``--out plan.pkl``), which would be made a folder.

    Raises:
        AutoshardError: as :func:`check_writable`, or a new ``--out`` named ``*.pkl`` or
            ``*.json``.
    """
    if out_dir.suffix.lower() in (".pkl", ".json") and not out_dir.is_dir():
        raise AutoshardError(
            f"--out {out_dir} looks like a file name, but --out is the folder that gets "
            f"{files}: give a folder (e.g. --out {out_dir.parent})"
        )
    check_writable(out_dir)


def check_writable_file(path: Path, option: str) -> None:
    """:func:`check_writable` for a file an option names (``--html``, ``--json``): its
    folder must be writable and the path no folder, checked before any work.

    Raises:
        AutoshardError: ``path`` is a folder, or its folder cannot be written.
    """
    if path.is_dir():
        raise AutoshardError(f"{option} {path} is a folder: give the path of a file to write")
    check_writable(path.parent, option)


def refuse_overwriting_preload(preload: Path | None, out_dir: Path, stem: str) -> None:
    """A solve never replaces the file it preloads.

    Raises:
        AutoshardError: ``out_dir/<stem>.pkl`` or ``.json`` is the ``--preload`` file.
    """
    if preload is None:
        return
    for suffix in (".pkl", ".json"):
        target = out_dir / f"{stem}{suffix}"
        if target.resolve() == Path(preload).resolve():
            raise AutoshardError(
                f"this solve would write {target}, which is the --preload file: give another "
                "--out so that the stored plan is kept"
            )


REPORT_WIDTH = 160
"""Columns of a report written to a file or a pipe: rich takes 80 there, which cut the
compare table's numbers ("all-gath…", "-1.19…")."""


def report_console(**kwargs) -> Console:  # noqa: ANN003 - rich.console.Console's own
    """A rich ``Console`` for a report: the terminal's width on a terminal, else
    :data:`REPORT_WIDTH` columns (or ``COLUMNS`` when set)."""
    console = Console(**kwargs)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = REPORT_WIDTH
    return console
