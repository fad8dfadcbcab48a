"""The stage plan file (``autoshard stages``; format ``autoshard.stage_plan/1``,
docs/formats.md): its reader, which validates everything a launch relies on, and its writer.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.plan.atomic import atomic_write_text
from autoshard.plan.formats import STAGE_PLAN_FORMAT
from autoshard.strategies.optimizer import OPTIMIZERS

__all__ = [
    "STAGE_PLAN_FORMAT",
    "StagePlanFile",
    "StageSpec",
    "is_stage_plan",
    "load_stage_plan",
    "save_stage_plan",
]


@dataclass(frozen=True)
class StageSpec:
    """One stage of a stage plan (docs/pipeline-stages.md, section 4).

    Attributes:
        index: 0-based stage number.
        module_paths: the blocks the stage holds, in order (for the summary).
        split_points: FQNs of the modules where the *next* stage begins
            (``SplitPoint.BEGINNING``); empty for the last stage.
        submesh: the stage's submesh shape (same number of dims as the mesh).
        ranks: the stage's global ranks, row-major.
        parameters: the stage's sharding map on its submesh, FQN -> placement strings.
    """

    index: int
    module_paths: tuple[str, ...]
    split_points: tuple[str, ...]
    submesh: tuple[int, ...]
    ranks: tuple[int, ...]
    parameters: Mapping[str, tuple[str, ...]]

    @property
    def devices(self) -> int:
        """Devices in the stage's submesh."""
        return math.prod(self.submesh)


@dataclass(frozen=True)
class StagePlanFile:
    """A stage plan file, validated (see :func:`load_stage_plan`).

    Attributes:
        source: where it was read from (for messages).
        model: the model name the plan was made for.
        mesh_shape: the whole mesh, e.g. ``(2, 4)``.
        dim_names: names of the mesh dims.
        pp: pipeline degree (number of stages).
        microbatches: micro-batches per step.
        stages: the ``pp`` stages in order.
        step_time_s: the plan's predicted step time, if any.
        optimizer: the AdamW implementation the stages were priced with (``--optimizer``;
            a file without it: the fused kernel), which the launch builds.
    """

    source: str
    model: str
    mesh_shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    pp: int
    microbatches: int
    stages: tuple[StageSpec, ...]
    step_time_s: float | None = None
    optimizer: str = "adamw-fused"

    def __post_init__(self) -> None:
        where = f"{self.source}:"
        if self.pp < 1 or len(self.stages) != self.pp:
            raise AutoshardError(
                f"{where} pp is {self.pp} but the plan lists {len(self.stages)} stage(s); "
                "write the plan again with `autoshard stages`"
            )
        if self.microbatches < 1:
            raise AutoshardError(f"{where} microbatches is {self.microbatches}; it must be >= 1")
        ranks = [r for s in self.stages for r in s.ranks]
        if sorted(ranks) != list(range(self.world_size)):
            raise AutoshardError(
                f"{where} the stages' ranks {ranks} are not 0..{self.world_size - 1}, one "
                f"stage each, for mesh {self.mesh_text}"
            )
        for s in self.stages:
            if s.devices != len(s.ranks):
                raise AutoshardError(
                    f"{where} stage {s.index} has submesh {list(s.submesh)} "
                    f"({s.devices} devices) but {len(s.ranks)} rank(s)"
                )
            last = s.index == self.pp - 1
            if last and s.split_points:
                raise AutoshardError(
                    f"{where} the last stage has split points {list(s.split_points)}; "
                    "it must have none"
                )
            if not last and len(s.split_points) != 1:
                raise AutoshardError(
                    f"{where} stage {s.index} has {len(s.split_points)} split points "
                    f"({list(s.split_points)}); each stage but the last needs exactly one"
                )

    @property
    def world_size(self) -> int:
        """Devices in the mesh: the processes a launch needs."""
        return math.prod(self.mesh_shape)

    @property
    def mesh_text(self) -> str:
        """``2x4``."""
        return "x".join(str(n) for n in self.mesh_shape)

    @property
    def split_points(self) -> list[str]:
        """Every stage boundary, in order: where stages 1..pp-1 begin."""
        return [fqn for s in self.stages for fqn in s.split_points]

    def stage_of(self, rank: int) -> StageSpec:
        """The stage that holds global ``rank``."""
        for s in self.stages:
            if rank in s.ranks:
                return s
        raise AutoshardError(f"rank {rank} is in no stage of {self.source}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise AutoshardError(f"cannot read {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise AutoshardError(f"{path} is not a text file, so not a stage plan") from e
    except json.JSONDecodeError as e:
        raise AutoshardError(
            f"{path} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})"
        ) from e


def is_stage_plan(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is JSON whose ``"format"`` is :data:`STAGE_PLAN_FORMAT`.

    Any other content (a sharding map, a pickle, an unreadable file) gives False, so the
    sharding-map loader reports what is wrong with it.
    """
    try:
        data = _read_json(Path(path))
    except AutoshardError:
        return False
    return isinstance(data, dict) and data.get("format") == STAGE_PLAN_FORMAT


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise AutoshardError(f"{what} must be a list of integers, got {value!r}")
    return tuple(value)


def _strs(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AutoshardError(f"{what} must be a list of strings, got {value!r}")
    return tuple(value)


def load_stage_plan(path: str | os.PathLike[str]) -> StagePlanFile:
    """Read and validate a stage plan written by ``autoshard stages``.

    Raises:
        AutoshardError: unreadable or not JSON; another ``format``; a missing or
            ill-typed key; stages that do not match ``pp``, the mesh's ranks or their
            submeshes; a stage other than the last without exactly one split point.
    """
    p = Path(path)
    return _parse(_read_json(p), p)


def _parse(data: Any, p: Path) -> StagePlanFile:
    """A stage plan's JSON content, validated (``p`` names it in messages)."""
    if not isinstance(data, dict) or data.get("format") != STAGE_PLAN_FORMAT:
        fmt = data.get("format") if isinstance(data, dict) else None
        raise AutoshardError(
            f"{p} has format {fmt!r}, not {STAGE_PLAN_FORMAT!r}; write it with `autoshard stages`"
        )
    try:
        mesh = data["mesh"]
        stages = []
        for i, s in enumerate(data["stages"]):
            where = f"{p}: stages[{i}]"
            params = s["parameters"]
            if not isinstance(params, dict):
                raise AutoshardError(f"{where}.parameters must be an object")
            stages.append(
                StageSpec(
                    index=i,
                    module_paths=_strs(s.get("module_paths", []), f"{where}.module_paths"),
                    split_points=_strs(s["split_points"], f"{where}.split_points"),
                    submesh=_ints(s["submesh"], f"{where}.submesh"),
                    ranks=_ints(s["ranks"], f"{where}.ranks"),
                    parameters={
                        k: _strs(v, f"{where}.parameters[{k!r}]") for k, v in params.items()
                    },
                )
            )
        step = data.get("step_time_s")
        optimizer = data.get("optimizer", OPTIMIZERS[0])
        if optimizer not in OPTIMIZERS:
            raise AutoshardError(
                f"{p}: optimizer is {optimizer!r}; expected one of {', '.join(OPTIMIZERS)} "
                "(run `autoshard stages` again)"
            )
        return StagePlanFile(
            source=str(p),
            model=str(data.get("model", "")),
            mesh_shape=_ints(mesh["shape"], f"{p}: mesh.shape"),
            dim_names=_strs(mesh.get("dim_names", []), f"{p}: mesh.dim_names"),
            pp=int(data["pp"]),
            microbatches=int(data["microbatches"]),
            stages=tuple(stages),
            step_time_s=float(step) if isinstance(step, (int, float)) else None,
            optimizer=optimizer,
        )
    except (KeyError, TypeError, ValueError) as e:
        what = f"key {e}" if isinstance(e, KeyError) else str(e)
        raise AutoshardError(
            f"{p} is not a valid stage plan ({what}); write it again with `autoshard stages`"
        ) from e


def save_stage_plan(path: str | os.PathLike[str], data: Mapping[str, Any]) -> StagePlanFile:
    """Write the stage plan ``data`` (from :func:`autoshard.pipeline.pricing.stage_plan_dict`)
    to ``path`` atomically, after checking that :func:`load_stage_plan` would accept it.

    Returns:
        The plan as :func:`load_stage_plan` reads it back.

    Raises:
        AutoshardError: ``data`` is not a valid stage plan (nothing is written), or the
            file cannot be written.
    """
    text = json.dumps(data, indent=2) + "\n"
    plan = _parse(json.loads(text), Path(path))
    atomic_write_text(path, text)
    return plan
